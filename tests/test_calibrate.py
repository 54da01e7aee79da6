"""`hca.calibrate`: cost-model figures measured on real gloo ranks, the same on every rank."""

from __future__ import annotations

import dataclasses
import importlib
import math
import time

import pytest
import torch

import dist_cases
import torch_hca as hca
from torch_hca.api.calibration_figures import JUDGED, _half_dim, _line, _share, fastest_rounds, noisy_probes
from torch_hca.api.calibration_probes import PROBES, contention_times, host_s
from torch_hca.api.calibrate import FIELDS
from torch_hca.spmd.cost_model import DEFAULTS


def test_every_rank_gets_rank_zeros_figures(worlds):
    results = worlds(2).run(dist_cases.calibrated)
    assert results[0] == results[1], "ranks must solve layouts with the same figures"
    figures = results[0]
    assert tuple(figures) == FIELDS
    assert all(math.isfinite(v) and v >= 0 for v in figures.values())
    # Rates are positive, and in a plausible range for a CPU and loopback TCP.
    assert 1e6 < figures["bytes_per_s"] < 1e12 and 1e8 < figures["flops_per_s"] < 1e14
    assert 1e-8 < figures["op_s"] < 1e-3  # host time to issue one op: microseconds
    assert figures["sync_s"] >= 0  # a wait after compute, beyond the transfer
    assert 0 <= figures["call_s"] < 0.1  # a compiled graph's call beyond its ops: a millisecond or so
    assert 0 <= figures["param_s"] < 1e-3  # and per DTensor parameter: tens of microseconds
    assert figures["call_s"] + figures["param_s"] > 0  # a call is never free
    assert 1e6 < figures["gather_bytes_per_s"] < 1e12
    # gloo's reduce_scatter runs as an all_reduce of its input: twice the ring's wire bytes in
    # about an all_reduce's time, so about half the all_reduce's rate per wire byte.
    assert 1e6 < figures["scatter_bytes_per_s"] < figures["bytes_per_s"]
    assert 0 <= figures["contention"] <= 1
    assert 0 <= figures["matmul_half_dim"] <= 256  # rows at which a matmul runs at half its peak rate


class _Thread:
    """A stand-in collective run by another thread that sleeps: it takes no core from compute."""

    def __init__(self, seconds):
        import threading

        self.thread = threading.Thread(target=time.sleep, args=(seconds,))
        self.thread.start()

    def wait(self):
        self.thread.join()


class _Blocking:
    """A stand-in collective that holds the caller until it is done: compute waits it out."""

    def __init__(self, seconds):
        time.sleep(seconds)

    def wait(self):
        pass


@pytest.mark.parametrize("collective,expected", [(_Thread, 0.0), (_Blocking, 1.0)])
def test_contention_is_the_share_of_a_collective_that_overlap_does_not_hide(collective, expected):
    # Two 10 ms steps outlast the 15 ms collective by 5 ms: room for a loaded machine's late wake-ups.
    step = lambda: time.sleep(0.01)
    share = _share(*contention_times(step, 2, lambda: collective(0.015), lambda: None, repeats=10))
    assert abs(share - expected) < 0.3, share


def test_needs_a_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(hca.MeshError, match=r"hca.calibrate\(\): no process group; call hca.init_mesh\(\) first"):
        hca.calibrate()


def test_host_time_is_the_compiled_steps_time_beyond_its_graphs_own_calls(fake_pg):
    figures = dataclasses.asdict(DEFAULTS["gloo"])
    call_s, param_s = host_s(figures, torch.device("cpu"), 3)
    # Each DTensor parameter is unwrapped, its gradient wrapped and accumulated through DTensor's
    # Python dispatch: 30-60 us a step on a 2-core VM. Measured against the timeline instead of
    # the graphs' own calls, the larger probe's op-count error hid it (2 us).
    assert call_s >= 0 and param_s > 5e-6, (call_s, param_s)


def test_host_time_is_zero_with_a_warning_when_the_probe_did_not_compile(fake_pg, monkeypatch):
    def uncompiled(compiled):
        raise hca.HCAError("no graph of this Sequential was compiled")

    monkeypatch.setattr(importlib.import_module("torch_hca.report.compile_report"), "report", uncompiled)
    with pytest.warns(UserWarning, match="call_s and param_s are 0: a probe module did not compile with hca"):
        assert host_s(dataclasses.asdict(DEFAULTS["gloo"]), torch.device("cpu"), 3) == (0.0, 0.0)


def test_latency_and_bandwidth_are_the_line_through_the_all_reduces():
    wires = [64e3, 512e3, 4e6]
    slope, intercept = _line(wires, [1e-3 + w / 2e9 for w in wires])
    assert slope == pytest.approx(1 / 2e9) and intercept == pytest.approx(1e-3)
    assert _line([1.0, 1.0], [2.0, 3.0]) == (0.0, 2.5)  # no spread: no slope to read


@pytest.mark.parametrize("h", [0.0, 8.0, 40.0])
def test_matmul_half_dim_is_the_h_that_fits_both_rates(h):
    """Times of x @ w at 16 and 256 rows whose rates are d / (d + h) of one peak give back h."""
    peak = 1e11
    seconds = lambda rows: 2 * rows * 512 * 512 / (peak * rows / (rows + h))
    assert _half_dim(seconds(16), seconds(256)) == pytest.approx(h, abs=1e-9)


