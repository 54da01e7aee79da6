"""`torch_hca.compiler.checks.schedule_check.check_order`: the independent checker of a graph's order.

Hand-built FX graphs (never run: the checker only reads them) for each way an
order can be wrong, the compiled Megatron MLP's graphs for the way it must be
right, and a property test: every legal interleaving of two independent
collective chains is accepted, with a fingerprint that changes only when the
order of the collectives within a group does.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_hca as hca
from torch_hca.tools import zoo
from torch_hca.compiler.checks.schedule_check import ScheduleSummary, check_order

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default
GROUP = "0"


def module(graph: fx.Graph) -> fx.GraphModule:
    return fx.GraphModule(torch.nn.Module(), graph)


def chain(graph: fx.Graph, x: fx.Node, group: str = GROUP) -> dict[str, fx.Node]:
    """x -> relu -> all_reduce -> wait -> mul, in program order."""
    nodes = {"compute": graph.call_function(aten.relu.default, (x,), name="relu")}
    nodes["all_reduce"] = graph.call_function(ALL_REDUCE, (nodes["compute"], "sum", group), name="all_reduce")
    nodes["wait"] = graph.call_function(WAIT, (nodes["all_reduce"],), name="wait_tensor")
    nodes["use"] = graph.call_function(aten.mul.Tensor, (nodes["wait"], 2), name="mul")
    return nodes


def one_chain() -> tuple[fx.Graph, dict[str, fx.Node]]:
    g = fx.Graph()
    x = g.placeholder("x")
    nodes = chain(g, x)
    g.output((nodes["use"],))
    return g, nodes


# ---------------------------------------------------------------------------
# Accepts


def test_accepts_a_well_ordered_chain():
    g, nodes = one_chain()
    summary = check_order(module(g))
    assert isinstance(summary, ScheduleSummary)
    # No "val" meta on hand-built nodes: dtype and shape print as unknown.
    assert summary.per_group == {GROUP: ["all_reduce:?:()"]}
    assert len(summary.fingerprint) == 16


def test_accepts_the_compiled_mlp_graphs(fake_pg):
    torch.manual_seed(0)
    m = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(64, 256))
    c = torch.compile(m, backend="hca")
    c(torch.randn(8, 64)).sum().backward()
    r = hca.report(c)

    fw = check_order(r.forward, "forward")
    bw = check_order(r.backward, "backward")
    group = str(fake_pg.get_group().group_name)
    assert fw.per_group == {group: ["all_reduce:torch.float32:(8, 64)"]}
    assert bw.per_group == {}
    # The schedule pass ran the same checker: same answer, recorded in the report.
    assert r.graph.schedules["forward"]["fingerprint"] == fw.fingerprint
    assert r.graph.schedules["backward"]["fingerprint"] == bw.fingerprint
    assert fw.fingerprint != bw.fingerprint


# ---------------------------------------------------------------------------
# Rejects


def test_rejects_reading_a_collective_before_its_wait():
    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(ALL_REDUCE, (x, "sum", GROUP), name="all_reduce")
    early = g.call_function(aten.mul.Tensor, (ar, 2), name="early_read")
    w = g.call_function(WAIT, (ar,), name="wait_tensor")
    g.output((early, w))
    with pytest.raises(hca.CheckError, match=r"early_read reads collective all_reduce before its wait"):
        check_order(module(g), "forward")


def test_rejects_returning_a_collective_unwaited():
    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(ALL_REDUCE, (x, "sum", GROUP), name="all_reduce")
    g.output((ar,))
    with pytest.raises(hca.CheckError, match=r"output reads collective all_reduce before its wait"):
        check_order(module(g))


def test_rejects_a_collective_never_waited_on():
    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(ALL_REDUCE, (x, "sum", GROUP), name="lonely_reduce")
    w = g.call_function(WAIT, (g.call_function(ALL_REDUCE, (x, "sum", GROUP)),))
    g.output((w,))
    assert ar.users == {}
    with pytest.raises(hca.CheckError, match=r"\(backward\): collective\(s\) lonely_reduce are never waited on"):
        check_order(module(g), "backward")


def test_rejects_a_read_before_the_value_is_defined():
    g, nodes = one_chain()
    check_order(module(g))  # legal as built
    nodes["compute"].prepend(nodes["use"])  # move the final mul before relu
    with pytest.raises(hca.CheckError, match=r"mul reads wait_tensor before it is computed"):
        check_order(module(g))


def test_rejects_a_wait_moved_before_its_collective():
    g, nodes = one_chain()
    nodes["all_reduce"].prepend(nodes["wait"])
    with pytest.raises(hca.CheckError, match=r"wait_tensor reads all_reduce before it is computed"):
        check_order(module(g))


def test_rejects_an_in_place_write_to_the_collective_input_while_in_flight():
    g, nodes = one_chain()
    with g.inserting_before(nodes["wait"]):
        g.call_function(aten.add_.Tensor, (nodes["compute"], 1), name="clobber")
    with pytest.raises(hca.CheckError, match=r"clobber writes relu while all_reduce holds it"):
        check_order(module(g))


def test_accepts_an_in_place_write_after_the_wait():
    g, nodes = one_chain()
    with g.inserting_after(nodes["wait"]):
        g.call_function(aten.add_.Tensor, (nodes["compute"], 1))
    check_order(module(g))


def test_accepts_an_in_place_write_to_another_buffer_while_in_flight():
    g, nodes = one_chain()
    other = next(iter(g.find_nodes(op="placeholder")))
    with g.inserting_before(nodes["wait"]):
        g.call_function(aten.add_.Tensor, (other, 1))
    check_order(module(g))


# ---------------------------------------------------------------------------
# Property: every legal interleaving of two independent chains


# name -> (target, args; strings name other nodes). Two chains, each
# compute -> all_reduce -> wait -> compute, on inputs x and y.
_CHAINS = {
    "a_in": (aten.relu.default, ("x",)),
    "a_ar": (ALL_REDUCE, ("a_in", "sum", "GROUP_A")),
    "a_wait": (WAIT, ("a_ar",)),
    "a_out": (aten.mul.Tensor, ("a_wait", 2)),
    "b_in": (aten.relu.default, ("y",)),
    "b_ar": (ALL_REDUCE, ("b_in", "sum", "GROUP_B")),
    "b_wait": (WAIT, ("b_ar",)),
    "b_out": (aten.mul.Tensor, ("b_wait", 2)),
}
_SHAPES = {"a": (4,), "b": (8, 2)}  # distinct payloads, so the per-group sequence shows the order


def _deps(name: str) -> set[str]:
    return {a for a in _CHAINS[name][1] if isinstance(a, str) and a in _CHAINS}


def _build(order: list[str], groups: dict[str, str]) -> fx.GraphModule:
    g = fx.Graph()
    env = {"x": g.placeholder("x"), "y": g.placeholder("y")}
    for name in order:
        target, args = _CHAINS[name]
        args = tuple(env.get(a, groups.get(a, a)) if isinstance(a, str) else a for a in args)
        env[name] = g.call_function(target, args, name=name)
        env[name].meta["val"] = torch.empty(_SHAPES[name[0]])
    g.output((env["a_out"], env["b_out"]))
    return module(g)


@st.composite
def topological_orders(draw) -> list[str]:
    """A random topological order of `_CHAINS` (a wait always after its collective)."""
    order: list[str] = []
    while len(order) < len(_CHAINS):
        ready = sorted(n for n in _CHAINS if n not in order and _deps(n) <= set(order))
        order.append(draw(st.sampled_from(ready)))
    return order


@settings(max_examples=60, deadline=None)
@given(order=topological_orders(), same_group=st.booleans())
def test_every_legal_interleaving_is_accepted_with_a_stable_fingerprint(order, same_group):
    groups = {"GROUP_A": "0", "GROUP_B": "0" if same_group else "1"}
    reference = check_order(_build(list(_CHAINS), groups))  # chain a, then chain b
    summary = check_order(_build(order, groups))

    collectives_in_order = [n for n in order if n.endswith("_ar")]
    same_collective_order = collectives_in_order == ["a_ar", "b_ar"]
    if same_collective_order or not same_group:
        # Per group, the collectives run in the same order: every rank agrees.
        assert summary.per_group == reference.per_group
        assert summary.fingerprint == reference.fingerprint
    else:
        # Swapped within one group: a different SPMD order, and the fingerprint says so.
        assert summary.per_group == {"0": list(reversed(reference.per_group["0"]))}
        assert summary.fingerprint != reference.fingerprint


@settings(max_examples=40, deadline=None)
@given(order=topological_orders(), data=st.data())
def test_moving_a_node_before_an_input_is_rejected(order, data):
    gm = _build(order, {"GROUP_A": "0", "GROUP_B": "0"})
    nodes = {n.name: n for n in gm.graph.nodes}
    victim = data.draw(st.sampled_from(sorted(n for n in _CHAINS if _deps(n))))
    producer = nodes[data.draw(st.sampled_from(sorted(_deps(victim))))]
    producer.prepend(nodes[victim])
    with pytest.raises(hca.CheckError, match=rf"{victim} reads {producer.name} before it is computed"):
        check_order(gm)


# ---------------------------------------------------------------------------
# Coalesced collectives, writes by keyword, writes through views.


def test_accepts_a_coalesced_collective():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    ar = g.call_function(c10d.all_reduce_coalesced.default, ([a, b], "sum", GROUP), name="all_reduce_coalesced")
    parts = [g.call_function(operator.getitem, (ar, i), name=f"getitem_{i}") for i in range(2)]
    waits = [g.call_function(WAIT, (p,), name=f"wait_{i}") for i, p in enumerate(parts)]
    g.output(tuple(waits))
    check_order(module(g))


def test_rejects_an_out_variant_writing_the_input_in_flight():
    g, nodes = one_chain()
    other = next(iter(g.find_nodes(op="placeholder")))
    with g.inserting_before(nodes["wait"]):
        g.call_function(aten.add.out, (other, other), {"out": nodes["compute"]}, name="clobber")
    with pytest.raises(hca.CheckError, match=r"clobber writes relu while all_reduce holds it"):
        check_order(module(g))


def test_rejects_a_write_through_a_view_of_the_input_in_flight():
    g, nodes = one_chain()
    with g.inserting_before(nodes["wait"]):
        view = g.call_function(aten.view.default, (nodes["compute"], [-1]), name="alias")
        g.call_function(aten.add_.Tensor, (view, 1), name="clobber")
    with pytest.raises(hca.CheckError, match=r"clobber writes"):
        check_order(module(g))
