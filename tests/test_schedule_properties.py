"""Schedule equivalence, property-tested: `torch_hca.compiler.checks.schedule_check.check_reorder`.

A strategy draws random programs as FX graphs (compute, views, in-place writes,
async collectives on one or two process groups, each with its wait) and keeps,
beside the graph, its own model of every node: what it reads directly, the
buffers it reads and writes, and the group a collective runs on. From that model
alone (never from the checker, never from the scheduler) the tests decide which
neighbours commute, and check:

* every order reached by swaps of commuting neighbours is accepted, with the
  same per-group summary and fingerprint as the original;
* reversing one constraint (a dependency, a lease, the order of two collectives
  of one group, two conflicting accesses to a buffer) is rejected, by a message
  naming the node moved.

The graphs are never run: the checker only reads them.
"""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.fx as fx
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

import torch_hca as hca
from torch_hca.compiler.checks.schedule_check import check_order, check_reorder

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
COALESCED = c10d.all_reduce_coalesced.default

COMPUTE = {aten.relu.default: 1, aten.add.Tensor: 2, aten.mul.Tensor: 2, aten.mm.default: 2}
VIEWS = [aten.t.default, aten.alias.default]
IN_PLACE = [aten.add_.Tensor, aten.mul_.Tensor]  # write their first argument, return it
# collective -> its arguments after the input, the group name last
COLLECTIVES = {
    c10d.all_reduce.default: lambda group: ("sum", group),
    c10d.all_gather_into_tensor.default: lambda group: (2, group),
    c10d.reduce_scatter_tensor.default: lambda group: ("sum", 2, group),
}
STEPS = ["compute"] * 3 + ["view", "split", "write", "write", "foreach", "collective", "collective", "wait", "wait"]


def _val():
    return torch.empty(4, 4)


# ---------------------------------------------------------------------------
# Random programs, with the test's own model of each node


@dataclass
class Program:
    gm: fx.GraphModule
    body: list[str]  # nodes that may move, in program order
    deps: dict[str, set[str]] = field(default_factory=dict)  # node -> the nodes it takes as arguments
    reads: dict[str, set[str]] = field(default_factory=dict)  # node -> buffers read (by root name)
    writes: dict[str, set[str]] = field(default_factory=dict)  # node -> buffers written
    lease: dict[str, set[str]] = field(default_factory=dict)  # collective or wait -> buffers it holds
    group: dict[str, str] = field(default_factory=dict)  # collective -> its process group
    waits_on: dict[str, str] = field(default_factory=dict)  # wait -> the collective result it completes


