"""`hca.launch` and `LocalWorld`: results, failures without hangs, loopback only."""

from __future__ import annotations

import os

import pytest

import launch_cases
import torch_hca as hca


def test_launch_returns_each_ranks_result():
    results = hca.launch(launch_cases.rank_and_sum, 2, 1)
    assert [(r, s) for r, _, s in results] == [(0, 3.0), (1, 3.0)]


def test_mesh_inside_launch_is_gloo_on_cpu(worlds):
    assert worlds(2).run(launch_cases.mesh_backend) == ["gloo cpu (2,)"] * 2


def test_world_is_reused_between_runs(worlds):
    first = worlds(4).run(launch_cases.rank_and_sum, 0)
    second = worlds(4).run(launch_cases.rank_and_sum, 1)
    assert [pid for _, pid, _ in first] == [pid for _, pid, _ in second]
    assert [s for _, _, s in second] == [10.0] * 4


def test_exception_names_the_rank_and_carries_its_traceback():
    with hca.LocalWorld(2, timeout_s=60) as world:
        with pytest.raises(hca.RankError) as info:
            world.run(launch_cases.raise_on_rank_1)
        assert info.value.rank == 1 and info.value.kind == "ValueError"
        assert "rank 1 refuses" in info.value.traceback_text
        assert "raise_on_rank_1" in info.value.traceback_text
        # The world restarts after a failure.
        assert [s for _, _, s in world.run(launch_cases.rank_and_sum, 0)] == [1.0, 1.0]


def test_a_rank_that_dies_is_reported_not_waited_for():
    with pytest.raises(hca.RankError, match="rank 1 failed with process exit \\(code 3\\)"):
        hca.launch(launch_cases.die_on_rank_1, 2, timeout_s=60)


def test_a_rank_that_crashes_in_native_code_reports_where():
    with pytest.raises(hca.RankError, match="rank 1 failed with process exit \\(code -11\\)") as info:
        hca.launch(launch_cases.crash_on_rank_1, 2, timeout_s=60)
    assert "Segmentation fault" in info.value.traceback_text
    assert "_crash_in_native_code" in info.value.traceback_text


def test_rendezvous_and_gloo_listen_on_loopback_only():
    with hca.LocalWorld(2, timeout_s=60) as world:
        per_rank = world.run(launch_cases.rank_listeners_after_collective)
        store = launch_cases.listening_addresses(os.getpid())
    addresses = store + [a for rank in per_rank for a in rank]
    assert store, "the parent serves the rendezvous store"
    assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses


def test_run_calls_fn_in_this_process_under_torchrun(monkeypatch):
    calls = []
    monkeypatch.setenv("RANK", "0")
    hca.run(lambda *a: calls.append(a), 2, "x")  # no ranks started: torchrun already made this one
    assert calls == [("x",)]


_MIB = 2**20
# A fresh process: glibc's defaults, then keep_freed_memory() where asked.
_FRESH = (
    "import sys, launch_cases\nfrom torch_hca.runtime.launch import keep_freed_memory\n"
    "applied = keep_freed_memory() if sys.argv[1] == 'keep' else False\n"
    "print(applied, launch_cases.rss_drop_after_freeing_64_mib())"
)


def _fresh_process(mode: str, **env: str) -> tuple[bool, int]:
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, "-c", _FRESH, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", ""), **env},
    )
    applied, drop = out.stdout.split()
    return applied == "True", int(drop)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from Linux's /proc")
def test_ranks_keep_the_memory_a_step_frees(worlds):
    # glibc's default hands a 64 MiB block back on free; a rank keeps it for the next step.
    applied, drop = _fresh_process("default")
    assert not applied and drop > 48 * _MIB
    assert all(d < 16 * _MIB for d in worlds(2).run(launch_cases.rss_drop_after_freeing_64_mib))
    # A user who set glibc's malloc variables keeps their choice.
    applied, drop = _fresh_process("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert not applied and drop > 48 * _MIB
