"""docs/api.md stays true: every public name, backend option and collective has its entry."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import torch_hca as hca
from torch_hca.compiler.options import Options

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text()
HEADINGS = [line for line in API.splitlines() if line.startswith("#")]


def _section(title: str) -> str:
    """The text under the heading that contains `title`, up to the next heading of any level."""
    start = next(i for i, line in enumerate(API.splitlines()) if line.startswith("#") and title in line)
    lines = API.splitlines()[start + 1 :]
    end = next((i for i, line in enumerate(lines) if line.startswith("#")), len(lines))
    return "\n".join(lines[:end])


def test_every_public_name_has_a_heading():
    missing = [n for n in hca.__all__ if not any(f"`hca.{n}" in h for h in HEADINGS)]
    assert not missing, f"docs/api.md has no heading for {missing}"


def test_every_backend_option_is_in_the_table():
    rows = set(re.findall(r"^\| `(\w+)` \|", API, re.MULTILINE))
    missing = [f.name for f in dataclasses.fields(Options) if f.name not in rows]
    assert not missing, f"docs/api.md's options table lacks {missing}"


def test_every_collective_has_a_heading():
    missing = [n for n in hca.collectives.__all__ if not any(f"`hca.collectives.{n}" in h for h in HEADINGS)]
    assert not missing, f"docs/api.md has no heading for hca.collectives.{missing}"


def test_every_compile_report_member_is_described():
    text = _section("`hca.CompileReport`")
    members = [n for n, _ in inspect.getmembers(hca.CompileReport) if not n.startswith("_")]
    missing = [n for n in members if f"`{n}" not in text]
    assert not missing, f"docs/api.md's CompileReport section lacks {missing}"


def test_every_error_class_is_in_troubleshooting():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    errors = [n for n in hca.__all__ if isinstance(getattr(hca, n), type) and issubclass(getattr(hca, n), hca.HCAError)]
    missing = [n for n in errors if not re.search(rf"^#+ .*`{n}`", text, re.MULTILINE)]
    assert not missing, f"docs/troubleshooting.md has no section for {missing}"
