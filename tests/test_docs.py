"""The docs run and say what is true.

* Every ```python block that README.md or a page under docs/ marks ``<!-- runnable -->``
  runs as written, saved as a file, in a subprocess with a timeout (tests/doc_blocks.py);
  the README's ``<!-- runnable: torchrun -->`` Use snippet is run by tests/test_commands.py,
  with ``python`` and under ``torchrun``.
* Claims a test can check are checked: every error class the docs list exists, is exported
  by torch_hca and is an ``hca.HCAError``; the error module defines each one the API page
  says it does; docs/concepts.md numbers the pipeline's stages in the order the pipeline's
  table (`backends/pipeline.py:STAGES`) runs them.
"""

from __future__ import annotations

import re
import sys

import pytest

import torch_hca as hca
import torch_hca.errors
from doc_blocks import ROOT, runnable_blocks, run_script

BLOCKS = runnable_blocks()
PLAIN = [b for b in BLOCKS if b.tag == ""]


def test_there_are_runnable_blocks_and_their_tags_are_known():
    assert PLAIN, "no <!-- runnable --> block in README.md or docs/"
    unknown = [b.id for b in BLOCKS if b.tag not in ("", "torchrun")]
    assert not unknown, f"unknown runnable tags (use <!-- runnable --> or <!-- runnable: torchrun -->): {unknown}"
    # tests/test_commands.py runs the torchrun-tagged blocks, and it reads the README's only.
    elsewhere = [b.id for b in BLOCKS if b.tag == "torchrun" and b.path != "README.md"]
    assert not elsewhere, f"torchrun blocks outside README.md are run by nobody: {elsewhere}"
    assert [b for b in BLOCKS if b.tag == "torchrun" and b.path == "README.md"], "the README's Use snippet is unmarked"


@pytest.mark.parametrize("block", PLAIN, ids=[b.id for b in PLAIN])
def test_runnable_block_runs(block, tmp_path):
    run_script(block, tmp_path, sys.executable, timeout=240)


def _error_names(page: str, section: str) -> list[str]:
    """The error classes a page lists: `### hca.X` headings of its Errors section, or `## X` headings."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    if section:
        text = text[text.index(section) :]
    return re.findall(r"^#{2,3} `(?:hca\.)?(\w+Error)`", text, re.MULTILINE)


@pytest.mark.parametrize("page,section", [("api.md", "## Errors"), ("troubleshooting.md", "")])
def test_the_error_classes_the_docs_list_exist_and_are_hca_errors(page, section):
    names = _error_names(page, section)
    assert "HCAError" in names and len(names) >= 10, names
    for name in names:
        cls = getattr(hca, name, None)
        assert isinstance(cls, type) and issubclass(cls, hca.HCAError), f"docs/{page}: {name} is no hca.HCAError"
        assert name in hca.__all__, f"docs/{page}: {name} is not exported by torch_hca"


def test_the_error_module_defines_the_base_errors():
    defined = {n for n, v in vars(torch_hca.errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    listed = set(_error_names("api.md", "## Errors")) - {"CheckpointError"}  # torch_hca.api.checkpoint's
    assert listed <= defined, f"docs/api.md lists errors torch_hca/errors.py does not define: {listed - defined}"
    assert hca.CheckpointError.__module__ == "torch_hca.api.checkpoint"


def test_the_api_page_promises_every_error_is_an_hca_error():
    """docs/api.md promises every error on bad input is an HCAError; the 0-d output gap is closed
    (tests/test_loss_reduction.py), so the page names no exception any more."""
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    head = api.split("## Meshes")[0]
    assert "is a subclass of `hca.HCAError`." in head and "IndexError" not in head


def test_the_concepts_page_lists_the_pipeline_stages_in_the_order_they_run():
    from torch_hca.backends.pipeline import STAGES

    text = (ROOT / "docs" / "concepts.md").read_text()
    section = text.split("## 3. The pipeline", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^(\d+)\. \*\*([^*]+)\*\*", section, re.M)
    # The run_pass list above them (1. dumps, 2. lints, 3. appends) has no bold names: only stages match.
    named = [(int(n), name.lower().removesuffix(" pass")) for n, name in steps]
    assert named == [(i + 1, name.lower()) for i, (name, _) in enumerate(STAGES)]


def test_the_code_layout_names_every_module_of_every_room():
    import fnmatch
    import subprocess

    text = (ROOT / "docs" / "theory.md").read_text(encoding="utf-8")
    section = text.split("## 7. Code layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w/]+/)`[^|]*\|[^|]*\| ([^|]*) \|$", section, re.M)
    assert len(rows) >= 8, "docs/theory.md's code-layout table is gone"
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    unnamed = []
    for folder, modules in rows:
        names = re.findall(r"`([\w/*]+)`", modules)
        for path in tracked.split():
            inside = path.removeprefix(folder)
            if not path.startswith(folder) or inside.endswith("__init__.py"):
                continue
            if folder == "torch_hca/" and "/" in inside:
                continue  # the base row holds torch_hca/'s own modules; the rooms have their rows
            if not any(fnmatch.fnmatch(inside.removesuffix(".py"), n) for n in names):
                unnamed.append(path)
    assert not unnamed, f"docs/theory.md, section 7, does not name {unnamed}"
