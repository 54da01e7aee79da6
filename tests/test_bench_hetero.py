"""`python -m torch_hca bench --hetero` (torch_hca/tools/bench_hetero.py, its tables in bench_hetero_tables.py): the split it picks, the
slowdown it applies and the arithmetic of its table, on synthetic timings. No ranks, no speeds asserted."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torch_hca.spmd.shares import rows_agree, rows_for, smallest_whole
from torch_hca.tools import bench_hetero as bh
from torch_hca.tools import bench_hetero_tables as bt


@pytest.mark.parametrize(
    "k, shares, rows",
    [
        (1.0, (1, 1), (12, 12)),
        (1.5, (7, 5), (14, 10)),
        (2.0, (2, 1), (16, 8)),
        (3.0, (3, 1), (18, 6)),
    ],
)
def test_the_balanced_shares_of_a_batch_of_24(k, shares, rows):
    assert bh.pick_shares(k, 24) == (shares, rows)


@pytest.mark.parametrize("batch", [4, 8, 12, 24, 30, 48])
@pytest.mark.parametrize("k", [0.5, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 7.0, 100.0])
def test_shares_are_legal_proportional_and_balanced(k, batch):
    shares, rows = bh.pick_shares(k, batch)
    # legal: a split hca accepts for this batch, every rank at least 2 rows, shares in lowest terms
    assert sum(rows) == batch and min(rows) >= 2 and batch % smallest_whole(shares) == 0
    assert rows_for(shares, batch) == rows and rows_agree(shares, {0: rows[0], 1: rows[1]})
    assert math.gcd(*shares) == 1
    # the slow rank 1 holds about 1/(1+k) of the rows: within a row, unless held at 2 rows
    ideal = batch / (1 + k)
    assert abs(rows[1] - ideal) <= 1 or rows[1] == 2 or rows[0] == 2
    # and no legal split has a less slow side, max(rank 0's rows, k x rank 1's)
    best = min(max(batch - r, k * r) for r in range(2, batch - 1))
    assert max(rows[0], k * rows[1]) == best


def test_pick_shares_refuses_what_cannot_be_split():
    with pytest.raises(ValueError, match="at least 4"):
        bh.pick_shares(2.0, 3)
    with pytest.raises(ValueError, match="must be > 0"):
        bh.pick_shares(0.0, 24)


def test_the_bound_shares_the_whole_batch_by_the_speeds():
    assert bt.bound(0.060, 1.0) == pytest.approx(0.030)
    assert bt.bound(0.060, 2.0) == pytest.approx(0.040)  # speeds 1 and 1/2: 60 / 1.5
    assert bt.bound(0.060, 3.0) == pytest.approx(0.045)
    assert bt.bound(0.060, 1e9) == pytest.approx(0.060)  # a rank that does nothing adds nothing


def _times(fast_steps, slow_steps, fast_compute=None, slow_compute=None) -> list:
    return [
        {"step": list(fast_steps), "compute": list(fast_compute or fast_steps)},
        {"step": list(slow_steps), "compute": list(slow_compute or slow_steps)},
    ]


def test_summarize_reads_medians_of_the_slowest_rank_and_the_k_got():
    times = {
        "whole": _times([0.060, 0.062, 0.058], [0.061, 0.059, 0.100]),  # W: median of all six steps
        "whole_k": _times([0.06] * 3, [0.2] * 3, fast_compute=[0.05, 0.05, 0.9], slow_compute=[0.1, 0.11, 0.09]),
        "even": _times([0.030, 0.050, 0.031], [0.061, 0.040, 0.062]),  # per step: 0.061, 0.050, 0.062
        "shares": _times([0.041, 0.045, 0.039], [0.044, 0.040, 0.043]),  # per step: 0.044, 0.045, 0.043
    }
    row = bt.summarize(2.0, (2, 1), (16, 8), times)
    assert row["whole_s"] == pytest.approx(0.0605)
    assert row["k_measured"] == pytest.approx(0.10 / 0.05)
    assert row["even_s"] == pytest.approx(0.061) and row["shares_s"] == pytest.approx(0.044)
    assert row["bound_s"] == pytest.approx(0.0605 / 1.5)
    assert row["shares_over_bound"] == pytest.approx(0.044 / (0.0605 / 1.5))
    assert row["even_over_shares"] == pytest.approx(0.061 / 0.044)
    assert row["shares"] == [2, 1] and row["rows"] == [16, 8]


def test_at_k_1_the_k_got_comes_from_the_unslowed_whole_batch():
    times = {
        "whole": _times([0.05] * 3, [0.05] * 3, slow_compute=[0.051] * 3),
        "even": _times([0.03] * 3, [0.03] * 3),
        "shares": _times([0.0309] * 3, [0.03] * 3),
    }
    row = bt.summarize(1.0, (1, 1), (12, 12), times)
    assert row["k_measured"] == pytest.approx(1.02) and row["bound_s"] == pytest.approx(0.05 / (1 + 1 / 1.02))


def _row(k, shares_over_bound, even_s, shares_s):
    return {
        "k": k,
        "k_measured": k,
        "shares": [1, 1],
        "rows": [12, 12],
        "whole_s": 0.06,
        "even_s": even_s,
        "shares_s": shares_s,
        "bound_s": shares_s / shares_over_bound,
        "shares_over_bound": shares_over_bound,
        "even_over_shares": even_s / shares_s,
    }


def test_goals_say_which_are_met_with_their_figures():
    rows = [_row(1.0, 1.05, 0.030, 0.0305), _row(2.0, 1.12, 0.054, 0.040), _row(3.0, 1.08, 0.07, 0.045)]
    lines = bt.goals(rows)
    assert lines[0].split()[:2] == ["NOT", "met"] and "worst 1.120x at k=2" in lines[0]
    assert lines[1].split()[0] == "met" and "1.35x faster" in lines[1]
    assert lines[2].split()[0] == "met" and "1.017x" in lines[2]
    lines = bt.goals([_row(1.0, 1.2, 0.030, 0.0312)])
    assert "NOT met" in lines[0] and "not measured: k=2" in lines[1] and "NOT met" in lines[2] and "1.040x" in lines[2]


def test_table_has_one_line_per_k_and_the_ratios():
    text = bt.table([_row(1.5, 1.234, 0.05, 0.04)])
    head, rule, line = text.splitlines()
    assert "shares/bound" in head and "even/shares" in head and set(rule) <= {"-", " "}
    assert line.split()[0] == "1.5" and "1.234" in line and line.split()[-1] == "1.25"


def test_the_slow_rank_sleeps_k_minus_1_times_its_recent_compute(monkeypatch):
    slept = []
    monkeypatch.setattr(bh.time, "sleep", slept.append)
    model = nn.Linear(4, 4)
    c = bh._Contestant("even", model, model, (3, 2), rank=1)
    assert (c.start, c.rows) == (3, 2)
    x = torch.randn(5, 4)
    first = c.step(x, x, 3.0)
    assert slept == [] and first["slept"] >= 0 and first["cpu"] > 0  # nothing measured yet: no sleep
    c.step(x, x, 3.0)
    assert slept == [pytest.approx(2 * first["cpu"])]
    c.recent.extend([0.010, 0.011, 0.500, 0.012, 0.009])  # one slow pass does not echo in the sleep
    c.step(x, x, 2.0)
    assert slept[-1] == pytest.approx(0.011)
    c.step(x, x, 1.0)  # the fast rank, or k=1: never sleeps
    assert len(slept) == 2
    whole = bh._Contestant("whole", model, model, (3, 2), rank=1, slowed=False)
    assert (whole.start, whole.rows, whole.slowed) == (0, 5, False)


def test_breakdown_and_the_other_processes_load():
    times = {"even": _times([0.03, 0.05], [0.04, 0.02]), "shares": _times([0.03] * 2, [0.03] * 2)}
    for t in times.values():
        for r, cpu in ((0, [0.01, 0.02]), (1, [0.02, 0.04])):
            t[r]["cpu"], t[r]["slept"] = cpu, [0.001 * r, 0.003 * r]
    parts = bt.breakdown(2.0, times)
    assert parts[0] == {
        "k": 2.0,
        "contestant": "even",
        "cpu_s": [pytest.approx(0.015), pytest.approx(0.03)],
        "slept_s": pytest.approx(0.002),
        "step_s": pytest.approx(0.045),
    }
    assert "shares" in bt.breakdown_table(parts).splitlines()[-1]
    # 10 s of wall, 15 CPU seconds busy, 12 of them this process and its ranks: others kept 0.3 cores busy
    assert bh._others_cores((100.0, 50.0, 3.0), (110.0, 65.0, 15.0)) == pytest.approx(0.3)
    assert bh._others_cores(None, (110.0, 65.0, 15.0)) is None


def test_the_command_line_takes_hetero(monkeypatch):
    from torch_hca.__main__ import main

    called = []
    monkeypatch.setattr(bh, "main", lambda *a, **kw: called.append((a, kw)) or 0)
    assert main(["bench", "--hetero", "--tiny", "--json", "/tmp/x.json", "--rounds", "3"]) == 0
    assert called == [(("/tmp/x.json", True), {"rounds": 3, "batch": None})]
    assert main(["bench", "--hetero", "--rows", "96"]) == 0  # the global batch's rows
    assert called[-1] == ((None, False), {"rounds": None, "batch": 96})
    for bad in (["--models", "dp"], ["--rows", "7"], ["--rows", "4,8"]):
        with pytest.raises(SystemExit):
            main(["bench", "--hetero", *bad])
