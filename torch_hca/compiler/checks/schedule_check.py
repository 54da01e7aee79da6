"""An independent checker for the order of a forward or backward graph.

Shares nothing with the scheduler but the graph types. It accepts an order
only if:
  * every node comes after the nodes it reads (dependencies);
  * a collective's result is read only through its `wait_tensor`, and
    nothing writes the collective's input between the start and the wait
    (the collective leases its buffers until it completes);
and returns, per process group, the sequence of collectives every rank must
issue in the same order, with a fingerprint of it.

`check_reorder(before, after)` proves a reordered graph is the same program:
the same nodes, `check_order` on the new order, each group's collectives in the
same order, and every two accesses to one buffer (one a write) in the same order.
Buffers are followed through views, in-place results and waits (a wait hands
back its collective's buffer), by schema alias annotations, never by op name.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from torch_hca.spmd.collective_nodes import OPS, WAIT, node_group
from torch_hca.errors import CheckError


@dataclass(frozen=True)
class ScheduleSummary:
    per_group: dict[str, list[str]]
    fingerprint: str


def _schema(node: fx.Node):
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema
    return None


def _bound(node: fx.Node):
    """(schema argument, value) pairs of an op node, whether passed by position or keyword."""
    schema = _schema(node)
    if schema is None:
        return []
    return [
        (arg, node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
        for i, arg in enumerate(schema.arguments)
    ]


def _writes(node: fx.Node) -> list[fx.Node]:
    """The graph values an op mutates (schema alias annotations), lists included (`_foreach_*_`)."""
    written = []
    for arg, value in _bound(node):
        if arg.alias_info is not None and arg.alias_info.is_write:
            values = value if isinstance(value, (list, tuple)) else [value]
            written.extend(v for v in values if isinstance(v, fx.Node))
    return written


def _aliased_arg(node: fx.Node, ret) -> fx.Node | None:
    """The argument of `node` whose buffer the schema return `ret` shares, if any."""
    info = ret.alias_info
    if info is None:
        return None
    aliased = [(arg, v) for arg, v in _bound(node) if arg.alias_info is not None and isinstance(v, fx.Node)]
    for arg, value in aliased:
        if info.before_set & arg.alias_info.before_set:
            return value
    # A list return (`Tensor(a)[]`: split, unbind) shows Python no alias set: take the one aliased argument.
    return aliased[0][1] if len(aliased) == 1 and not info.before_set else None


def _alias_source(node: fx.Node) -> fx.Node | None:
    """The value whose buffer `node`'s result shares: views, in-place and out= results,
    elements of a list of views, and `wait_tensor` (it hands back the collective's buffer)."""
    if node.op != "call_function":
        return None
    if node.target is WAIT:
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        src, index = node.args[0], node.args[1]
        returns = _schema(src).returns if _schema(src) is not None else []
        if len(returns) == 1:
            return _aliased_arg(src, returns[0])
        return _aliased_arg(src, returns[index]) if isinstance(index, int) and 0 <= index < len(returns) else None
    schema = _schema(node)
    return _aliased_arg(node, schema.returns[0]) if schema is not None and len(schema.returns) == 1 else None


def _inputs(coll: fx.Node) -> list[fx.Node]:
    first = coll.args[0]
    return [first] if isinstance(first, fx.Node) else [a for a in first if isinstance(a, fx.Node)]


def _describe(coll: fx.Node) -> str:
    info = OPS[coll.target]
    vals = coll.meta.get("val")
    vals = vals if isinstance(vals, (list, tuple)) else [vals]
    parts = [f"{getattr(v, 'dtype', '?')}:{tuple(getattr(v, 'shape', ()))}" for v in vals]
    return f"{info.kind.value}:{'+'.join(parts)}"


class _Leases:
    """Collectives in flight: their unwaited results and the buffers they hold."""

    def __init__(self, what: str):
        self.what = what
        self.root: dict[fx.Node, fx.Node] = {}  # view -> the value it aliases
        self.pending: dict[fx.Node, fx.Node] = {}  # unwaited result -> its collective
        self.held: dict[fx.Node, set[fx.Node]] = {}  # collective -> roots of its inputs
        self.split: set[fx.Node] = set()  # coalesced collectives taken apart by getitem
        self.left: dict[fx.Node, int] = {}  # collective -> results still to wait on

    def base(self, n: fx.Node) -> fx.Node:
        return self.root.get(n, n)

    def start(self, coll: fx.Node) -> None:
        self.pending[coll] = coll
        self.held[coll] = {self.base(i) for i in _inputs(coll)}
        # The lease ends at the last wait: count the results taken in the whole graph, so
        # where the getitems sit (all at the start, or each just before its wait) cannot matter.
        parts = sum(u.target is operator.getitem for u in coll.users) if OPS[coll.target].coalesced else 1
        self.left[coll] = max(parts, 1)

    def read(self, node: fx.Node, arg: fx.Node) -> None:
        coll = self.pending.get(arg, arg if arg in self.split else None)
        if coll is None:
            return
        if node.target is WAIT and arg in self.pending:
            del self.pending[arg]
            self.left[coll] -= 1
        elif node.target is operator.getitem and arg is coll and OPS[coll.target].coalesced:
            # A coalesced collective: each result, taken by getitem, is waited on alone.
            self.pending.pop(coll, None)
            self.split.add(coll)
            self.pending[node] = coll
        else:
            raise CheckError(f"schedule check ({self.what}): {node.name} reads collective {coll.name} before its wait")
        if self.left[coll] == 0:
            self.held.pop(coll, None)

    def write(self, node: fx.Node, buf: fx.Node) -> None:
        for coll, roots in self.held.items():
            if self.base(buf) in roots:
                raise CheckError(
                    f"schedule check ({self.what}): {node.name} writes {buf.name} while {coll.name} holds it"
                )


def check_order(gm: fx.GraphModule, what: str = "graph") -> ScheduleSummary:
    seen: set[fx.Node] = set()
    leases = _Leases(what)
    per_group: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if arg not in seen:
                raise CheckError(f"schedule check ({what}): {node.name} reads {arg.name} before it is computed")
            leases.read(node, arg)
        for buf in _writes(node):
            leases.write(node, buf)
        source = _alias_source(node)
        if source is not None:
            leases.root[node] = leases.base(source)
        if node.op == "call_function" and node.target in OPS:
            leases.start(node)
            per_group.setdefault(node_group(node), []).append(_describe(node))
        seen.add(node)
    if leases.pending:
        names = ", ".join(sorted({c.name for c in leases.pending.values()}))
        raise CheckError(f"schedule check ({what}): collective(s) {names} are never waited on")
    text = "|".join(f"{g}={','.join(seq)}" for g, seq in sorted(per_group.items()))
    return ScheduleSummary(per_group, hashlib.sha256(text.encode()).hexdigest()[:16])


# ---------------------------------------------------------------------------
# Reorders: the same events, in an order reachable by swaps of commuting neighbours.


def _shape(node: fx.Node) -> tuple:
    """What a node is, apart from its place: op, target, and arguments with nodes named."""
    named = lambda a: fx.map_arg(a, lambda n: n.name)  # noqa: E731
    return node.op, node.target, named(node.args), named(node.kwargs)


def _same_nodes(before: fx.Graph, after: fx.Graph, what: str) -> None:
    old = {n.name: n for n in before.nodes}
    new = {n.name: n for n in after.nodes}
    missing = [name for name in old if name not in new]
    extra = [name for name in new if name not in old]
    if missing or extra:
        raise CheckError(
            f"schedule check ({what}): the reorder must keep the same nodes; missing {missing[:3]}, added {extra[:3]}"
        )
    for name, node in old.items():
        if _shape(node) != _shape(new[name]):
            raise CheckError(f"schedule check ({what}): node {name} changed: {_shape(node)} became {_shape(new[name])}")
    order = list(new)
    if new[order[-1]].op != "output":
        raise CheckError(f"schedule check ({what}): {order[-1]} runs after the output; the output must stay last")
    places = lambda g: [n.name for n in g.nodes if n.op == "placeholder"]  # noqa: E731
    if places(before) != places(after):
        raise CheckError(
            f"schedule check ({what}): the inputs were reordered "
            f"({places(before)} became {places(after)}); the calling convention must not change"
        )


def _group_sequences(graph: fx.Graph) -> dict[str, list[str]]:
    seqs: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in OPS:
            seqs.setdefault(node_group(node), []).append(node.name)
    return seqs


def _same_group_orders(before: fx.Graph, after: fx.Graph, what: str) -> None:
    old, new = _group_sequences(before), _group_sequences(after)
    for group, seq in old.items():
        for i, (a, b) in enumerate(zip(seq, new[group])):
            if a != b:
                raise CheckError(
                    f"schedule check ({what}): group {group} issues {b} as its collective #{i}, "
                    f"where every rank expects {a}; collectives of one group must keep their order"
                )


def _collective_of(arg) -> fx.Node | None:
    if isinstance(arg, fx.Node) and arg.op == "call_function":
        if arg.target in OPS:
            return arg
        if arg.target is operator.getitem and isinstance(arg.args[0], fx.Node) and arg.args[0].target in OPS:
            return arg.args[0]
    return None


def _accesses(graph: fx.Graph) -> dict[str, tuple[set[str], set[str]]]:
    """Per node name: the buffers it reads and those it writes, each buffer named by its root
    (the value every view, in-place result and wait of it aliases). A wait reads its
    collective's inputs (their lease ends there) and writes its result (complete only there)."""
    root: dict[fx.Node, fx.Node] = {}
    base = lambda n: root.get(n, n)  # noqa: E731
    out: dict[str, tuple[set[str], set[str]]] = {}
    for node in graph.nodes:
        reads = {base(a).name for a in node.all_input_nodes}
        writes = {base(b).name for b in _writes(node)}
        coll = _collective_of(node.args[0]) if node.target is WAIT else None
        if coll is not None:
            reads |= {base(i).name for i in _inputs(coll)}
            writes.add(base(node.args[0]).name)
        source = _alias_source(node)
        if source is not None:
            root[node] = base(source)
        out[node.name] = (reads - writes, writes)
    return out


def _conflicts_kept(before: fx.Graph, after: fx.Graph, what: str) -> None:
    """Two accesses to one buffer, at least one a write, must keep their order."""
    pos = {n.name: i for i, n in enumerate(after.nodes)}
    access = _accesses(before)
    written = set().union(*(w for _, w in access.values()))
    history: dict[str, list[tuple[str, bool]]] = {}  # buffer -> its accesses, in `before` order
    for name, (reads, writes) in access.items():
        for buf in sorted(writes):
            history.setdefault(buf, []).append((name, True))
        for buf in sorted(reads & written):
            history.setdefault(buf, []).append((name, False))
    for buf, seq in history.items():
        last_write, readers = None, []
        for name, is_write in seq:
            earlier = ([last_write] if last_write else []) + (readers if is_write else [])
            for prev in earlier:
                if pos[prev] > pos[name]:
                    verb = "writes" if is_write else "reads"
                    raise CheckError(
                        f"schedule check ({what}): {name} now runs before {prev}, but {name} {verb} "
                        f"{buf} which {prev} {'writes' if prev == last_write else 'reads'}; "
                        f"accesses that conflict must keep their order"
                    )
            if is_write:
                last_write, readers = name, []
            else:
                readers.append(name)


def check_reorder(before: fx.GraphModule, after: fx.GraphModule, what: str = "graph") -> ScheduleSummary:
    """Accept `after` only if it is `before` with its events reordered by swaps of commuting neighbours.

        before:  a ─ ar₀(g) ─ b ─ wait₀ ─ ar₁(g) ─ c ─ wait₁        (g: one process group)
        after:   ar₀(g) ─ a ─ b ─ ar₁(g) ─ wait₀ ─ c ─ wait₁        ok: same nodes, deps and leases
                                                                       hold, g still issues ar₀, ar₁

    Checks: the same nodes (by name, with the same target and arguments), inputs in the
    same order and the output last; `check_order(after)` (dependencies and leases);
    per process group, the same sequence of collectives; and every pair of accesses to one
    buffer (views and in-place results included), one of them a write, in the same order.
    Returns `check_order(after)`'s summary; raises `CheckError` naming the first offender.
    """
    _same_nodes(before.graph, after.graph, what)
    check_order(before, f"{what}, before reordering")
    summary = check_order(after, what)
    _same_group_orders(before.graph, after.graph, what)
    _conflicts_kept(before.graph, after.graph, what)
    return summary
