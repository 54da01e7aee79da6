"""The event model the schedule pass reads a graph with (docs/theory.md, section 6).

An event is one node. A *start* is a `_c10d_functional` collective: it
leases its input buffers until its *waits* (one `wait_tensor`, or one per
result of a coalesced collective). *Late* nodes are those that only finish
a collective's result: the waits, the getitems that take a coalesced result
apart, and every op all of whose inputs are late and that writes nothing and draws no random numbers (views, the copies out
of a bucket, a chunk of a reduced gradient); they can run just before their
first consumer. Everything else is compute, which keeps its traced order.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torch_hca.spmd.collective_nodes import OPS, WAIT
from torch_hca.spmd.op_families import is_view_op


def is_start(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in OPS


def is_view(node: fx.Node) -> bool:
    """A node whose result is a view of its first argument (or an element of a list of views)."""
    if node.op != "call_function":
        return False
    return node.target is operator.getitem or is_view_op(node.target)


def written(node: fx.Node) -> list[fx.Node]:
    """The graph values an op writes in place (schema alias annotations)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write:
            out += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
    return out


def waits_of(start: fx.Node) -> list[fx.Node]:
    """The waits that end a collective's lease (a coalesced one: one per result)."""
    users = list(start.users)
    if OPS[start.target].coalesced:
        users = [w for u in users if u.target is operator.getitem for w in u.users]
    return [u for u in users if u.target is WAIT]


def _movable(node: fx.Node) -> bool:
    """Pure enough to run later: writes nothing, draws no random numbers."""
    tags = getattr(node.target, "tags", ())
    return not written(node) and torch.Tag.nondeterministic_seeded not in tags


def late_nodes(nodes: list[fx.Node]) -> dict[fx.Node, None]:
    """The late nodes of `nodes` (in graph order), as an ordered set."""
    late: dict[fx.Node, None] = {}
    for n in nodes:
        if n.op != "call_function" or is_start(n) or not _movable(n):
            continue
        inputs = n.all_input_nodes
        coalesced_part = n.target is operator.getitem and bool(inputs) and is_start(inputs[0])
        if n.target is WAIT or coalesced_part or (inputs and all(i in late for i in inputs)):
            late[n] = None
    return late
