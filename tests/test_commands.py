"""The README's commands, its Use snippet and the examples, run as a user would.

What launches ranks runs them once per launcher: the README's Use snippet as a script under
`python` (`hca.run` starts 2 local ranks) and under torchrun, and an example under torchrun. The
demo command and every example's `main` run on the session's ranks (tests/conftest.py) instead of
in 2 or 4 new interpreters each, as tests/test_bench.py runs the bench command: the same code on
the same number of gloo ranks, with the script entry each would launch them by checked apart.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import pathlib
import socket
import subprocess
import sys

import pytest

import launch_cases
from doc_blocks import runnable_blocks, run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo on loopback under torchrun too
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_python_dash_m_torch_hca_is_the_command_line():
    out = run(sys.executable, "-m", "torch_hca", "--help", timeout=120)
    assert all(command in out for command in ("demo", "bench", "calibrate", "verify")), out


def test_demo(worlds):
    """``python -m torch_hca demo``, its ranks the session's world of 2."""
    from torch_hca.__main__ import main as command_line
    from torch_hca.tools import demo

    def launch(fn, world_size, *args):
        return worlds(world_size).run(launch_cases.leaving_nothing_compiled, fn, *args)

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(demo, "launch", launch)
        code = command_line(["demo"])
    out = printed.getvalue()
    assert code == 0, out[-3000:]
    assert "== DTensor program (rank 0) ==" in out and "== collectives in the compiled graphs ==" in out
    # GPT, 2 Megatron layers: one all-reduce per attention and per MLP, each way; the tied,
    # replicated embedding needs none (every rank reads the whole batch).
    assert "collectives per step: forward {'all_reduce': 4}, backward {'all_reduce': 4}" in out
    assert "PASS: gradients match a single device" in out
    # Read by people: no line wider than 120 characters, no table cell taller than 3 lines,
    # and module paths as they are written (blocks.0.norm2), not Dynamo's sources.
    wide = [line for line in out.splitlines() if len(line) > 120]
    assert not wide, wide
    table = out.split("== collectives in the compiled graphs ==")[1].split("== summary ==")[0].strip().splitlines()
    rows = [i for i, line in enumerate(table) if not line.startswith(" ")] + [len(table)]
    tallest = max(b - a for a, b in zip(rows, rows[1:]))
    assert tallest <= 3, f"a row of {tallest} lines:\n" + "\n".join(table)
    assert "(redistribute, blocks." in out and "_hca_logical" not in out and "L['self']" not in out


EXAMPLES = {  # what each example prints on rank 0
    "tensor_parallel_mlp.py": "loss after 3 steps",
    "data_parallel.py": "reduce_gradients: 1 bucket(s), 16896 bytes, 8 parameters",
    "dp_tp_2d.py": "all_reduce",
    "transformer_block.py": "max gradient relative error",
    "heterogeneous.py": "PASS",
    "mixed_devices.py": "PASS",
}
# `python examples/NAME.py` starts its ranks by `hca.run(main, n)` (checked below), as the README's
# Use snippet does (run as a script below): each example's `main` runs on the session's n ranks.


def _entry_world_size(script: str) -> int:
    """n of the script's last statement, ``if __name__ == "__main__": hca.run(main, n)``."""
    last = ast.parse((ROOT / "examples" / script).read_text(encoding="utf-8")).body[-1]
    assert ast.unparse(last.test) == "__name__ == '__main__'", script
    (call,) = last.body
    assert ast.unparse(call.value.func) == "hca.run" and ast.unparse(call.value.args[0]) == "main", script
    return call.value.args[1].value


def test_every_example_is_listed_and_starts_its_ranks_by_hca_run():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(EXAMPLES)
    assert {s: _entry_world_size(s) for s in EXAMPLES} == {s: 4 if s == "dp_tp_2d.py" else 2 for s in EXAMPLES}


@pytest.mark.parametrize("script,expect", EXAMPLES.items())
def test_example_main_on_local_ranks(worlds, script, expect):
    printed = worlds(_entry_world_size(script)).run(launch_cases.example_main, str(ROOT / "examples" / script))
    assert expect in printed[0] and not any(printed[1:]), printed  # rank 0 prints


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The README's script, started both ways its text says; torchrun's path is `hca.run`'s under torchrun,
# the same for every example (each one's `main` runs on local ranks in test_example_main_on_local_ranks).
USE = [b for b in runnable_blocks([ROOT / "README.md"]) if b.tag == "torchrun"]


@pytest.mark.parametrize("block", USE, ids=[b.id for b in USE])
def test_readme_use_snippet_with_python(block, tmp_path):
    assert "all_reduce" in run_script(block, tmp_path, sys.executable)


@pytest.mark.parametrize("block", USE, ids=[b.id for b in USE])
def test_readme_use_snippet_under_torchrun(block, tmp_path):
    out = run_script(
        block,
        tmp_path,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_loopback_port()),
        "--local-addr",
        "127.0.0.1",
        timeout=180,
    )
    assert "all_reduce" in out
