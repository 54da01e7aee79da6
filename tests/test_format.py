"""Every tracked Python file is as `ruff format` writes it (the settings: pyproject.toml, [tool.ruff])."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[test]' installs it)"
)
def test_tracked_python_files_are_formatted():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = tracked.split()
    assert files, "no tracked Python file found: not a git checkout?"
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *files], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, f"run `ruff format` on these:\n{done.stdout}{done.stderr}"
