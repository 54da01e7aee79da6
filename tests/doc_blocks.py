"""The code blocks that README.md and docs/*.md mark runnable, and how to run one.

A block is runnable when the line before its opening fence is an HTML comment (invisible on
GitHub):

    <!-- runnable -->            tests/test_docs.py runs it with `python`
    <!-- runnable: torchrun -->  tests/test_commands.py runs it with `python` and under
                                 `torchrun --nproc-per-node 2` (README only)

A runnable block is a whole script: it runs as written, saved as a file, at its own small
sizes, in a fresh process.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- runnable(?:: *([\w-]+))? -->\n```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # the line of its opening fence
    tag: str  # "" or the marker's tag ("torchrun")
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(paths: list[pathlib.Path] | None = None) -> list[Block]:
    blocks = []
    for path in paths or markdown_files():
        text = path.read_text(encoding="utf-8")
        for m in MARKER.finditer(text):
            line = text.count("\n", 0, m.start()) + 2
            blocks.append(Block(str(path.relative_to(ROOT)), line, m.group(1) or "", m.group(2)))
    return blocks


def clean_env() -> dict[str, str]:
    """This environment less any torchrun variables, gloo on loopback."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def run_script(block: Block, folder: pathlib.Path, *launcher: str, timeout: int = 300) -> str:
    """Save `block` as a file in `folder`, run it (`python FILE`, or `*launcher FILE`), return stdout."""
    script = folder / f"{pathlib.Path(block.path).stem.lower()}_{block.line}.py"
    script.write_text(block.code, encoding="utf-8")
    out = subprocess.run(
        [*launcher, str(script)], capture_output=True, text=True, cwd=folder, timeout=timeout, env=clean_env()
    )
    assert out.returncode == 0, f"{block.id} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout
