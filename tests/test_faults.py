"""Faults on real gloo ranks: each ends in an `HCAError` that names it,
within a bounded time, and no rank outlives its launcher.

* One timeout: ``timeout_s`` of `hca.launch` / `hca.run` / `LocalWorld` reaches every rank
  (`torch_hca.runtime.mesh.timeout_s()` and the process group); it bounds waits for peers, not
  the job's length. Bad values are `MeshError`s naming the parameter.
* `hca.collectives` on ranks that disagree (shape, dtype, roles, op, root, forward against
  backward): `CollectiveError` naming each rank's call, before gloo could abort; a call on
  one rank only: `CheckError` naming the missing rank after the timeout.
* A rank killed mid-job: `RankError` naming it (not the survivor's gloo error), well
  within 2x the timeout.
* The launcher killed (SIGKILL) or signalled (SIGTERM, SIGINT): its ranks are gone
  within seconds.

Worlds of 2 ranks with short timeouts; tests that kill processes start their own.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import fault_cases
import torch_hca as hca

TIMEOUT_S = 5.0
TESTS = pathlib.Path(__file__).parent


@pytest.fixture(scope="module")
def short_world():
    """2 ranks whose peer timeout is TIMEOUT_S (restarted on next use once a test closes it)."""
    world = hca.LocalWorld(2, timeout_s=TIMEOUT_S)
    yield world
    world.close()


def _noop() -> None:
    """A module-level function for the launchers (never run: their arguments are refused)."""


# ------------------------------------------------------------------ one timeout

BAD_TIMEOUTS = [-1, 0, float("nan"), float("inf"), "10", True]
LAUNCHERS = {
    "hca.launch(timeout_s=...)": lambda t: hca.launch(_noop, 2, timeout_s=t),
    "hca.run(timeout_s=...)": lambda t: hca.run(_noop, 2, timeout_s=t),
    "hca.LocalWorld(timeout_s=...)": lambda t: hca.LocalWorld(2, timeout_s=t),
    "LocalWorld.run(timeout_s=...)": lambda t: hca.LocalWorld(2).run(_noop, timeout_s=t),
    "init_mesh(timeout=...)": lambda t: hca.init_mesh(timeout=t),
}


@pytest.mark.parametrize("value", BAD_TIMEOUTS, ids=repr)
@pytest.mark.parametrize("where", sorted(LAUNCHERS))
def test_a_bad_timeout_is_named(where, value):
    with pytest.raises(hca.MeshError) as info:
        LAUNCHERS[where](value)
    message = str(info.value)
    assert message.startswith(f"{where}: {value!r} is not a positive finite number of seconds"), message
    assert "not a limit on the job's length" in message and "give e.g. 600" in message
    assert not dist.is_initialized()


def test_ranks_wait_for_peers_as_long_as_the_launcher_says(short_world):
    # (torch_hca.runtime.mesh.timeout_s(), the gloo process group's timeout) on each rank
    assert short_world.run(fault_cases.timeouts) == [(TIMEOUT_S, TIMEOUT_S)] * 2


def test_a_job_may_outlast_the_timeout(short_world):
    start = time.monotonic()
    assert short_world.run(fault_cases.work_longer_than, TIMEOUT_S + 1.0) == [2.0, 2.0]
    assert time.monotonic() - start > TIMEOUT_S + 1.0


# ------------------------------------------------------------------- init_mesh


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_init_mesh_cuda_without_cuda_is_a_mesh_error():
    with pytest.raises(hca.MeshError, match=r"device_type='cuda' but CUDA is not available .*use device_type='cpu'"):
        hca.init_mesh(device_type="cuda")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shape": 2.0}, r"shape 2\.0 must be positive integers, e\.g\. init_mesh\(\(2, 2\)\)"),
        ({"shape": ()}, r"shape \(\) must be positive integers"),
        (
            {"names": "dp"},
            r"names 'dp' is one string; give a sequence with one name per mesh dimension, "
            r"e\.g\. names=\('dp',\)",
        ),
        (
            {"names": ("dp", "tp")},
            r"2 names \('dp', 'tp'\) for a 1-D shape \(world,\); give one name per mesh dimension",
        ),
        ({"device_type": ["cpu"]}, r"unknown device \['cpu'\]; use 'cpu' or 'cuda'"),
    ],
)
def test_init_mesh_refuses_bad_input_before_making_a_group(kwargs, message):
    with pytest.raises(hca.MeshError, match=rf"^init_mesh: {message}"):
        hca.init_mesh(**kwargs)
    assert not dist.is_initialized()


# ---------------------------------------------- hca.collectives: checked calls

MISMATCHES = {  # case: what each rank's call must show in the message
    "shape": ("forward all_reduce() on float32[4, 8]", "forward all_reduce() on float32[4, 9]"),
    "dtype": ("forward all_reduce() on float32[4]", "forward all_reduce() on float64[4]"),
    "roles": (
        "forward all_reduce() on float32[4], backward nothing",
        "forward all_reduce() on float32[4], backward all_reduce()",
    ),
    "op": ("forward all_reduce() on float32[4, 2]", "forward all_gather(dim=0) on float32[4, 2]"),
    "root": ("forward broadcast(root=0)", "forward broadcast(root=1)"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_ranks_that_disagree_get_a_collective_error_not_an_abort(short_world, case):
    results = short_world.run(fault_cases.mismatched, case)
    for rank, (kind, message, seconds, after) in enumerate(results):
        assert kind == "CollectiveError", (rank, kind, message)
        assert message.startswith("hca.collectives: the ranks of the world disagree"), message
        for r, call in enumerate(MISMATCHES[case]):
            assert f"rank {r}: {call}" in message, (call, message)
        assert after == 2.0  # nothing reached gloo: the group still works
        assert seconds < 1.0  # one store round trip, not a timeout


def test_backward_against_a_forward_call_is_a_collective_error(short_world):
    for kind, message in short_world.run(fault_cases.backward_against_forward):
        assert kind == "CollectiveError", message
        assert "rank 0: backward all_reduce() on float32[4]" in message
        assert "rank 1: forward all_reduce() on float32[4], backward all_reduce()" in message


def test_a_call_on_one_rank_only_is_a_check_error_after_the_timeout(short_world):
    try:
        (kind, message, waited), _ = short_world.run(fault_cases.on_one_rank_only)
    finally:
        short_world.close()  # rank 0's check is one round ahead of rank 1's now
    assert kind == "CheckError", message
    assert f"rank(s) [1] did not get there within {TIMEOUT_S:.0f} s (rank 0 did)" in message
    assert "late" in message and "different program" in message
    assert TIMEOUT_S <= waited < 2 * TIMEOUT_S


def test_evaluating_on_one_rank_only_is_named_not_a_timeout(short_world):
    """Rank 0 evaluates (a no_grad graph, compiling) while rank 1 trains: each waits at another check
    for the other. Both name the mismatch, not a late rank after the timeout (TIMEOUT_S bounds a regression)."""
    try:
        results = short_world.run(fault_cases.evaluate_on_rank_zero_only)
    finally:
        short_world.close()  # the ranks' check rounds no longer line up
    for rank, (kind, message, _) in enumerate(results):
        assert kind == "CheckError", (rank, kind, message)
        assert f"rank {rank} is calling a different graph from rank {1 - rank}" in message, message
        assert "(no_grad)" in message and "(training)" in message, message
        assert "Evaluate on every rank" in message and "did not get there" not in message, message


def test_an_eager_evaluation_on_one_rank_only_is_named_at_once(short_world):
    """Rank 0 calls the Megatron-stored module eagerly (no_grad) while rank 1 trains compiled: the
    eager call meets rank 1's input check at once and both name it, well within the timeout."""
    try:
        results = short_world.run(fault_cases.evaluate_eagerly_on_rank_zero_only, "megatron")
    finally:
        short_world.close()  # the ranks' check rounds no longer line up
    for rank, (kind, message, waited) in enumerate(results):
        assert kind == "CheckError", (rank, kind, message)
        assert "an eager call of MLP (no_grad)" in message and "runs graph 0" in message, message
        assert "Evaluate on every rank" in message and "did not get there" not in message, message
        assert waited < TIMEOUT_S, (rank, waited)


