"""Option layout="tune" (backends/tune.py): the candidates, the pick, and the first call's
timing runs, in one process. The runs on real gloo ranks and zoo models are in test_zoo.py."""

from __future__ import annotations

import time

import pytest
import torch

import torch_hca as hca
from torch_hca.backends.tune import Candidate, Tuned, candidate_options, pick
from torch_hca.compiler.options import Options
from torch_hca.report.records import GraphReport
from torch_hca.report.text import tuning_line
from torch_hca.spmd.cost_model import DEFAULTS, CostModel
from torch_hca.tools import zoo


def test_the_slowest_rank_decides_and_a_tie_keeps_the_earlier():
    # Candidate 1 is fastest on rank 0 but slowest of all on rank 1: the step waits for rank 1.
    index, slowest = pick({0: [3.0, 1.0, 2.5], 1: [3.0, 4.0, 2.0]})
    assert (index, slowest) == (2, [3.0, 4.0, 2.5])
    assert pick({0: [2.0, 2.0], 1: [1.0, 2.0]}) == (0, [2.0, 2.0])


def test_candidates_price_communication_three_ways_and_keep_the_users_overrides():
    options = Options.parse({"layout": "tune", "cost_model": {"flops_per_s": 7e9, "launch_s": 1e-4}})
    base = options.costs("cpu")  # no calibration in the tests' cache: the defaults, with the overrides
    got = dict(candidate_options(options, "cpu"))
    assert list(got) == ["solve", "solve, communication x4", "solve, communication x0.25", "dtensor"]
    assert [o.layout for o in got.values()] == ["solve", "solve", "solve", "dtensor"]
    assert got["solve"].costs("cpu") == base and got["dtensor"].costs("cpu") == base
    for label, factor in (("solve, communication x4", 4.0), ("solve, communication x0.25", 0.25)):
        model = got[label].costs("cpu")
        assert model.flops_per_s == 7e9 and model.memory_bytes_per_s == base.memory_bytes_per_s
        assert model.launch_s == pytest.approx(1e-4 * factor) and model.alpha_s == pytest.approx(base.alpha_s * factor)
        assert model.bytes_per_s == pytest.approx(base.bytes_per_s / factor)
        assert model.scatter_bytes_per_s == pytest.approx(DEFAULTS["gloo"].scatter_bytes_per_s / factor)
        assert model.gather_bytes_per_s == 0.0  # 0: the all_reduce's rate, scaled with it


