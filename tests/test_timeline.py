"""`torch_hca.report.timeline.estimate`: one step's compute and communication over time.

Hand-built graphs whose values are meta tensors (shapes only, never run) give
exact expected times under a cost model where memory is free, so an op costs
its FLOPs; one graph traced with `make_fx` under the fake process group and
the compiled Megatron MLP's graphs check the same rules on real backend output.
"""

from __future__ import annotations

import json
import operator
import sys

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import torch_hca as hca
from torch_hca.tools import zoo
from torch_hca.spmd.collective_kinds import Kind
from torch_hca.spmd.cost_model import CostModel, cost_model
from torch_hca.report.timeline import Timeline, estimate

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
N = 64  # every tensor is N x N float32
MM_FLOPS = 2 * N**3

# Memory traffic is free, so an op's time is its FLOPs / flops_per_s: easy to predict.
COSTS = CostModel(launch_s=1e-4, alpha_s=1e-5, bytes_per_s=1e8, flops_per_s=1e9, memory_bytes_per_s=1e30, op_s=0.0)
MM_S = MM_FLOPS / COSTS.flops_per_s
SIZES = {"0": 4, "1": 2, "solo": 1}


def comm_s(kind: Kind = Kind.ALL_REDUCE, tensors: int = 1, group: str = "0") -> float:
    return COSTS.collective_s(kind, tensors * N * N * 4, SIZES[group])


def play(*graphs: fx.Graph) -> Timeline:
    named = [(f"g{i}", fx.GraphModule(torch.nn.Module(), g)) for i, g in enumerate(graphs)]
    return estimate(named, COSTS, group_size=SIZES.__getitem__)


class Builder:
    """An FX graph whose nodes carry meta-tensor values, as the backend's graphs carry fake ones."""

    def __init__(self):
        self.g = fx.Graph()
        self.x = self.node("placeholder", "x")

    def node(self, kind: str, target, args=(), val=None) -> fx.Node:
        n = self.g.create_node(kind, target, args)
        n.meta["val"] = torch.empty(N, N, device="meta") if val is None else val
        return n

    def op(self, target, *args, val=None) -> fx.Node:
        return self.node("call_function", target, args, val)

    def mms(self, k: int) -> fx.Node:
        y = self.x
        for _ in range(k):
            y = self.op(aten.mm.default, y, self.x)
        return y

    def all_reduce(self, x: fx.Node, group: str = "0") -> fx.Node:
        return self.op(c10d.all_reduce.default, x, "sum", group)

    def done(self, *outs: fx.Node) -> fx.Graph:
        self.g.output(outs)
        return self.g


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12


def test_compute_only_exposes_nothing():
    b = Builder()
    relu = b.op(aten.relu.default, b.mms(2))
    view = b.op(aten.t.default, relu)
    t = play(b.done(view))
    assert [(e.name, e.lane) for e in t.events] == [("aten.mm", "compute")] * 2 + [("aten.relu", "compute")]
    assert close(t.events[0].duration_s, MM_S)  # torch's mm formula, 2mnk
    assert close(t.events[2].duration_s, N * N / COSTS.flops_per_s)  # elementwise: one per output element
    assert t.exposed_comm_s == 0 and t.comm_s == 0
    assert close(t.total_s, t.compute_s) and close(t.compute_s, 2 * MM_S + N * N / COSTS.flops_per_s)


def test_a_collective_waited_at_once_is_fully_exposed():
    b = Builder()
    y = b.mms(1)
    start = b.all_reduce(y)
    t = play(b.done(b.op(aten.relu.default, b.op(WAIT, start))))
    ar = [e for e in t.events if e.lane == "comm:0"]
    assert [(e.name, e.node) for e in ar] == [("all_reduce", start.name)]
    assert close(ar[0].start_s, MM_S)  # issued when the mm before it ends
    assert close(t.comm_s, comm_s()) and close(t.exposed_comm_s, comm_s())
    relu = t.events[-1]
    assert relu.name == "aten.relu" and close(relu.start_s, ar[0].end_s)  # the wait held the compute lane


