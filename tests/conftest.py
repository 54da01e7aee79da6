"""Shared fixtures.

* ``fake_pg``: a fake process group of world size 4 in this process, for graph-only
  checks (its collective results are garbage by design: never check numbers with it).
* ``world2`` / ``world4``: real gloo ranks on 127.0.0.1, started once per test session
  and reused by every test (see `torch_hca.LocalWorld`).
"""

from __future__ import annotations

import os
import tempfile

import pytest

import dist_cases
import torch_hca as hca

# The compiler starts from this host's cached calibration when there is one: tests solve with
# the documented defaults instead (an empty cache), so that layouts do not depend on the machine.
# Set before any worker process starts, so the ranks inherit it.
os.environ["TORCH_HCA_CACHE_DIR"] = tempfile.mkdtemp(prefix="torch_hca_test_cache_")


@pytest.fixture
def fake_pg(request):
    """A fake process group (world size 4 unless parametrized) and its 1-D mesh."""
    with dist_cases.fake_world(getattr(request, "param", 4)) as mesh:
        yield mesh


_WORLDS: dict[int, hca.LocalWorld] = {}
RUN_DEADLINE_S = 600  # a test whose ranks hang in Python fails instead of stalling the suite


class _TestWorld(hca.LocalWorld):
    def run(self, fn, *args, timeout_s=None):
        return super().run(fn, *args, timeout_s=timeout_s or RUN_DEADLINE_S)


def _world(size: int) -> hca.LocalWorld:
    if size not in _WORLDS:
        _WORLDS[size] = _TestWorld(size, timeout_s=240)
    return _WORLDS[size]


@pytest.fixture(scope="session")
def worlds():
    """``worlds(n)`` -> the session's `LocalWorld` of n gloo ranks (started on first use)."""
    yield _world
    for w in _WORLDS.values():
        w.close()
    _WORLDS.clear()