class _Builder:
    """Emits nodes into a graph, tracking buffers (roots), leases and what may be read now."""

    def __init__(self, n_inputs: int):
        self.graph = fx.Graph()
        self.root: dict[fx.Node, fx.Node] = {}
        self.model = Program(None, [])
        self.readable: list[fx.Node] = []  # tensors a new node may take
        self.in_flight: dict[fx.Node, set[str]] = {}  # collective -> roots of its inputs
        self.unwaited: list[tuple[fx.Node, fx.Node]] = []  # (result to wait on, its collective)
        self.parts_left: dict[fx.Node, int] = {}
        for i in range(n_inputs):
            x = self.graph.placeholder(f"x{i}")
            x.meta["val"] = _val()
            self.root[x] = x
            self.readable.append(x)

    def emit(self, target, args, *, alias_of=None, writes=(), holds=(), readable=True, val=None):
        node = self.graph.call_function(target, args)
        node.meta["val"] = _val() if val is None else val
        name, m = node.name, self.model
        self.root[node] = self.root[alias_of] if alias_of is not None else node
        m.body.append(name)
        m.deps[name] = {a.name for a in node.all_input_nodes}
        m.writes[name] = {self.root[w].name for w in writes}
        m.reads[name] = ({self.root[a].name for a in node.all_input_nodes} | set(holds)) - m.writes[name]
        if holds:
            m.lease[name] = set(holds)
        if readable:
            self.readable.append(node)
        return node

    def writable(self) -> list[fx.Node]:
        held = set().union(*self.in_flight.values())
        return [v for v in self.readable if self.root[v].name not in held]

    def start(self, target, inputs: list[fx.Node], extra: tuple, group: str) -> None:
        holds = {self.root[i].name for i in inputs}
        first = inputs if target is COALESCED else inputs[0]
        val = [_val() for _ in inputs] if target is COALESCED else None
        coll = self.emit(target, (first, *extra), holds=holds, readable=False, val=val)
        self.model.group[coll.name] = group
        self.in_flight[coll] = holds
        parts = (
            [self.emit(operator.getitem, (coll, i), readable=False) for i in range(len(inputs))]
            if target is COALESCED
            else [coll]
        )
        self.parts_left[coll] = len(parts)
        self.unwaited += [(p, coll) for p in parts]

    def wait(self, index: int) -> None:
        result, coll = self.unwaited.pop(index)
        # A wait completes (writes) its result, which it hands back, and ends the lease.
        w = self.emit(WAIT, (result,), alias_of=result, writes=(result,), holds=self.in_flight[coll])
        self.model.waits_on[w.name] = result.name
        self.readable.append(result)  # read directly after its wait: legal
        self.parts_left[coll] -= 1
        if self.parts_left[coll] == 0:
            del self.in_flight[coll]

    def finish(self) -> Program:
        while self.unwaited:
            self.wait(0)
        outs = [v for v in self.readable if not v.users and v.op != "placeholder"] or self.readable[-1:]
        self.graph.output(tuple(outs))
        self.model.gm = fx.GraphModule(torch.nn.Module(), self.graph)
        return self.model


@st.composite
def programs(draw) -> Program:
    b = _Builder(draw(st.integers(2, 4)))
    groups = ["g0", "g1"][: draw(st.integers(1, 2))]
    pick = lambda values: draw(st.sampled_from(values))  # noqa: E731
    for _ in range(draw(st.integers(4, 24))):
        step = pick(STEPS)
        if step == "compute":
            op = pick(list(COMPUTE))
            b.emit(op, tuple(pick(b.readable) for _ in range(COMPUTE[op])))
        elif step == "view":
            src = pick(b.readable)
            b.emit(pick(VIEWS), (src,), alias_of=src)
        elif step == "split":
            src = pick(b.readable)
            pieces = b.emit(aten.split.Tensor, (src, 2), alias_of=src, readable=False, val=[_val(), _val()])
            b.emit(operator.getitem, (pieces, pick([0, 1])), alias_of=src)
        elif step == "write" and b.writable():
            buf = pick(b.writable())
            b.emit(pick(IN_PLACE), (buf, pick(b.readable)), alias_of=buf, writes=(buf,))
        elif step == "foreach" and b.writable():
            bufs = [pick(b.writable()), pick(b.writable())]
            b.emit(aten._foreach_add_.Scalar, (bufs, 1.0), writes=bufs, readable=False, val=[])
        elif step == "collective":
            group = pick(groups)
            if draw(st.integers(0, 3)) == 0:
                b.start(COALESCED, [pick(b.readable), pick(b.readable)], ("sum", group), group)
            else:
                op = pick(list(COLLECTIVES))
                b.start(op, [pick(b.readable)], COLLECTIVES[op](group), group)
        elif step == "wait" and b.unwaited:
            b.wait(draw(st.integers(0, len(b.unwaited) - 1)))
    return b.finish()


# ---------------------------------------------------------------------------
# The test's own commutation rule, and orders built from it


def commute(p: Program, a: str, b: str) -> bool:
    """Adjacent events a, b may swap: neither takes the other, no buffer conflict, not one group's collectives."""
    if a in p.deps[b] or b in p.deps[a]:
        return False
    if p.writes[a] & (p.reads[b] | p.writes[b]) or p.writes[b] & p.reads[a]:
        return False
    return not (a in p.group and b in p.group and p.group[a] == p.group[b])