@pytest.mark.parametrize("k", [1, 3, 40])  # compute shorter than, and longer than, the collective
def test_waiting_after_independent_compute_hides_the_overlap(k):
    b = Builder()
    ar = b.all_reduce(b.x)
    busy = b.mms(k)  # does not read the all_reduce
    w = b.op(WAIT, ar)
    t = play(b.done(b.op(aten.add.Tensor, w, busy)))
    hidden = min(comm_s(), k * MM_S)
    assert close(t.comm_s, comm_s())
    assert close(t.exposed_comm_s, comm_s() - hidden)
    assert close(t.total_s, t.compute_s + t.exposed_comm_s)


@pytest.mark.parametrize("contention", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 3, 40])
def test_contention_slows_the_compute_a_collective_overlaps(k, contention):
    b = Builder()
    ar = b.all_reduce(b.x)
    busy = b.mms(k)
    t = estimate(
        [("g0", fx.GraphModule(torch.nn.Module(), b.done(b.op(aten.add.Tensor, b.op(WAIT, ar), busy))))],
        CostModel(**{**COSTS.as_dict(), "contention": contention}),
        group_size=SIZES.__getitem__,
    )
    work, comm = k * MM_S, comm_s()
    # The mms run at 1 - contention of their speed until the collective ends, then at full speed.
    slowed = min(work, comm * (1 - contention))  # work done while the collective runs
    mms_end = comm + (work - slowed) if slowed < work or contention == 1 else work / (1 - contention)
    assert close(t.compute_s, work + N * N / COSTS.flops_per_s)  # the work itself, at full speed
    assert close(t.events[-1].start_s, max(mms_end, comm))  # the add: after the mms and the wait
    assert close(t.exposed_comm_s, t.total_s - t.compute_s) and t.exposed_comm_s <= comm + 1e-12
    if contention == 1.0:  # nothing hidden: as if each ran alone, one after the other
        assert close(t.total_s, t.compute_s + comm)


def test_contention_is_a_share_from_0_to_1():
    from torch_hca.errors import OptionsError
    from torch_hca.spmd.cost_model import with_overrides

    assert with_overrides(COSTS, {"contention": 1}).contention == 1.0
    for bad in (1.5, -0.1):
        with pytest.raises(OptionsError, match="contention"):
            with_overrides(COSTS, {"contention": bad})


def test_two_groups_run_in_parallel_one_group_in_series():
    def two(groups):
        b = Builder()
        a1, a2 = (b.all_reduce(b.x, g) for g in groups)
        return play(b.done(b.op(WAIT, a1), b.op(WAIT, a2)))

    parallel = two(["0", "1"])
    assert {e.lane for e in parallel.events} == {"comm:0", "comm:1"}
    assert all(close(e.start_s, 0.0) for e in parallel.events)
    assert close(parallel.total_s, max(comm_s(group="0"), comm_s(group="1")))
    assert close(parallel.comm_s, comm_s(group="0") + comm_s(group="1"))

    series = two(["0", "0"])
    first, second = series.events
    assert close(second.start_s, first.end_s)  # queued behind the first on its lane
    assert close(series.total_s, 2 * comm_s()) and close(series.exposed_comm_s, 2 * comm_s())


def test_a_coalesced_collective_is_one_transfer():
    b = Builder()
    y = b.mms(1)
    pair = b.op(c10d.all_reduce_coalesced.default, [y, b.x], "sum", "0", val=[torch.empty(N, N, device="meta")] * 2)
    waits = [b.op(WAIT, b.op(operator.getitem, pair, i)) for i in range(2)]
    t = play(b.done(b.op(aten.add.Tensor, *waits)))
    comm = [e for e in t.events if e.lane != "compute"]
    assert [(e.name, e.node) for e in comm] == [("all_reduce (coalesced)", pair.name)]
    assert close(t.comm_s, comm_s(tensors=2)) and close(t.exposed_comm_s, comm_s(tensors=2))
    assert close(t.events[-1].start_s, comm[0].end_s)  # both waits resolve to the one transfer


def test_graphs_run_one_after_another_and_a_group_of_one_is_free():
    fw, bw = Builder(), Builder()
    t = play(fw.done(fw.op(WAIT, fw.all_reduce(fw.mms(1)))), bw.done(bw.op(WAIT, bw.all_reduce(bw.mms(1), "solo"))))
    assert [(e.graph, e.lane) for e in t.events] == [("g0", "compute"), ("g0", "comm:0"), ("g1", "compute")]
    assert close(t.events[2].start_s, t.events[1].end_s)  # backward starts when forward's wait returns
    assert close(t.total_s, 2 * MM_S + comm_s())


