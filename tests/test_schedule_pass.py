"""The schedule pass (passes/schedule.py, passes/buckets.py): overlap, the in-flight bound, buckets.

Graph-level tests trace small programs with `make_fx` on the fake process
group and run the pass on them. Where numbers matter (a bucket's copies and
splits), both graphs run under `LocalTensorMode`, every rank in this process,
with real collective semantics. End to end: data parallel DeepMLP(16, 12) on
real gloo ranks against one device, with the schedule on and off.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import dist_cases
from torch_hca.spmd.collective_nodes import OPS, WAIT, node_payload
from torch_hca.compiler.options import Options
from torch_hca.passes.infra import PassContext, run_pass
from torch_hca.passes.schedule import SchedulePass
from torch_hca.report.records import GraphReport
from torch_hca.compiler.checks.schedule_check import check_order

c10d = torch.ops._c10d_functional
MB = 2**20
F32_4x4 = 4 * 4 * 4  # bytes of one [4, 4] fp32 tensor


@pytest.fixture
def group(fake_pg) -> str:
    return fake_pg.get_group().group_name


def ar(x, group):
    return c10d.all_reduce(x, "sum", group)


def wait(x):
    return c10d.wait_tensor(x)


def traced(f, *shapes) -> fx.GraphModule:
    torch.manual_seed(0)
    return make_fx(f, tracing_mode="fake")(*[torch.randn(s) for s in shapes])


def schedule(gm: fx.GraphModule, which: str = "forward", **options) -> tuple[fx.GraphModule, dict]:
    ctx = PassContext(Options(**options), GraphReport(index=0, options=None))
    return run_pass(SchedulePass(which), gm, ctx), ctx.report.schedules[which]


def calls(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def max_in_flight(gm: fx.GraphModule) -> tuple[int, int]:
    """(most collectives, most payload bytes) started and not yet waited on, walking the order."""
    flight: dict[fx.Node, int] = {}
    most = (0, 0)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in OPS:
            flight[n] = sum(v.numel() * v.element_size() for v in node_payload(n))
        elif n.op == "call_function" and n.target is WAIT:
            flight.pop(n.args[0], None)
        most = max(most[0], len(flight)), max(most[1], sum(flight.values()))
    return most


def collectives(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in OPS]


def run_local(
    gm: fx.GraphModule, inputs: list[dict[int, torch.Tensor]], world: int = 4
) -> list[dict[int, torch.Tensor]]:
    """Run `gm` on every rank at once (LocalTensorMode); each output as {rank: tensor}."""
    with LocalTensorMode(world):
        outs = gm(*[LocalTensor({r: t.clone() for r, t in x.items()}) for x in inputs])
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    return [{r: t.clone() for r, t in o._local_tensors.items()} for o in outs]


def per_rank(*shapes, world: int = 4, seed: int = 0) -> list[dict[int, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{r: torch.randn(s, generator=gen) for r in range(world)} for s in shapes]


def assert_same_numbers(before: fx.GraphModule, after: fx.GraphModule, inputs) -> None:
    for a, b in zip(run_local(before, inputs), run_local(after, inputs)):
        for r in a:
            torch.testing.assert_close(b[r], a[r], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ reordering


def test_start_moves_early_and_wait_moves_late(group):
    def traced_late_start(a, b):
        x = a.relu()
        z = (b @ b) @ b  # compute that does not need the collective
        return wait(ar(x, group)) * z

    def traced_early_wait(a, b):
        x = a.relu()
        y = wait(ar(x, group))
        return y * ((b @ b) @ b)

    for f, moved in (
        (traced_late_start, {"starts_earlier": 1, "waits_later": 0}),
        (traced_early_wait, {"starts_earlier": 0, "waits_later": 1}),
    ):
        gm, record = schedule(traced(f, (4, 4), (4, 4)))
        # Started as soon as relu has run, waited just before the mul that reads it.
        assert calls(gm) == ["relu", "all_reduce", "mm", "mm_1", "wait_tensor", "mul"]
        assert record["moved"] == {**moved, "waits_forced": 0}
        assert record["order"] == "scheduled" and record["buckets"] == []


def test_group_order_is_kept(group):
    """Two collectives of one group never swap, even when the second is ready first."""

    def f(a, b):
        x = (a @ a) @ a
        y = b.relu()
        return wait(ar(x, group)) + wait(ar(y, group))

    gm, _ = schedule(traced(f, (4, 4), (4, 4)))
    order = calls(gm)
    assert order.index("all_reduce") < order.index("all_reduce_1")
    assert order.index("all_reduce") == order.index("mm_1") + 1  # as early as its input allows


def chain_of_reductions(group, k: int = 4):
    """k reductions, each of a value the previous compute produced; all waited at the end."""

    def f(a, w):
        pending, x = [], a
        for _ in range(k):
            x = (x @ w).relu()
            pending.append(ar(x, group))
        return sum(wait(p) for p in pending)

    return traced(f, (4, 4), (4, 4))


@pytest.mark.parametrize("bound_bytes,most", [(1e9, 4), (2 * F32_4x4, 2), (F32_4x4, 1), (0, 1)])
def test_in_flight_bound(group, bound_bytes, most):
    gm, record = schedule(chain_of_reductions(group), max_in_flight_mb=bound_bytes / MB)
    assert max_in_flight(gm) == (most, most * F32_4x4)
    assert record["moved"]["waits_forced"] == 4 - most
    if most == 1:  # each wait before the next start
        kinds = ["start" if n.target in OPS else "wait" for n in gm.graph.nodes if n.target in OPS or n.target is WAIT]
        assert kinds == ["start", "wait"] * 4


def test_a_collective_larger_than_the_bound_runs_alone(group):
    gm, _ = schedule(chain_of_reductions(group, 2), max_in_flight_mb=1 / MB)
    assert max_in_flight(gm) == (1, F32_4x4)


def test_by_default_one_large_collective_stays_in_flight_with_the_next(group):
    """The default bound is the larger of 64 MiB and twice the largest collective: a gradient over
    64 MiB (a language model's head) issued first stays in flight while the small reductions after
    it start; a fixed 64 MiB bound makes it run alone (its wait before the next start)."""

    def f(big, a, w):
        pending = [ar(big.relu(), group)]
        x = a
        for _ in range(2):
            x = (x @ w).relu()
            pending.append(ar(x, group))
        return [wait(p) for p in pending]

    gm = make_fx(f, tracing_mode="fake")(torch.empty(70 * MB // 4), torch.randn(4, 4), torch.randn(4, 4))
    default, _ = schedule(copy.deepcopy(gm))
    assert max_in_flight(default) == (3, 70 * MB + 2 * F32_4x4)
    fixed, record = schedule(gm, max_in_flight_mb=64)
    assert max_in_flight(fixed) == (2, 70 * MB) and record["moved"]["waits_forced"] == 1  # never together


def test_in_place_write_waits_for_the_collective_holding_its_buffer(group):
    def f(a, b):
        x = a.relu()
        y = wait(ar(x, group))
        z = b @ b
        x.add_(1)  # writes the buffer the all_reduce read: its wait may not sink past it
        return y + z + x

    gm, record = schedule(traced(f, (4, 4), (4, 4)))
    assert calls(gm) == ["relu", "all_reduce", "mm", "wait_tensor", "add_", "add", "add_1"]
    assert record["moved"]["waits_later"] == 1


def test_starts_never_come_between_the_inputs(group):
    def f(w, x):
        return x.relu() @ wait(c10d.all_gather_into_tensor(w, 4, group))

    gm, _ = schedule(traced(f, (1, 4), (4, 4)))
    ops = [n.op for n in gm.graph.nodes]
    assert ops[:2] == ["placeholder", "placeholder"] and calls(gm)[0] == "all_gather_into_tensor"


def test_schedule_off_keeps_the_traced_order_and_records_it(group):
    gm = traced(lambda a, b: wait(ar(a.relu(), group)) * (b @ b), (4, 4), (4, 4))
    code = gm.code
    out, record = schedule(gm, "backward", schedule=False)
    assert out.code == code and record["order"] == "as traced"
    assert record["buckets"] == [] and record["moved"] == {"starts_earlier": 0, "waits_later": 0, "waits_forced": 0}
    assert isinstance(record["before"], fx.GraphModule) and record["before"].code == code
    assert record["per_group"] == {group: ["all_reduce:torch.float32:(4, 4)"]}


def test_before_is_the_graph_as_traced(group):
    gm = traced(lambda a, b: wait(ar(a.relu(), group)) * (b @ b), (4, 4), (4, 4))
    code = gm.code
    out, record = schedule(gm)
    assert record["before"].code == code and out.code != code


# --------------------------------------------------------------- buckets


def gradients(group, sizes, reduce_op="sum"):
    """A backward-like graph: one gradient per size, each reduced; all are outputs."""

    def f(x, *ws):
        return tuple(wait(c10d.all_reduce(x.sum() * w, reduce_op, group)) for w in ws)

    return traced(f, (4,), *[(s,) for s in sizes]), [(4,)] + [(s,) for s in sizes]


def test_gradient_reductions_merge_into_one_bucket(group):
    gm, shapes = gradients(group, [16, 256, 16, 256])
    before = copy.deepcopy(gm)
    out, record = schedule(gm, "backward")
    (coll,) = collectives(out)
    assert record["buckets"] == [
        {
            "collective": coll.name,
            "kind": "all_reduce",
            "group": group,
            "bytes": 4 * (16 + 256 + 16 + 256),
            "members": [["all_reduce", 64], ["all_reduce_1", 1024], ["all_reduce_2", 64], ["all_reduce_3", 1024]],
        }
    ]
    assert coll.meta["hca_bucket"] == ["all_reduce", "all_reduce_1", "all_reduce_2", "all_reduce_3"]
    assert tuple(coll.meta["val"].shape) == (16 + 256 + 16 + 256,)
    for n in out.graph.nodes:
        if n.op == "call_function":
            assert "val" in n.meta, f"{n.name} has no fake value"
    assert record["per_group"] == {group: ["all_reduce:torch.float32:(544,)"]}
    assert_same_numbers(before, out, per_rank(*shapes))


@pytest.mark.parametrize(
    "cap_bytes,expected",
    [
        (4 * (16 + 256), [2, 2]),  # exactly one bias and one weight per bucket
        (4 * (16 + 256 + 16), [3]),  # the fourth does not fit: left alone
        (0, []),  # no bucketing
    ],
)
def test_buckets_respect_the_cap(group, cap_bytes, expected):
    gm, shapes = gradients(group, [16, 256, 16, 256])
    before = copy.deepcopy(gm)
    out, record = schedule(gm, "backward", bucket_cap_mb=cap_bytes / MB)
    assert [len(b["members"]) for b in record["buckets"]] == expected
    assert all(b["bytes"] <= cap_bytes for b in record["buckets"])
    assert len(collectives(out)) == 4 - sum(expected) + len(expected)
    assert_same_numbers(before, out, per_rank(*shapes))


def test_a_reduction_left_alone_starts_when_its_gradient_is_ready(group):
    """The transpose pass emits the reductions at the end, in parameter order; a group issues in
    graph order. The big gradient, ready first, must not wait there for the small one computed
    last (with no buckets, cap 0), or nothing overlaps: its start moves right after its input."""

    def f(x, big, small):
        g_big = x.sum() * big
        g_small = (x.exp().sum() * x.cos().sum()) * small  # the rest of the backward
        return wait(c10d.all_reduce(g_small, "sum", group)), wait(c10d.all_reduce(g_big, "sum", group))

    gm = traced(f, (4,), (256,), (16,))
    before = copy.deepcopy(gm)
    out, record = schedule(gm, "backward", bucket_cap_mb=0)
    order = calls(out)
    big_start = next(n.name for n in collectives(out) if n.meta["val"].shape == (256,))
    assert order.index(big_start) < order.index("exp"), order
    assert record["per_group"][group] == ["all_reduce:torch.float32:(256,)", "all_reduce:torch.float32:(16,)"]
    assert_same_numbers(before, out, per_rank((4,), (256,), (16,)))
    # The forward graph's weight gathers are not moved (gathering every weight first costs memory).
    assert schedule(copy.deepcopy(before), "forward", bucket_cap_mb=0)[1]["per_group"][group][0].endswith("(16,)")


def test_only_same_key_merges(group):
    """Different reduce ops, groups or dtypes never share a bucket."""
    other = dist.new_group(list(range(dist.get_world_size()))).group_name

    def f(x, a, b, c, d):
        s = x.sum()
        return (
            wait(c10d.all_reduce(s * a, "sum", group)),
            wait(c10d.all_reduce(s * b, "avg", group)),
            wait(c10d.all_reduce(s * c, "sum", other)),
            wait(c10d.all_reduce((s * d).double(), "sum", group)),
            wait(c10d.all_reduce(s * a + 1, "sum", group)),
        )

    out, record = schedule(traced(f, (4,), (8,), (8,), (8,), (8,)), "backward")
    assert [b["members"] for b in record["buckets"]] == [[["all_reduce", 32], ["all_reduce_4", 32]]]
    assert len(collectives(out)) == 4


def test_a_reduction_needed_before_the_next_is_ready_is_not_merged(group):
    """Cotangent chain: the second reduction's input needs the first's result."""

    def f(x, w):
        y = wait(ar(x @ w, group))
        return wait(ar(y @ w, group))

    out, record = schedule(traced(f, (4, 4), (4, 4)), "backward")
    assert record["buckets"] == [] and len(collectives(out)) == 2


def test_a_reduction_of_a_reduction_is_not_merged_with_it(group):
    """The second reads the first's result directly: merging them would be a cycle."""

    def f(x, y):
        first = wait(ar(x.relu(), group))
        other = wait(ar(y.relu(), group))
        return wait(ar(first, group)), other

    gm = traced(f, (4, 4), (4, 4))
    before = copy.deepcopy(gm)
    out, record = schedule(gm, "backward")
    # In input-ready order: all_reduce, then all_reduce_2 (it cannot join: it reads all_reduce's
    # result), which closes the first bucket; all_reduce_1 is ready before all_reduce_2's result is needed.
    assert [[m for m, _ in b["members"]] for b in record["buckets"]] == [["all_reduce_2", "all_reduce_1"]]
    assert_same_numbers(before, out, per_rank((4, 4), (4, 4)))


def test_what_finishes_a_result_moves_after_the_bucket(group):
    """A chunk and copy of a reduced gradient, traced right after its wait, follow the bucket."""

    def f(x, a, b):
        s = x.sum()
        mine = wait(ar(s * a, group)).chunk(4)[1].clone()  # late: reads only the result
        return mine, wait(ar(s * b, group))

    gm = traced(f, (4,), (8, 4), (8, 4))
    before = copy.deepcopy(gm)
    out, record = schedule(gm, "backward")
    assert len(record["buckets"]) == 1 and len(collectives(out)) == 1
    order = calls(out)
    assert order.index("bucket_wait_tensor") < order.index("clone") and order.index("mul_1") < order.index("bucket_cat")
    assert_same_numbers(before, out, per_rank((4,), (8, 4), (8, 4)))


def test_a_bucket_reading_another_buckets_result_comes_after_it(group):
    """Found by the property test: the all_reduce bucket reads a result of the reduce_scatter bucket."""
    other = _second_group()

    def f(x):
        h = c10d.reduce_scatter_tensor(x, "sum", 4, other)
        first = wait(h).repeat(4, 1)
        t = torch.tanh(x * 2 + x)
        a, b = ar(first, group), ar(t, group)
        c = c10d.reduce_scatter_tensor(t, "sum", 4, other)
        return wait(a), wait(b), wait(c).repeat(4, 1)

    gm = traced(f, (8, 4))
    before = copy.deepcopy(gm)
    out, record = schedule(gm, "backward")
    assert sorted(b["kind"] for b in record["buckets"]) == ["all_reduce", "reduce_scatter"]
    order = calls(out)
    assert order.index("bucket_reduce_scatter") < order.index("bucket_all_reduce")
    assert_same_numbers(before, out, per_rank((8, 4)))


def test_reduce_scatter_bucket(group):
    def f(x, a, b):
        s = x.sum()
        return (
            wait(c10d.reduce_scatter_tensor(s * a, "sum", 4, group)),
            wait(c10d.reduce_scatter_tensor((s * b).t(), "sum", 4, group)),
        )  # non-contiguous input

    gm = traced(f, (4,), (8, 3), (5, 12))
    before = copy.deepcopy(gm)
    out, record = schedule(gm, "backward")
    (coll,) = collectives(out)
    assert coll.target is c10d.reduce_scatter_tensor.default and tuple(coll.meta["val"].shape) == (6 + 15,)
    assert record["buckets"][0]["bytes"] == 4 * (24 + 60)
    assert_same_numbers(before, out, per_rank((4,), (8, 3), (5, 12)))


def test_forward_weight_all_gathers_bucket(group):
    def f(x, w1, w2, b1):
        w1 = wait(c10d.all_gather_into_tensor(w1, 4, group))
        h = (x @ w1.t()).relu()
        w2 = wait(c10d.all_gather_into_tensor(w2, 4, group))
        b1 = wait(c10d.all_gather_into_tensor(b1, 4, group))
        act = wait(c10d.all_gather_into_tensor(h, 4, group))  # an activation: not a weight
        return act @ w2 + b1

    shapes = [(2, 6), (2, 6), (2, 8), (2,)]
    gm = traced(f, *shapes)
    before = copy.deepcopy(gm)
    out, record = schedule(gm, "forward")
    (bucket,) = record["buckets"]
    assert [m for m, _ in bucket["members"]] == [
        "all_gather_into_tensor",
        "all_gather_into_tensor_1",
        "all_gather_into_tensor_2",
    ]
    assert bucket["bytes"] == 4 * 4 * (12 + 16 + 2)
    assert [tuple(c.meta["val"].shape) for c in collectives(out)] == [(4 * 30,), (8, 8)]
    # The bucket starts before any compute; the activation's gather after the matmul.
    assert calls(out)[:5] == ["bucket_view", "bucket_view_1", "bucket_view_2", "bucket_cat", "bucket_all_gather"]
    assert_same_numbers(before, out, per_rank(*shapes))


def test_backward_all_gathers_and_forward_reductions_are_not_bucketed(group):
    def f(a, b):
        return wait(ar(a, group)), wait(ar(b, group))

    _, record = schedule(traced(f, (4,), (4,)), "forward")
    assert record["buckets"] == []


def test_same_graph_same_order(group):
    """Determinism: the order depends on the graph alone."""

    def f(x, w, *gs):
        h = (x @ w).relu()
        outs = [wait(ar(h.sum() * g, group)) for g in gs]
        return (wait(ar(h, group)) @ w, *outs)

    make = lambda: traced(f, (4, 4), (4, 4), (16,), (256,), (16,), (4, 4))
    results = [schedule(make(), "backward", bucket_cap_mb=300 * 4 / MB, max_in_flight_mb=600 / MB) for _ in range(2)]
    results.append(schedule(copy.deepcopy(make()), "backward", bucket_cap_mb=300 * 4 / MB, max_in_flight_mb=600 / MB))
    codes = {r[0].code for r in results}
    assert len(codes) == 1
    assert len({str(r[1]["buckets"]) for r in results}) == 1
    assert len({r[1]["fingerprint"] for r in results}) == 1


# ------------------------------------- property: every output is checked and equal

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _program(steps, group, groups):
    """A random program on [8, 4] values: compute, collectives, waits at random later points."""

    def f(*inputs):
        values, pending = list(inputs), []
        for op, i, j in steps:
            src = values[i % len(values)]
            if op == "compute":
                values.append(torch.tanh(src * (j % 3 + 1) + values[j % len(values)]))
            elif op == "wait" and pending:
                kind, handle = pending.pop(i % len(pending))
                got = wait(handle)
                if kind == "all_gather":
                    got = got.view(4, 8, 4).sum(0)
                elif kind == "reduce_scatter":
                    got = got.repeat(4, 1)
                values.append(got)
            elif op in KINDS:
                g = groups[j % len(groups)]
                if op == "all_reduce":
                    handle = c10d.all_reduce(src, "sum", g)
                elif op == "all_gather":
                    handle = c10d.all_gather_into_tensor(src, 4, g)
                else:
                    handle = c10d.reduce_scatter_tensor(src, "sum", 4, g)
                pending.append((op, handle))
        for kind, handle in pending:
            got = wait(handle)
            values.append(
                got.view(4, 8, 4).sum(0)
                if kind == "all_gather"
                else got.repeat(4, 1)
                if kind == "reduce_scatter"
                else got
            )
        return tuple(values[len(inputs) :]) or (inputs[0] + 0,)

    return f


STEP = st.tuples(st.sampled_from(("compute", "wait", "all_reduce") + KINDS), st.integers(0, 20), st.integers(0, 20))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(STEP, min_size=1, max_size=16),
    which=st.sampled_from(("forward", "backward")),
    cap=st.sampled_from((0, 300, 1e9)),
    bound=st.sampled_from((0, 256, 1e9)),
)
def test_every_schedule_is_checked_and_computes_the_same(fake_pg, steps, which, cap, bound):
    group = fake_pg.get_group().group_name
    groups = [group, _second_group()]
    gm = traced(_program(steps, group, groups), (8, 4), (8, 4))
    before = copy.deepcopy(gm)
    out, record = schedule(gm, which, bucket_cap_mb=cap / MB, max_in_flight_mb=bound / MB)
    check_order(out)  # the pass checked it too; the checker is independent
    event(f"{len(record['buckets'])} bucket(s), {record['moved']['waits_forced']} forced wait(s)")
    largest = max((sum(v.numel() * v.element_size() for v in node_payload(c)) for c in collectives(out)), default=0)
    assert max_in_flight(out)[1] <= max(bound, largest)
    if not record["buckets"]:  # reordering alone keeps every group's sequence; the backward's
        as_traced = check_order(before).per_group  # reductions may start in input-ready order instead
        if which == "forward":
            assert record["per_group"] == as_traced
        else:
            sort = lambda per_group: {g: sorted(s) for g, s in per_group.items()}
            assert sort(record["per_group"]) == sort(as_traced)
    assert_same_numbers(before, out, per_rank((8, 4), (8, 4)))


