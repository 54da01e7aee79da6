"""Packaging: the wheel holds every subpackage, and backend "hca" is found without importing torch_hca."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_contains_passes_and_backends(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("torch_hca-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every subpackage (a folder with an __init__.py), each module of it: one left out of
    # pyproject's package list is silently missing from the wheel.
    folders = {"torch_hca/passes": "passes", "torch_hca/backends": "backends"}
    folders |= {
        p.parent.relative_to(ROOT).as_posix(): p.parent.relative_to(ROOT).as_posix()
        for p in (ROOT / "torch_hca").rglob("__init__.py")
    }
    for package, folder in folders.items():
        sources = {p.name for p in (ROOT / folder).glob("*.py")}
        assert sources and {f"{package}/{s}" for s in sources} <= names, f"{folder}/ missing from the wheel"
    assert not any(n.startswith(("passes/", "backends/", "tests/")) for n in names), "a bare top-level package leaked"
    assert "torch_hca/py.typed" in names, "the PEP 561 marker is missing from the wheel (package-data)"
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), (
        "LICENSE missing"
    )
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[torch_dynamo_backends]" in text and "hca = torch_hca.backends.entry:hca_backend" in text


def test_backend_is_found_without_importing_torch_hca(tmp_path):
    code = (
        "import sys, torch\n"
        "from torch._dynamo import list_backends, lookup_backend\n"
        "assert 'torch_hca' not in sys.modules\n"
        "assert 'hca' in list_backends(exclude_tags=())\n"
        "fn = lookup_backend('hca')\n"
        "print(fn.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip() == "torch_hca.backends.entry"


def test_bare_passes_package_refuses_import():
    code = "import passes"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "import this package as torch_hca.passes" in out.stderr