def test_each_graph_call_pays_its_host_time_once_before_its_ops():
    fw, bw = Builder(), Builder()
    called = CostModel(**{**COSTS.as_dict(), "call_s": 1e-3})
    t = estimate(
        [
            ("g0", fx.GraphModule(torch.nn.Module(), fw.done(fw.mms(2)))),
            ("g1", fx.GraphModule(torch.nn.Module(), bw.done(bw.mms(1)))),
        ],
        called,
    )
    assert [(e.graph, e.name) for e in t.events] == [
        ("g0", "call"),
        ("g0", "aten.mm"),
        ("g0", "aten.mm"),
        ("g1", "call"),
        ("g1", "aten.mm"),
    ]
    assert close(t.total_s, 2e-3 + 3 * MM_S) and close(t.compute_s, t.total_s)


def test_each_call_also_pays_its_host_time_per_parameter(fake_pg):
    torch.manual_seed(0)
    c = torch.compile(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP()), backend="hca")
    c(torch.randn(8, 16)).sum().backward()
    rep = hca.report(c)
    params = len(rep.graph.parameters)
    assert params == len(list(zoo.MLP().parameters()))
    hosted = CostModel(**{**cost_model("gloo").as_dict(), "call_s": 1e-3, "param_s": 1e-4})
    calls = [e for e in rep.timeline(hosted).after.events if e.name == "call"]
    assert [e.graph for e in calls] == [f"graph{rep.graph.index}.forward", f"graph{rep.graph.index}.backward"]
    assert all(close(e.duration_s, 1e-3 + params * 1e-4) for e in calls)


def test_a_graph_traced_under_the_fake_process_group(fake_pg):
    group = fake_pg.get_group().group_name

    def step(x, w):
        h = c10d.all_reduce(x @ w, "sum", group)
        return c10d.wait_tensor(h).relu()

    gm = make_fx(step, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 16))
    costs = cost_model("gloo")
    t = estimate([("forward", gm)], costs)  # group size from the live (fake) group: 4
    assert [e.name for e in t.events] == ["aten.mm", "all_reduce", "aten.relu"]
    assert close(t.exposed_comm_s, costs.collective_s(Kind.ALL_REDUCE, 8 * 16 * 4, 4))
    # Each op also pays the host time to issue it (op_s).
    assert close(t.events[0].duration_s, costs.compute_s(2 * 8 * 16 * 16, (8 * 16 + 16 * 16 + 8 * 16) * 4) + costs.op_s)


def test_every_op_pays_its_issue_time_views_included(fake_pg):
    def step(x):
        return x.t().relu()

    gm = make_fx(step, tracing_mode="fake")(torch.randn(8, 16))
    slow_host = CostModel(**{**COSTS.as_dict(), "op_s": 1e-3})
    t = estimate([("forward", gm)], slow_host)
    assert [e.name for e in t.events] == ["aten.t", "aten.relu"]
    assert close(t.events[0].duration_s, 1e-3)  # a view: only its issue time
    assert close(t.compute_s, 2e-3 + estimate([("forward", gm)], COSTS).compute_s)


@pytest.mark.parametrize("kv_heads", [4, 2])  # grouped-query: two query heads per key/value head
def test_hcas_attention_costs_its_matmuls(kv_heads):
    b, h, q_len, k_len, d = 2, 4, 16, 32, 8
    q, grad = torch.empty(b, h, q_len, d, device="meta"), torch.empty(b, h, q_len, d, device="meta")
    k, v = torch.empty(b, kv_heads, k_len, d, device="meta"), torch.empty(b, kv_heads, k_len, d, device="meta")
    g = Builder()
    args = [g.node("placeholder", name, val=val) for name, val in (("q", q), ("k", k), ("v", v), ("grad", grad))]
    groups = h // kv_heads
    fwd = g.op(torch.ops.hca.attention.default, *args[:3], None, 0, 0.5, groups, val=q)
    bwd = g.op(torch.ops.hca.attention_backward.default, args[3], *args[:3], None, 0, 0.5, groups, val=(q, k, v))
    t = play(g.done(fwd, bwd))
    scores = 2 * b * h * q_len * k_len * d  # one [q_len, d] x [d, k_len] product per head
    # forward: scores and scores x v; backward: the scores again, then four products of the same size
    assert [e.duration_s * COSTS.flops_per_s for e in t.events] == pytest.approx([2 * scores, 5 * scores])