class _Program(torch.nn.Module):
    """A stand-in for an emitted forward: its code (`x + k`) is what tells programs apart."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x + self.k


def _candidate(index: int, label: str, seconds: float, calls: list[str], program: int | None = None) -> Candidate:
    """A stand-in compiled graph: y = w * x, `seconds` long, that draws from the global RNG
    and bumps a buffer, as dropout and BatchNorm's running statistics do. Its report's forward
    is `_Program(program)` (default: its own index, a program of its own)."""

    def compiled(w, x, buffer):
        calls.append(label)
        time.sleep(seconds)
        torch.rand(3)
        buffer.add_(1.0)
        return (w * x,)

    report = GraphReport(index=index, options=None)
    report.forward = torch.fx.symbolic_trace(_Program(index if program is None else program))
    return Candidate(label, report, compiled)


def test_the_first_call_times_every_candidate_and_then_runs_the_fastest_alone():
    calls: list[str] = []
    candidates = [_candidate(7, "solve", 0.004, calls), _candidate(8, "dtensor", 0.0, calls)]
    tuned = Tuned(candidates, rounds=3, device_type="cpu")
    assert tuned.report is candidates[0].report  # before the first call
    w = torch.ones(4, requires_grad=True)
    x, buffer = torch.randn(4), torch.zeros(2)
    (y,) = tuned(w, x, buffer)
    # One untimed and 3 timed runs of each, then the real call on the one kept.
    assert calls.count("solve") == 4 and calls.count("dtensor") == 5 and calls[-1] == "dtensor"
    assert tuned.report is candidates[1].report
    # The timing runs left no trace: no gradient accumulated, the buffer bumped once (by the
    # real call; the RNG: the next test).
    assert w.grad is None and torch.equal(buffer, torch.ones(2))
    assert torch.equal(y, w * x)
    tuning = candidates[1].report.tuning
    assert tuning["kept"] == "dtensor" and tuning["kept_graph"] == 8 and tuning["rounds"] == 3
    solve, dtensor = tuning["candidates"]
    assert solve["median_s"] >= 0.004 > dtensor["median_s"]
    assert candidates[0].report.dropped == "layout='tune' kept graph 8 (dtensor), which ran faster"
    assert candidates[1].report.dropped is None
    assert tuning_line(tuning).startswith(
        "tuned: kept dtensor of 2 distinct layouts, by the slowest rank's median of 3 forward + backward runs"
    )
    calls.clear()
    tuned(w, x, buffer)
    assert calls == ["dtensor"]


def test_the_rng_after_the_first_call_is_where_the_kept_program_alone_leaves_it():
    calls: list[str] = []
    tuned = Tuned([_candidate(0, "solve", 0.0, calls), _candidate(1, "dtensor", 0.002, calls)], 2, "cpu")
    torch.manual_seed(11)
    tuned(torch.ones(2, requires_grad=True), torch.ones(2), torch.zeros(1))
    after_tuned = torch.get_rng_state()
    torch.manual_seed(11)
    torch.rand(3)  # one run of any candidate
    assert torch.equal(after_tuned, torch.get_rng_state())


def test_one_distinct_program_is_kept_without_timing():
    calls: list[str] = []
    only = _candidate(3, "solve", 0.0, calls)
    only.same_as.append("dtensor")
    tuned = Tuned([only], rounds=5, device_type="cpu", failed=["solve, communication x4: PlanError: ..."])
    tuned(torch.ones(2), torch.ones(2), torch.zeros(1))
    assert calls == ["solve"]
    assert tuning_line(only.report.tuning) == (
        "tuned: one program to run (solve = dtensor), nothing timed; "
        "not compiled: solve, communication x4: PlanError: ..."
    )


def test_report_leaves_out_the_layouts_tune_dropped(fake_pg):
    torch.manual_seed(0)
    # An 8-tensor stack on 8 rows: the solver's picks differ with the price of communication
    # (gradients reduced, or activations moved): three distinct programs at world size 4.
    model = hca.sharded({}, inputs=torch.distributed.tensor.Shard(0))(zoo.DeepMLP(256, 4))
    compiled = torch.compile(model, backend="hca", options={"layout": "tune", "tune_rounds": 1})
    compiled(torch.randn(8, 256)).sum().backward()
    rep = hca.report(compiled)
    (g,) = rep.graphs
    assert g.dropped is None and g.tuning["kept_graph"] == g.index
    assert hca.report().graph is g  # the last graph compiled: the kept one, not a dropped candidate
    assert "tuned: " in rep.explain()
    assert rep.strategy()["graphs"][0]["tuning"] == g.tuning
    candidates = g.tuning["candidates"]
    assert len(candidates) >= 2 and all(c["predicted_s"] > 0 for c in candidates), candidates
    # Each candidate's prediction is its timeline under the calibrated figures, which the kept
    # program's own timeline uses too (not the scaled ones it may have been laid out under).
    calibrated = CostModel(**g.tuning["cost_model"])
    assert calibrated == Options.parse({}).costs("cpu")
    kept = next(c for c in candidates if c["graph"] == g.index)
    assert rep.timeline().after.total_s == pytest.approx(kept["predicted_s"])


def test_under_no_grad_the_candidates_are_timed_on_their_forward():
    calls: list[str] = []
    tuned = Tuned([_candidate(0, "solve", 0.0, calls), _candidate(1, "dtensor", 0.0, calls)], 2, "cpu")
    with torch.no_grad():
        (y,) = tuned(torch.ones(2, requires_grad=True), torch.ones(2), torch.zeros(1))
    assert not y.requires_grad and len(calls) == 2 * 3 + 1
    assert all(c["median_s"] >= 0 for c in tuned.report.tuning["candidates"])


def test_ranks_that_timed_other_candidates_are_an_error(monkeypatch):
    from torch_hca.backends import tune

    monkeypatch.setattr(tune, "needs_exchange", lambda: True)
    monkeypatch.setattr(tune.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(tune.dist, "get_rank", lambda: 0)
    peer = {1: "solve\t0.5\ndtensor\t0.25"}
    monkeypatch.setattr(tune, "exchange", lambda topic, text, peers, what: dict(peer))
    assert tune._by_rank("tune", ["solve", "dtensor"], [0.75, 0.125], 4, float) == {0: [0.75, 0.125], 1: [0.5, 0.25]}
    peer[1] = "solve\t0.5"
    with pytest.raises(
        hca.CheckError,
        match=r"graph 4, layout='tune': rank 1 timed the candidates \['solve'\] but "
        r"rank 0 timed \['solve', 'dtensor'\]",
    ):
        tune._by_rank("tune", ["solve", "dtensor"], [0.75, 0.125], 4, float)


def test_layouts_that_emit_one_program_are_timed_as_one():
    """Two layouts of the DTensor program can emit the same forward and backward: timing them
    against each other would time the machine's noise, so they are merged after the first run."""
    calls: list[str] = []
    candidates = [
        _candidate(0, "solve", 0.0, calls, program=9),
        _candidate(1, "solve, communication x4", 0.0, calls),
        _candidate(2, "dtensor", 0.0, calls, program=9),
    ]
    tuned = Tuned(candidates, rounds=2, device_type="cpu")
    tuned(torch.ones(2, requires_grad=True), torch.ones(2), torch.zeros(1))
    # One untimed run of each, then 2 timed rounds of the two distinct programs, then the call.
    assert calls.count("dtensor") == 1 and calls.count("solve") + calls.count("solve, communication x4") == 2 + 4 + 1
    assert [c.label for c in tuned.candidates] == ["solve", "solve, communication x4"]
    assert candidates[0].same_as == ["dtensor"]
    assert candidates[2].report.dropped == "layout='tune': the same program as graph 0 (solve)"
    layouts = [c["layout"] for c in tuned.report.tuning["candidates"]]
    assert layouts == ["solve = dtensor", "solve, communication x4"]
