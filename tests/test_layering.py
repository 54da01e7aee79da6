"""The rooms and their arrows (docs/theory.md, "Code layout"): every import runs down the table.

The base (`torch_hca.errors`, `torch_hca._torch_private`) is importable from anywhere. Then, each
room importing only the rooms listed beside it:

    spmd       the algebra: placements, the move table, graph facts, op families, the cost model
    runtime    the mesh, rank-to-rank exchange, launching ranks
    compiler   the logical program, lifting, the layout choice (layout/), the checks (checks/)
    report     typed records, the tables, the predicted step
    api        what users call: sharded, plan, collectives, gradients, step, checkpoints, calibrate
    verify     the strategy file's independent checker: the spmd algebra and the errors, nothing else
    passes     the compile passes (the repository's passes/, installed as torch_hca.passes)
    backends   the torch.compile backend (backends/, installed as torch_hca.backends)
    tools      bench, demo, zoo: only the command line (torch_hca/__main__.py) reaches them

Read from the source with `ast`, so an import inside a function counts too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Source folder -> the package it installs as (pyproject's package-dir mapping).
PACKAGES = {"torch_hca": "torch_hca", "passes": "torch_hca.passes", "backends": "torch_hca.backends"}

# Module prefix -> room; the first match wins, so the package root comes last.
ROOMS = (
    ("torch_hca.errors", "base"),
    ("torch_hca._torch_private", "base"),
    ("torch_hca.spmd", "spmd"),
    ("torch_hca.runtime", "runtime"),
    ("torch_hca.compiler", "compiler"),
    ("torch_hca.report", "report"),
    ("torch_hca.api", "api"),
    ("torch_hca.verify", "verify"),
    ("torch_hca.passes", "passes"),
    ("torch_hca.backends", "backends"),
    ("torch_hca.tools", "tools"),
    ("torch_hca.__main__", "command line"),
    ("torch_hca", "package root"),
)
_BELOW = ("base", "spmd", "runtime", "compiler", "report")
MAY_IMPORT = {
    "base": ("base",),
    "spmd": ("base", "spmd"),
    "runtime": ("base", "spmd", "runtime"),
    "compiler": ("base", "spmd", "runtime", "compiler"),
    "report": _BELOW,
    "verify": ("base", "spmd", "verify"),  # the independent verifier: the algebra only, never the compiler
    "api": (*_BELOW, "api"),
    "passes": (*_BELOW, "passes"),
    "backends": (*_BELOW, "api", "passes", "backends"),
    "tools": (*_BELOW, "api", "passes", "backends", "tools", "package root"),
    "command line": (*_BELOW, "api", "verify", "tools", "package root"),
    "package root": (*_BELOW, "api", "verify", "package root"),
}


def room_of(module: str) -> str | None:
    for prefix, room in ROOMS:
        if module == prefix or module.startswith(prefix + "."):
            return room
    return None


def _module_name(folder: str, path: Path) -> str:
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGES[folder], *parts])


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_modules(folder: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the file, relative ones resolved.

    ``from X import y`` yields both X and X.y (y may be a submodule).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(folder, path)
    package = here if _is_package(path) else here.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            found.append((node.lineno, node.args[0].value))
    return found


def _is_dynamic_import(call: ast.Call) -> bool:
    """``importlib.import_module("literal")`` or ``__import__("literal")``."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
    return (
        name in ("import_module", "__import__")
        and bool(call.args)
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    )


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _violations(folder: str) -> list[str]:
    bad = []
    for path in _sources(folder):
        here = room_of(_module_name(folder, path))
        for line, module in imported_modules(folder, path):
            there = room_of(module)
            if there is not None and module != "torch_hca" and there not in MAY_IMPORT[here]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({here} -> {there})")
    return bad


def test_every_room_is_in_the_table_and_has_code():
    rooms = {room for _, room in ROOMS}
    assert rooms == set(MAY_IMPORT)
    found = {room_of(_module_name(folder, p)) for folder in PACKAGES for p in _sources(folder)}
    assert found == rooms


def test_the_folders_are_the_rooms():
    """Every module of torch_hca/ sits in a room's folder; only the base and the entry points at its top."""
    top = sorted(p.name for p in (ROOT / "torch_hca").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_torch_private.py", "errors.py"]


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_every_import_runs_down_the_table(folder):
    assert _sources(folder), f"no Python files under {folder}/"
    assert _violations(folder) == []


def test_imports_are_resolved_against_the_installed_names(tmp_path, monkeypatch):
    """The checker itself: relative imports resolve through the package-dir mapping."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    core = tmp_path / "torch_hca"
    passes = tmp_path / "passes"
    core.mkdir()
    passes.mkdir()
    (core / "bad.py").write_text("def f():\n    from .passes import layout\n")
    (core / "dyn.py").write_text("import importlib\nimportlib.import_module('torch_hca.backends.emit')\n")
    (core / "ok.py").write_text("from . import errors\nfrom .errors import CheckError\nimport torch_hca.api.plan\n")
    (core / "runtime").mkdir()
    (core / "runtime" / "up.py").write_text("from ..compiler.logical import ENTER\nfrom ..spmd import placements\n")
    (passes / "__init__.py").write_text("")
    (passes / "worse.py").write_text("from ..backends import emit\n")
    (passes / "fine.py").write_text(
        "from .infra import PassContext\nfrom torch_hca.report.compile_report import GraphReport\n"
    )

    assert imported_modules("passes", passes / "worse.py") == [
        (1, "torch_hca.backends"),
        (1, "torch_hca.backends.emit"),
    ]
    assert imported_modules("passes", passes / "fine.py")[0] == (1, "torch_hca.passes.infra")
    assert _violations("torch_hca") == [
        "torch_hca/bad.py:2 imports torch_hca.passes (package root -> passes)",
        "torch_hca/bad.py:2 imports torch_hca.passes.layout (package root -> passes)",
        "torch_hca/dyn.py:2 imports torch_hca.backends.emit (package root -> backends)",
        "torch_hca/runtime/up.py:1 imports torch_hca.compiler.logical (runtime -> compiler)",
        "torch_hca/runtime/up.py:1 imports torch_hca.compiler.logical.ENTER (runtime -> compiler)",
    ]
    assert _violations("passes") == [
        "passes/worse.py:1 imports torch_hca.backends (passes -> backends)",
        "passes/worse.py:1 imports torch_hca.backends.emit (passes -> backends)",
    ]


def test_import_torch_hca_loads_neither_passes_nor_backends():
    code = "import sys, torch_hca; print(sorted(m for m in sys.modules if m.startswith('torch_hca.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert "torch_hca.api.plan" in loaded  # the check sees the core's modules
    assert [m for m in loaded if m.startswith(("torch_hca.passes", "torch_hca.backends"))] == []


def test_the_verifier_imports_only_the_algebra_and_the_errors():
    """torch_hca/verify/ shares no code with the compiler that wrote the strategy (docs/strategy.md)."""
    allowed = ("torch_hca.errors", "torch_hca.spmd", "torch_hca.verify")
    found = [
        (p.name, line, m)
        for p in (ROOT / "torch_hca" / "verify").rglob("*.py")
        for line, m in imported_modules("torch_hca", p)
        if m.startswith("torch_hca")
    ]
    assert found, "no torch_hca import read from torch_hca/verify/"
    assert [f for f in found if not m_allowed(f[2], allowed)] == []


def m_allowed(module: str, allowed: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)
