"""The deployment (docs/heterogeneous.md): each rank's device and speed, as JSON, checked against
the world, measured on the ranks, and the rows of a batch each rank takes from it."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_hca as hca
from torch_hca.spmd.shares import rows_by_speed

import uneven_cases

TOL = 1e-5


def _slowest(rows, speeds, fixed):
    return max(f + r / s for r, s, f in zip(rows, speeds, fixed))


def _brute_best(speeds, total, min_rows, fixed):
    """The least slowest-rank time over every split of `total` rows, each rank at least `min_rows`."""
    n = len(speeds)
    splits = (r for r in itertools.product(range(min_rows, total + 1), repeat=n) if sum(r) == total)
    return min(_slowest(rows, speeds, fixed) for rows in splits)


@settings(max_examples=80, deadline=None)
@given(
    speeds=st.lists(st.integers(1, 6), min_size=2, max_size=3),
    total=st.integers(6, 16),
    min_rows=st.integers(1, 2),
    fixed=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0]), min_size=3, max_size=3),
    with_fixed=st.booleans(),
)
def test_rows_by_speed_is_the_split_whose_slowest_rank_finishes_first(speeds, total, min_rows, fixed, with_fixed):
    fixed = fixed[: len(speeds)] if with_fixed else None
    rows = rows_by_speed(speeds, total, min_rows, fixed)
    times = fixed or [0.0] * len(speeds)
    assert sum(rows) == total and min(rows) >= min_rows
    assert _slowest(rows, speeds, times) == pytest.approx(_brute_best(speeds, total, min_rows, times))


def test_a_rank_with_a_fixed_time_gets_fewer_rows():
    """Equal speeds, rank 1 paying 4 row-times a step whatever its rows: 14 + 0 = 10 + 4."""
    assert rows_by_speed((1, 1), 24, fixed=(0, 4)) == (14, 10)
    # Rank 1 half as fast, its fixed part slowed as its rows are: fewer than the third of speeds alone.
    assert rows_by_speed((2, 1), 24) == (16, 8)
    assert rows_by_speed((2, 1), 24, fixed=(1, 2)) == (17, 7)
    with pytest.raises(hca.PlacementError, match="fixed=.*one finite time >= 0 per rank"):
        rows_by_speed((1, 1), 8, fixed=(0, -1))


def test_rows_by_speed_gives_the_slow_rank_its_part():
    assert rows_by_speed((1, 1), 24) == (12, 12)
    assert rows_by_speed((2, 1), 24) == (16, 8)  # k = 2: a third of the rows
    assert rows_by_speed((3, 1), 24) == (18, 6)
    assert rows_by_speed((1, 1, 2), 8) == (2, 2, 4)
    assert rows_by_speed((100, 1), 8) == (6, 2)  # a very slow rank still holds its 2 rows


@pytest.mark.parametrize(
    "speeds,total,error",
    [((1, 0), 8, "positive, finite speed"), ((1, 1), 3, "at least 4 rows"), ((), 8, "one positive")],
)
def test_rows_by_speed_refuses_by_name(speeds, total, error):
    with pytest.raises(hca.PlacementError, match=error):
        rows_by_speed(speeds, total)


def _two(speed1=1.0, device1="cpu"):
    return hca.Deployment((hca.RankCapacity("cpu", 2.0, 8 << 30), hca.RankCapacity(device1, speed1)), "GFLOP/s")


def test_a_deployment_round_trips_through_its_file(tmp_path):
    dep = _two()
    data = dep.save(tmp_path / "d.json")
    assert data["schema"] == "torch_hca.deployment" and data["version"] == 2
    assert data["ranks"][0] == {"rank": 0, "device": "cpu", "speed": 2.0, "memory_bytes": 8 << 30, "fixed_s": 0.0}
    assert hca.Deployment.load(tmp_path / "d.json") == dep
    assert dep.shares(24) == (16, 8) and dep.shares(12, ranks=[1, 0]) == (4, 8)
    # A version 1 file (no fixed_s) reads as fixed_s 0.
    old = {**data, "version": 1, "ranks": [{k: v for k, v in e.items() if k != "fixed_s"} for e in data["ranks"]]}
    assert hca.Deployment.from_dict(old) == dep


def test_a_fixed_time_per_rank_round_trips_and_decides_the_rows(tmp_path):
    caps = (hca.RankCapacity("cpu", 2.0, None, 0.001), hca.RankCapacity("cpu", 1.0, None, 0.002))
    dep = hca.Deployment(caps, "rows/s")
    dep.save(tmp_path / "d.json")
    assert hca.Deployment.load(tmp_path / "d.json") == dep
    assert dep.shares(24) == (16, 8)  # 1 ms against rows of 0.5 s and 1 s: the fixed part is too small to move a row
    slow_fixed = hca.Deployment((caps[0], hca.RankCapacity("cpu", 1.0, None, 2.0)), "rows/s")
    assert slow_fixed.shares(24) == (17, 7) and slow_fixed.step_s((17, 7)) == (8.501, 9.0)
    with pytest.raises(hca.MeshError, match="rank 1: fixed_s 2.0 with speeds in 'GFLOP/s'.*unit='rows/s'"):
        hca.Deployment((hca.RankCapacity("cpu", 2.0), hca.RankCapacity("cpu", 1.0, None, 2.0)), "GFLOP/s")


@pytest.mark.parametrize(
    "edit,error",
    [
        (lambda d: d.update(version=3), "version 3"),
        (lambda d: d.update(schema="other"), "not a torch_hca deployment"),
        (lambda d: d["ranks"].reverse(), "ranks 0, 1, ... in order"),
        (lambda d: d["ranks"][1].pop("speed"), "lacks 'speed'"),
        (lambda d: d["ranks"][1].update(speed=-1), "rank 1: speed -1"),
        (lambda d: d["ranks"][1].update(device="tpu:x"), "rank 1: device 'tpu:x' is not a torch device"),
        (lambda d: d["ranks"][0].update(memory_bytes=0), "rank 0: memory_bytes 0"),
        (lambda d: d["ranks"][0].update(fixed_s=-1), "rank 0: fixed_s -1"),
    ],
    ids=["version", "schema", "order", "no-speed", "speed", "device", "memory", "fixed"],
)
def test_a_bad_deployment_file_is_a_named_error(tmp_path, edit, error):
    data = _two().to_dict()
    edit(data)
    (tmp_path / "d.json").write_text(json.dumps(data))
    with pytest.raises(hca.MeshError, match=error):
        hca.Deployment.load(tmp_path / "d.json")


def test_a_truncated_deployment_file_is_a_named_error(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(_two().to_dict())[:40])
    with pytest.raises(hca.MeshError, match="deployment file .*d.json"):
        hca.Deployment.load(tmp_path / "d.json")


def test_a_deployment_is_checked_against_the_world():
    assert _two().check(world_size=2, rank=1) == _two()
    with pytest.raises(hca.MeshError, match="describes 2 ranks, the world has 4"):
        _two().check(world_size=4, rank=0)
    with pytest.raises(hca.MeshError, match="rank 1 is cuda:7, which this machine does not have"):
        _two(device1="cuda:7").check(world_size=2, rank=1)
    _two(device1="cuda:7").check(world_size=2, rank=0)  # each rank checks its own device
    with pytest.raises(hca.MeshError, match=r"ranks \[3\] are not in this deployment of 2"):
        _two().shares(8, ranks=[0, 3])


def test_measured_on_the_ranks_and_the_batch_cut_by_it_trains_as_one_device(worlds):
    """Rank 1's step takes twice rank 0's (on a clock the step moves, so the figures are exact under
    any load): measured speeds 2:1, the same deployment on every rank; its shares of a batch of 12
    (8:4) train as one device (outputs, gradients, parameters after 2 SGD steps) with the gradient
    all-reduces of data parallelism only."""
    measured = worlds(2).run(uneven_cases.measured_deployment, 0.01)
    assert measured[0] == measured[1] and measured[0]["unit"] == "steps/s"
    dep = hca.Deployment.from_dict(measured[0])
    ratio = dep.ranks[0].speed / dep.ranks[1].speed
    assert ratio == pytest.approx(2.0, rel=1e-9), ratio
    shares = dep.shares(12)
    assert shares == (8, 4), (shares, ratio)
    # Timed at two batch sizes: each rank's fixed part and rows per second, the line through them.
    line = hca.Deployment.from_dict(worlds(2).run(uneven_cases.measured_line, 0.01)[0])
    assert line.unit == "rows/s", line
    for r, cap in enumerate(line.ranks):  # rank r: (1 + r) x (10 ms + 1 ms a row)
        assert cap.fixed_s == pytest.approx(0.01 * (1 + r), rel=1e-9) and cap.speed == pytest.approx(
            1e3 / (1 + r), rel=1e-9
        )
    # The line's deployment given to hca.sharded: the report says each rank's predicted step for
    # the 8:4 cut that runs, the even cut's, and the deployment's best cut (10:2: rank 1's fixed
    # part is twice rank 0's, and it is half as fast); the strategy file carries it.
    for r in worlds(2).run(uneven_cases.dp_by_shares, "deep_mlp", shares, 12, True, 2, False, line.to_dict()):
        assert max(r["out_err"], *r["grad_errs"].values(), *r["param_errs"].values()) <= TOL, r
        # Data parallelism by shares: nothing moves forward; the backward sums gradients (all-reduces).
        assert {(d, kind) for d, kind, *_ in r["collectives"]} == {("backward", "all_reduce")}, r["collectives"]
        said = (
            r"by the deployment, measured \S+, predicted step: rank 0 8 rows [\d.]+ ms, rank 1 4 rows [\d.]+ ms; "
            r"slowest [\d.]+ ms, the even cut's [\d.]+ ms; the deployment's best cut 10:2: [\d.]+ ms"
        )
        assert re.search(said, r["shares_line"]) and re.fullmatch(said, r["explain_head"]), r
        assert hca.Deployment.from_dict(r["filed_deployment"]) == line, r["filed_deployment"]


def test_sharded_refuses_a_deployment_of_another_world(fake_pg):
    three = hca.Deployment((hca.RankCapacity("cpu", 1.0),) * 3)
    with pytest.raises(hca.MeshError, match="describes 3 ranks, the world has 4"):
        hca.sharded({}, mesh=fake_pg, deployment=three)(torch.nn.Linear(2, 2))
    with pytest.raises(hca.PlanError, match="deployment= must be a hca.Deployment or the path of its file"):
        hca.sharded({}, mesh=fake_pg, deployment={"ranks": []})(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_an_even_cut_is_told_the_deployments_best_cut(fake_pg):
    """The batch cut evenly (inputs=Shard(0)) on ranks of unequal speed: the report gives each
    rank's predicted step for the even cut and the deployment's best cut, with the plan that asks
    for it (rank 1 half as fast and paying twice the fixed part: 16:8 of 24 rows)."""
    from torch_hca.tools import zoo

    torch._dynamo.reset()
    caps = (hca.RankCapacity("cpu", 200.0, None, 0.001), hca.RankCapacity("cpu", 100.0, None, 0.002))
    dep = hca.Deployment(caps, "rows/s")
    model = hca.sharded({}, mesh=fake_pg, inputs=hca.Shard(0), outputs=hca.Shard(0), deployment=dep)(zoo.MLP())
    compiled = torch.compile(model, backend="hca")
    compiled(torch.randn(12, 16)).sum().backward()  # this rank's 12 of 24 rows
    rep = hca.report(compiled)
    view = rep.deployment_view(rep.graph)
    assert view["cut"] == "even" and view["rows"] == [12, 12] and view["best_rows"] == [16, 8], view
    assert view["predicted_s"] == pytest.approx([0.061, 0.122]) and view["best_s"] == pytest.approx(0.082), view
    said = (
        "by the deployment, predicted step: rank 0 12 rows 61 ms, rank 1 12 rows 122 ms; slowest 122 ms; "
        "the deployment's best cut 16:8: 82 ms (inputs=hca.Shard(0, shares=(16, 8)), each rank its rows)"
    )
    assert rep.parallelism().endswith(said) and said in rep.explain(), rep.parallelism()
    assert rep.deployment() == dep.to_dict()


@pytest.mark.parametrize("rows", [(12, 4), (0, 4), (4,)])
def test_measuring_a_line_needs_a_step_on_n_rows_and_two_sizes(fake_pg, rows):
    with pytest.raises(hca.MeshError, match=r"rows=.*give step\(n\), a step on n rows, and two batch sizes a < b"):
        hca.Deployment.measure(step=lambda n: None, rows=rows)
    with pytest.raises(hca.MeshError, match=r"give step\(n\)"):
        hca.Deployment.measure(rows=(4, 12))  # the default matmul work takes no rows