def kind(p: Program, a: str, b: str) -> str:
    """Why a (earlier) and b may not swap."""
    if a in p.deps[b]:
        return "dependency"
    if a in p.waits_on and p.waits_on[a] in p.deps[b]:
        return "lease-read"  # b reads the result a completes
    if p.writes[b] & p.lease.get(a, set()) or p.writes[a] & p.lease.get(b, set()):
        return "lease-write"
    if a in p.group and b in p.group:
        return "group"
    return "conflict"


def constraints(p: Program) -> dict[tuple[str, str], str]:
    return {(a, b): kind(p, a, b) for i, a in enumerate(p.body) for b in p.body[i + 1 :] if not commute(p, a, b)}


def implied(edges, a: str, b: str) -> bool:
    """Is b reachable from a by a path of two or more constraints?"""
    after: dict[str, list[str]] = {}
    for x, y in edges:
        after.setdefault(x, []).append(y)
    stack, seen = [y for y in after.get(a, []) if y != b], set()
    while stack:
        x = stack.pop()
        if x == b:
            return True
        if x not in seen:
            seen.add(x)
            stack += after.get(x, [])
    return False


def linear_extension(body: list[str], edges, rnd: random.Random) -> list[str]:
    """A random order of `body` that keeps every edge (Kahn, choosing at random among the ready)."""
    indegree = {n: 0 for n in body}
    after: dict[str, list[str]] = {}
    for x, y in edges:
        indegree[y] += 1
        after.setdefault(x, []).append(y)
    ready, order = [n for n in body if indegree[n] == 0], []
    while ready:
        n = ready.pop(rnd.randrange(len(ready)))
        order.append(n)
        for y in after.get(n, []):
            indegree[y] -= 1
            if indegree[y] == 0:
                ready.append(y)
    assert len(order) == len(body), "constraints have a cycle"
    return order


def swap_walk(p: Program, rnd: random.Random, steps: int) -> list[str]:
    order = list(p.body)
    for _ in range(steps if len(order) > 1 else 0):
        i = rnd.randrange(len(order) - 1)
        if commute(p, order[i], order[i + 1]):
            order[i], order[i + 1] = order[i + 1], order[i]
    return order


def _ends(gm: fx.GraphModule) -> tuple[list[fx.Node], fx.Node]:
    return list(gm.graph.find_nodes(op="placeholder")), gm.graph.output_node()


def rebuilt(p: Program, order: list[str]) -> fx.GraphModule:
    """A new graph with the program's nodes copied (`node_copy`) in `order`: it must read nothing undefined."""
    g, env = fx.Graph(), {}
    nodes = {n.name: n for n in p.gm.graph.nodes}
    inputs, output = _ends(p.gm)
    for node in [*inputs, *(nodes[n] for n in order), output]:
        env[node] = g.node_copy(node, lambda n: env[n])
    return fx.GraphModule(torch.nn.Module(), g)


def moved(p: Program, order: list[str]) -> fx.GraphModule:
    """A copy of the program with its nodes moved in place into `order`, legal or not."""
    gm = rebuilt(p, p.body)
    nodes = {n.name: n for n in gm.graph.nodes}
    output = gm.graph.output_node()
    for name in order:
        output.prepend(nodes[name])
    return gm


# ---------------------------------------------------------------------------
# Properties


def test_the_strategy_draws_the_events_the_properties_need():
    """Guard against a strategy that quietly stops drawing conflicts, leases or shared groups."""
    found: set[str] = set()

    @settings(max_examples=60, deadline=None, database=None)
    @given(programs())
    def collect(p):
        found.update(kind for (a, b), kind in constraints(p).items() if not implied(constraints(p), a, b))

    collect()
    assert found == {"dependency", "lease-read", "lease-write", "group", "conflict"}