def test_an_eager_evaluation_on_one_rank_under_data_parallelism_runs(worlds):
    """Parameters replicated: an eager call needs nothing from the other rank, so one rank may
    evaluate alone (no check posted, no error)."""
    for kind, message, _ in worlds(2).run(fault_cases.evaluate_eagerly_on_rank_zero_only, "dp"):
        assert kind == "none", message


# --------------------------------------------------------------- a killed rank


@pytest.mark.parametrize("how, where", [("sigkill", "gloo"), ("exit", "check")])
def test_a_killed_peer_is_named_within_twice_the_timeout(tmp_path, how, where):
    timeout = 10.0
    with pytest.raises(hca.RankError) as info:
        hca.launch(fault_cases.die_mid_job, 2, how, where, str(tmp_path), timeout_s=timeout)
    detected = time.time() - float((tmp_path / "died").read_text())
    assert info.value.rank == 1, str(info.value)
    code = -signal.SIGKILL if how == "sigkill" else 1
    assert info.value.kind == f"process exit (code {code})", str(info.value)
    assert detected < 2 * timeout, detected


# ------------------------------------------------------------ the launcher dies

LAUNCHER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal: a background job starts ignoring it
sys.path.insert(0, {tests!r})
import fault_cases, torch_hca as hca
hca.launch(fault_cases.write_pid_and_train, 2, {folder!r}, timeout_s=30)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_until(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_the_ranks_do_not_outlive_their_launcher(tmp_path, sig):
    script = LAUNCHER.format(tests=str(TESTS), folder=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        files = [tmp_path / f"rank{r}.pid" for r in range(2)]
        assert _wait_until(lambda: all(f.exists() and f.read_text() for f in files), 120), "ranks never started"
        pids = [int(f.read_text()) for f in files]
        assert all(_alive(p) for p in pids)
        launcher.send_signal(sig)
        assert _wait_until(lambda: not any(_alive(p) for p in pids), 5.0), f"ranks {pids} outlived the launcher"
        assert launcher.wait(10) != 0
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