_SECOND: dict[int, str] = {}


def _second_group() -> str:
    """A second group over the same ranks, one per process group (fake_pg makes a new one each test)."""
    key = id(dist.group.WORLD)
    if key not in _SECOND:
        _SECOND.clear()
        _SECOND[key] = dist.new_group(list(range(dist.get_world_size()))).group_name
    return _SECOND[key]


# ---------------------------------------------------------- end to end

DP12_BYTES = 12 * (16 * 16 + 16) * 4  # every gradient of DeepMLP(16, 12), fp32


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "options,count,buckets",
    [
        # Default cap (25 MiB): all 24 gradients fit one bucket.
        ({}, 1, [(24, DP12_BYTES)]),
        # A cap of exactly four layers (bias and weight each, in the order backward makes them).
        ({"bucket_cap_mb": 4 * 1088 / MB}, 3, [(8, 4 * 1088)] * 3),
        # Schedule off: one all-reduce per parameter, as traced.
        ({"schedule": False}, 24, []),
    ],
)
def test_data_parallel_gradients_in_buckets(worlds, world_size, options, count, buckets):
    results = worlds(world_size).run(dist_cases.parity, "dp12", 3, options)
    first = results[0]
    assert first["out_err"] <= 1e-5
    bad = {n: e for n, e in first["grad_errs"].items() if not e <= 1e-5}
    assert not bad and len(first["grad_errs"]) == 24, f"gradients off: {bad}"
    assert all(e <= 1e-5 for e in first["param_errs"].values())
    assert first["forward"] == {} and first["backward"] == {"all_reduce": count}
    assert first["buckets"]["backward"] == buckets
    assert first["bytes"]["backward"] == DP12_BYTES
    assert all(r["backward"] == first["backward"] for r in results)