@settings(max_examples=80, deadline=None)
@given(p=programs(), rnd=st.randoms(use_true_random=False), steps=st.integers(0, 400))
def test_every_order_reached_by_commuting_swaps_is_accepted(p, rnd, steps):
    reference = check_order(p.gm)
    order = swap_walk(p, rnd, steps)
    note(f"order: {order}")
    summary = check_reorder(p.gm, rebuilt(p, order), "property")
    assert summary.per_group == reference.per_group
    assert summary.fingerprint == reference.fingerprint


@settings(max_examples=60, deadline=None)
@given(p=programs(), rnd=st.randoms(use_true_random=False))
def test_every_order_that_keeps_the_constraints_is_accepted(p, rnd):
    """The same set of orders, sampled far from the original (a random topological sort)."""
    order = linear_extension(p.body, constraints(p), rnd)
    note(f"order: {order}")
    assert check_reorder(p.gm, rebuilt(p, order)).fingerprint == check_order(p.gm).fingerprint


@settings(max_examples=100, deadline=None)
@given(
    p=programs(),
    rnd=st.randoms(use_true_random=False),
    broken=st.sampled_from(["dependency", "lease-read", "lease-write", "group", "conflict"]),
)
def test_reversing_one_constraint_is_rejected(p, rnd, broken):
    """Keep every constraint but one, which is reversed: b (the later) runs before a."""
    edges = constraints(p)
    candidates = sorted(e for e, why in edges.items() if why == broken and not implied(edges, *e))
    assume(candidates)
    a, b = rnd.choice(candidates)
    order = linear_extension(p.body, (set(edges) - {(a, b)}) | {(b, a)}, rnd)
    note(f"{broken}: {b} moved before {a}; order {order}")
    # b reading a wait's result early also reads the collective's buffer before that wait: the
    # checker may name either.
    read_early = (
        rf"{b} reads ({a} before it is computed|collective \S+ before its wait)"
        if a in p.waits_on
        else rf"{b} reads {a} before it is computed"
    )
    message = {
        "dependency": read_early,
        "lease-read": rf"{b} reads collective \S+ before its wait",
        # The write lands inside the lease: whichever of the two moved, the write is named.
        "lease-write": rf"{b if p.writes[b] & p.lease.get(a, set()) else a} writes \S+ while \S+ holds it",
        "group": rf"issues {b} as its collective #\d+, where every rank expects {a}",
        "conflict": rf"{b} now runs before {a}",
    }[broken]
    with pytest.raises(hca.CheckError, match=message):
        check_reorder(p.gm, moved(p, order), "property")


# ---------------------------------------------------------------------------
# check_reorder's other conditions, and the aliasing cases found while writing the above


def _program(build) -> fx.GraphModule:
    g = fx.Graph()
    build(g)
    return fx.GraphModule(torch.nn.Module(), g)


def _chain(g: fx.Graph):
    x = g.placeholder("x")
    y = g.placeholder("y")
    r = g.call_function(aten.relu.default, (x,), name="r")
    ar = g.call_function(c10d.all_reduce.default, (r, "sum", "g0"), name="ar")
    w = g.call_function(WAIT, (ar,), name="w")
    g.output((g.call_function(aten.mul.Tensor, (w, y), name="m"),))


def test_rejects_a_changed_or_missing_node():
    before = _program(_chain)
    after = _program(_chain)
    next(iter(after.graph.find_nodes(op="call_function", target=aten.mul.Tensor))).args = (
        after.graph.find_nodes(op="placeholder")[0],
        after.graph.find_nodes(op="placeholder")[1],
    )
    with pytest.raises(hca.CheckError, match=r"node m changed"):
        check_reorder(before, after)
    after = _program(_chain)
    with after.graph.inserting_before(after.graph.output_node()):
        after.graph.call_function(aten.relu.default, (after.graph.find_nodes(op="placeholder")[0],), name="extra")
    with pytest.raises(hca.CheckError, match=r"added \['extra'\]"):
        check_reorder(before, after)


