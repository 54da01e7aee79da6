"""An independent checker for the order of a forward or backward graph.

Shares nothing with the scheduler but the graph types. It accepts an order
only if:
  * every node comes after the nodes it reads (dependencies);
  * a collective's result is read only through its `wait_tensor`, and
    nothing writes the collective's input between the start and the wait
    (the collective leases its buffers until it completes);
and returns, per process group, the sequence of collectives every rank must
issue in the same order, with a fingerprint of it.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .collective_kinds import OPS, WAIT
from .errors import CheckError


@dataclass(frozen=True)
class ScheduleSummary:
    per_group: dict[str, list[str]]
    fingerprint: str


def _schema(node: fx.Node):
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema
    return None


def _writes(node: fx.Node) -> list[fx.Node]:
    """The graph values an op mutates (schema alias annotations; positional or keyword)."""
    schema = _schema(node)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
            written.append(value)
    return written


def _is_view(node: fx.Node) -> bool:
    schema = _schema(node)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


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
        self.root: dict[fx.Node, fx.Node] = {}        # view -> the value it aliases
        self.pending: dict[fx.Node, fx.Node] = {}     # unwaited result -> its collective
        self.held: dict[fx.Node, set[fx.Node]] = {}   # collective -> roots of its inputs
        self.split: set[fx.Node] = set()              # coalesced collectives taken apart by getitem

    def base(self, n: fx.Node) -> fx.Node:
        return self.root.get(n, n)

    def start(self, coll: fx.Node) -> None:
        self.pending[coll] = coll
        self.held[coll] = {self.base(i) for i in _inputs(coll)}

    def read(self, node: fx.Node, arg: fx.Node) -> None:
        coll = self.pending.get(arg, arg if arg in self.split else None)
        if coll is None:
            return
        if node.target is WAIT and arg in self.pending:
            del self.pending[arg]
        elif node.target is operator.getitem and arg is coll and OPS[coll.target].coalesced:
            # A coalesced collective: each result, taken by getitem, is waited on alone.
            self.pending.pop(coll, None)
            self.split.add(coll)
            self.pending[node] = coll
        else:
            raise CheckError(f"schedule check ({self.what}): {node.name} reads collective {coll.name} before its wait")
        if coll not in self.pending.values():
            self.held.pop(coll, None)

    def write(self, node: fx.Node, buf: fx.Node) -> None:
        for coll, roots in self.held.items():
            if self.base(buf) in roots:
                raise CheckError(f"schedule check ({self.what}): {node.name} writes {buf.name} while {coll.name} holds it")


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
        if _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            leases.root[node] = leases.base(node.args[0])
        if node.op == "call_function" and node.target in OPS:
            leases.start(node)
            per_group.setdefault(str(node.args[OPS[node.target].group_arg]), []).append(_describe(node))
        seen.add(node)
    if leases.pending:
        names = ", ".join(sorted({c.name for c in leases.pending.values()}))
        raise CheckError(f"schedule check ({what}): collective(s) {names} are never waited on")
    text = "|".join(f"{g}={','.join(seq)}" for g, seq in sorted(per_group.items()))
    return ScheduleSummary(per_group, hashlib.sha256(text.encode()).hexdigest()[:16])