@pytest.mark.parametrize("world_size", [2, 4])
def test_inner_inductor_with_several_buckets_trains_with_parity(worlds, world_size):
    """Inductor compiles the bucketed, reordered graphs again: still one device's gradients.

    Several buckets, each reduced while the backward goes on: Inductor once reused a saved
    ReLU output's memory (AOTAutograd's "donated buffers") while a later weight-gradient
    matmul still read it, through the ReLU's alias, also saved, and 3 of 4 weight gradients
    came out wrong with no error (`_torch_private.no_donated_buffers`)."""
    options = {"inner": "inductor", "bucket_cap_mb": 2200 / 2**20}  # two layers' gradients a bucket
    first = worlds(world_size).run(dist_cases.parity, "dp", 3, options)[0]
    assert first["buckets"]["backward"] == [(4, 2 * (16 * 16 + 16) * 4)] * 2
    assert first["backward"] == {"all_reduce": 2}
    assert first["out_err"] <= 1e-5
    assert all(e <= 1e-5 for e in first["grad_errs"].values()), first["grad_errs"]
    assert all(e <= 1e-5 for e in first["param_errs"].values()), first["param_errs"]


@pytest.mark.parametrize("storage", ["data_parallel", "fsdp"])
def test_exposed_communication_estimate_is_at_least_halved(fake_pg, storage):
    """The issue's target, on the cost model (an estimate, not a timing): DeepMLP(256, 12),
    24 parameter tensors, 4 ranks; replicated weights, or Shard(0) weights gathered."""
    import torch_hca as hca
    from torch.distributed.tensor import Shard
    from torch_hca.tools import zoo

    plan = {} if storage == "data_parallel" else {"*": Shard(0)}
    model = hca.sharded(plan, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(256, 12))
    compiled = torch.compile(model, backend="hca", dynamic=False)
    compiled(torch.randn(64, 256)).sum().backward()
    rep = hca.report(compiled)
    kinds = {c.kind for c in rep.collectives}
    assert kinds == ({"all_reduce"} if storage == "data_parallel" else {"all_gather", "reduce_scatter"})
    t = rep.timeline()
    assert t.after.exposed_comm_s <= t.before.exposed_comm_s / 2, t.summary()
    # Same work plus the buckets' copies in and out (none, where the timeline found unmerged
    # collectives started early faster); the step still gets shorter.
    assert t.before.compute_s * (1 - 1e-9) <= t.after.compute_s <= 1.15 * t.before.compute_s
    assert t.after.total_s < t.before.total_s