def test_the_compiled_mlp_graphs(fake_pg):
    torch.manual_seed(0)
    c = torch.compile(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP()), backend="hca")
    c(torch.randn(8, 16)).sum().backward()
    r = hca.report(c)
    t = estimate([("forward", r.forward), ("backward", r.backward)], cost_model("gloo"))
    comm = [e for e in t.events if e.lane != "compute"]
    assert len(comm) == len(r.collectives) and comm
    assert {e.graph for e in t.events} == {"forward", "backward"}
    assert t.compute_s > 0 and 0 <= t.exposed_comm_s <= t.comm_s + 1e-12
    assert close(t.total_s, t.compute_s + t.exposed_comm_s)


def sample() -> Timeline:
    b = Builder()
    ar = b.all_reduce(b.x)
    return play(b.done(b.op(WAIT, ar), b.op(WAIT, b.all_reduce(b.mms(2), "1"))))


def test_chrome_trace_is_valid_json_with_one_thread_per_lane(tmp_path):
    t = sample()
    trace = json.loads(json.dumps(t.chrome_trace()))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(t.events)
    for span, event in zip(spans, t.events):
        assert {"ph", "ts", "dur", "tid", "name", "pid"} <= span.keys()
        assert span["name"] == event.name and span["args"]["node"] == event.node
        assert span["ts"] == pytest.approx(event.start_s * 1e6) and span["dur"] == pytest.approx(event.duration_s * 1e6)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["comm:0", "comm:1", "compute"]
    assert {threads[s["tid"]] for s in spans} == {e.lane for e in t.events}

    path = tmp_path / "step.json"
    t.save_chrome_trace(path)
    assert json.loads(path.read_text()) == trace


def test_summary_names_the_figures():
    t = sample()
    text = t.summary()
    assert "compute" in text and "exposed" in text and "2 collective(s) on 2 group(s)" in text


def test_save_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(hca.HCAError, match=r'pip install "torch_hca\[plot\]"'):
        sample().save_png(tmp_path / "step.png")
    assert not (tmp_path / "step.png").exists()


def test_save_png_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra; not installed here")
    path = tmp_path / "step.png"
    sample().save_png(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sync_is_paid_per_collective_but_does_not_grow_buckets():
    """sync_s (ranks arriving apart after compute) costs each collective; merging collectives
    into a bucket saves transfers, not that wait, so the bucket size ignores it."""
    base = cost_model("gloo")
    synced = CostModel(**{**base.as_dict(), "sync_s": 2e-3})
    assert close(synced.collective_s(Kind.ALL_REDUCE, 1024, 2), base.collective_s(Kind.ALL_REDUCE, 1024, 2) + 2e-3)
    assert synced.bucket_cap_bytes(2) == pytest.approx(base.bucket_cap_bytes(2))


def test_a_matmul_runs_at_its_smallest_dimensions_share_of_the_rate():
    """With matmul_half_dim h, an mm whose smallest dimension is d runs at d / (d + h) of
    flops_per_s; elementwise ops and a model without h are unchanged."""
    import dataclasses

    from torch_hca.report.timeline import op_seconds

    slow = dataclasses.replace(COSTS, matmul_half_dim=8.0)
    b = Builder()
    thin = b.op(
        aten.mm.default,
        b.op(aten.relu.default, b.x, val=torch.empty(8, N, device="meta")),
        b.x,
        val=torch.empty(8, N, device="meta"),
    )
    wide = b.op(aten.addmm.default, b.x, b.x, b.x)
    relu = thin.args[0]
    flops = 2 * 8 * N * N
    assert close(op_seconds(thin, COSTS), flops / COSTS.flops_per_s)
    assert close(op_seconds(thin, slow), flops / COSTS.flops_per_s * (8 + 8) / 8)  # rows: 8
    assert close(op_seconds(wide, slow), op_seconds(wide, COSTS) * (N + 8) / N)  # addmm: its operands after the bias
    assert close(op_seconds(relu, slow), op_seconds(relu, COSTS))
