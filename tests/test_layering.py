"""The layering is one-way (docs/theory.md, section 7): spmd <- core <- passes <- backends.

The algebra in torch_hca/spmd/ imports nothing of torch_hca but itself and the
base (`torch_hca.errors`, `torch_hca._torch_private`); nothing but the command
line (`torch_hca/__main__.py`) imports the tooling in torch_hca/tools/; modules in torch_hca/
(the core) never import torch_hca.passes or torch_hca.backends; modules in
passes/ never import torch_hca.backends. Read from the source with `ast`, so an
import inside a function counts too.
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
FORBIDDEN = {
    "torch_hca": ("torch_hca.passes", "torch_hca.backends"),
    "passes": ("torch_hca.backends",),
    "backends": (),
}


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
        for line, module in imported_modules(folder, path):
            for forbidden in FORBIDDEN[folder]:
                if module == forbidden or module.startswith(forbidden + "."):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


SPMD_MAY_IMPORT = ("torch_hca.spmd", "torch_hca.errors", "torch_hca._torch_private")


def test_the_algebra_imports_nothing_above_it():
    spmd = sorted((ROOT / "torch_hca" / "spmd").rglob("*.py"))
    assert spmd, "no torch_hca/spmd package"
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in spmd for line, module in imported_modules("torch_hca", path)
           if (module == "torch_hca" or module.startswith("torch_hca."))
           and not any(module == m or module.startswith(m + ".") for m in SPMD_MAY_IMPORT)]
    assert bad == []


def test_the_compiler_never_imports_its_tooling():
    """torch_hca/tools/ (bench, demo, zoo, profiling) sits on top: only the command line reaches it."""
    core = [p for p in _sources("torch_hca") if "tools" not in p.relative_to(ROOT).parts and p.name != "__main__.py"]
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for folder, paths in (("torch_hca", core), ("passes", _sources("passes")), ("backends", _sources("backends")))
           for path in paths for line, module in imported_modules(folder, path)
           if module == "torch_hca.tools" or module.startswith("torch_hca.tools.")]
    assert bad == []


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_layering_is_one_way(folder):
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
    (core / "ok.py").write_text("from . import report\nfrom .errors import CheckError\nimport torch_hca.plan\n")
    (passes / "__init__.py").write_text("")
    (passes / "worse.py").write_text("from ..backends import emit\n")
    (passes / "fine.py").write_text("from .infra import PassContext\nfrom torch_hca.report import GraphReport\n")

    assert imported_modules("passes", passes / "worse.py") == [(1, "torch_hca.backends"), (1, "torch_hca.backends.emit")]
    assert imported_modules("passes", passes / "fine.py")[0] == (1, "torch_hca.passes.infra")
    assert _violations("torch_hca") == [
        "torch_hca/bad.py:2 imports torch_hca.passes",
        "torch_hca/bad.py:2 imports torch_hca.passes.layout",
        "torch_hca/dyn.py:2 imports torch_hca.backends.emit",
    ]
    assert _violations("passes") == [
        "passes/worse.py:1 imports torch_hca.backends",
        "passes/worse.py:1 imports torch_hca.backends.emit",
    ]


def test_import_torch_hca_loads_neither_passes_nor_backends():
    code = "import sys, torch_hca; print(sorted(m for m in sys.modules if m.startswith('torch_hca.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert "torch_hca.plan" in loaded  # the check sees the core's modules
    assert [m for m in loaded if m.startswith(("torch_hca.passes", "torch_hca.backends"))] == []