def test_rejects_reordered_inputs():
    before = _program(_chain)
    after = _program(_chain)
    x, y = after.graph.find_nodes(op="placeholder")
    x.prepend(y)
    with pytest.raises(hca.CheckError, match=r"inputs were reordered"):
        check_reorder(before, after)


def test_rejects_a_write_moved_before_a_read_of_the_old_value():
    """No edge in the graph orders `relu(x)` and `x.add_(1)`: only the buffer model does."""

    def build(g):
        x = g.placeholder("x")
        r = g.call_function(aten.relu.default, (x,), name="r")
        g.call_function(aten.add_.Tensor, (x, 1), name="bump")
        g.output((r,))

    before, after = _program(build), _program(build)
    r, bump = (n for n in after.graph.nodes if n.op == "call_function")
    r.prepend(bump)
    check_order(after)  # each order alone is fine...
    with pytest.raises(hca.CheckError, match=r"bump now runs before r, but bump writes x which r reads"):
        check_reorder(before, after)  # ...but it is not the same program


def _split_piece(g, x):
    return g.call_function(operator.getitem, (g.call_function(aten.split.Tensor, (x, 2)), 1))


@pytest.mark.parametrize(
    "alias, clobber",
    [
        # the result of an in-place op is its argument's buffer
        (lambda g, x: g.call_function(aten.neg_.default, (x,)), lambda v: (aten.mul_.Tensor, (v, 2))),
        # an element of a list of views (split) is a view
        (_split_piece, lambda v: (aten.add_.Tensor, (v, 1))),
        # a foreach op writes every tensor of its list
        (lambda g, x: x, lambda v: (aten._foreach_add_.Scalar, ([v], 1.0))),
    ],
    ids=["in-place result", "split element", "foreach list"],
)
def test_rejects_writes_through_aliases_while_in_flight(alias, clobber):
    def build(g):
        x = g.placeholder("x")
        v = alias(g, x)  # made before the collective starts
        ar = g.call_function(c10d.all_reduce.default, (x, "sum", "g0"), name="ar")
        g.call_function(*clobber(v), name="clobber")
        g.output((g.call_function(WAIT, (ar,), name="w"),))

    with pytest.raises(hca.CheckError, match=r"clobber writes \S+ while ar holds it"):
        check_order(_program(build))


def test_a_wait_hands_back_the_collective_buffer():
    """Writing ar1's wait clobbers ar1's buffer, which ar2 (reading ar1 after its wait) holds."""

    def build(g):
        x = g.placeholder("x")
        ar1 = g.call_function(c10d.all_reduce.default, (x, "sum", "g0"), name="ar1")
        w1 = g.call_function(WAIT, (ar1,), name="w1")
        ar2 = g.call_function(c10d.all_reduce.default, (ar1, "sum", "g0"), name="ar2")
        g.call_function(aten.add_.Tensor, (w1, 1), name="clobber")
        g.output((g.call_function(WAIT, (ar2,), name="w2"),))

    with pytest.raises(hca.CheckError, match=r"clobber writes w1 while ar2 holds it"):
        check_order(_program(build))


def test_a_coalesced_lease_lasts_to_its_last_wait_wherever_the_getitems_are():
    def build(g):
        a, b = g.placeholder("a"), g.placeholder("b")
        c = g.call_function(COALESCED, ([a, b], "sum", "g0"), name="c")
        w0 = g.call_function(WAIT, (g.call_function(operator.getitem, (c, 0)),))
        g.call_function(aten.add_.Tensor, (b, 1), name="clobber")  # before part 1 is even taken
        w1 = g.call_function(WAIT, (g.call_function(operator.getitem, (c, 1)),))
        g.output((w0, w1))

    with pytest.raises(hca.CheckError, match=r"clobber writes b while c holds it"):
        check_order(_program(build))