def test_matmul_half_dim_is_zero_where_small_matmuls_are_not_slower():
    assert _half_dim(1.0, 17.0) == 0.0  # 16 rows faster per row


# ------------------------------------------------------------ rounds: the fastest kept, noise flagged
# A quiet round's seconds per probe (`PROBES`), plausible for two gloo ranks on a small CPU.
QUIET = {
    "all_gather_4B": 1e-4,
    "all_reduce_4B": 1.2e-4,
    "all_reduce_64KiB": 3e-4,
    "all_reduce_512KiB": 1e-3,
    "all_reduce_4MiB": 6e-3,
    "all_gather_4MiB": 4e-3,
    "reduce_scatter_4MiB": 7e-3,
    "mlp_step": 1e-3,
    "matmul_16_rows": 1.2e-4,
    "matmul_256_rows": 1.7e-3,
    "gather_after_compute": 3e-4,
    "steps_alone": 6e-3,
    "all_reduce_alone": 6e-3,
    "all_reduce_under_steps": 9e-3,
    "op": 1e-5,
    "copy_16MiB": 3e-3,
}


def _slower(times, factor, *probes):
    return {k: v * (factor if k in probes else 1.0) for k, v in times.items()}


def test_every_probe_has_a_quiet_time():
    assert tuple(QUIET) == PROBES and set(JUDGED) <= set(PROBES)


def test_each_probe_keeps_its_fastest_round_and_its_spread():
    rounds = [
        {"mlp_step": 1.1, "copy_16MiB": 3.0, "op": 1.0},
        {"mlp_step": 4.0, "copy_16MiB": 12.0, "op": 1.0},
        {"mlp_step": 1.2, "copy_16MiB": 2.0, "op": 1.0},
    ]
    fastest, spread = fastest_rounds(rounds)
    assert fastest == {"mlp_step": 1.1, "copy_16MiB": 2.0, "op": 1.0}
    assert spread == pytest.approx({"mlp_step": 4.0 / 1.1 - 1, "copy_16MiB": 5.0, "op": 0.0})


@pytest.mark.parametrize("factor,noisy", [(1.2, []), (1.5, ["mlp_step"]), (4.0, ["mlp_step"])])
def test_a_judged_probe_slower_beyond_the_threshold_is_noisy(factor, noisy):
    _, spread = fastest_rounds([QUIET, _slower(QUIET, factor, "mlp_step", "op", "all_reduce_4B")])
    assert noisy_probes(spread, 0.3) == noisy  # host times and small collectives vary even when quiet: not judged
    assert noisy_probes(spread, math.inf) == []


class _FakeProbes:
    """What `figures_of` reads of `Probes`, without setting any up."""

    def __init__(self, device):
        self.n, self.sizes, self.big = 4, (2**14, 2**17, 2**20), torch.empty(2**20)
        self.step_flops, self.copy_bytes = 11 * 2 * 256**3, 2 * 2**24


@pytest.fixture
def injected(fake_pg, monkeypatch):
    """`_measure` on the fake process group, its rounds' seconds taken from the list it returns."""
    cal = importlib.import_module("torch_hca.api.calibrate")
    rounds = []
    monkeypatch.setattr(cal, "Probes", _FakeProbes)
    monkeypatch.setattr(cal, "time_round", lambda probes, repeats: rounds.pop(0))
    monkeypatch.setattr(cal, "host_s", lambda figures, device, repeats: (1e-3, 2e-5))
    return rounds


def test_a_loaded_round_does_not_decide_the_figures(injected, recwarn):
    cal = importlib.import_module("torch_hca.api.calibrate")
    injected += [QUIET] * 3
    quiet = cal._measure(3, rounds=3)
    assert not quiet.noisy and not recwarn.list
    # The case: compute at a quarter of its speed while other work shared the machine.
    injected += [QUIET, _slower(QUIET, 4.0, "mlp_step", "matmul_256_rows"), _slower(QUIET, 1.1, "mlp_step")]
    with pytest.warns(
        UserWarning,
        match=r"hca.calibrate: noisy: the slowest of 3 rounds ran slower than the "
        r"fastest by mlp_step 300%, matmul_256_rows 300% \(more than 50%\)",
    ):
        loaded = cal._measure(3, rounds=3)
    assert loaded.noisy and loaded == quiet  # the fastest rounds: the quiet figures
    assert loaded.spread["mlp_step"] == pytest.approx(3.0) and tuple(loaded) == FIELDS
    assert quiet["flops_per_s"] == pytest.approx(11 * 2 * 256**3 / 1e-3 * (256 + quiet["matmul_half_dim"]) / 256)


def test_the_figures_say_when_they_were_measured(injected):
    import datetime

    cal = importlib.import_module("torch_hca.api.calibrate")
    injected += [QUIET]
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    figures = cal._measure(3, rounds=1)
    at = datetime.datetime.fromisoformat(figures.measured_at)
    assert before <= at <= datetime.datetime.now(datetime.timezone.utc) and at.utcoffset() == datetime.timedelta(0)
    assert figures.spread == dict.fromkeys(QUIET, 0.0) and not figures.noisy  # one round: nothing to compare


@pytest.mark.parametrize(
    "kwargs,match",
    [({"rounds": 0}, r"rounds=0; give a positive int"), ({"max_spread": 0}, r"max_spread=0; give a number > 0")],
)
def test_bad_rounds_or_threshold(fake_pg, kwargs, match):
    with pytest.raises(hca.HCAError, match=r"hca\.calibrate: " + match):
        hca.calibrate(**kwargs)
