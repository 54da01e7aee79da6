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
from dataclasses import dataclass

import torch
import torch.fx as fx

from .collective_kinds import OPS, WAIT
from .errors import CheckError


@dataclass(frozen=True)
class ScheduleSummary:
    per_group: dict[str, list[str]]
    fingerprint: str


def _writes(node: fx.Node) -> list[fx.Node]:
    """The graph values an op mutates (from its schema's alias annotations)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    written = []
    for arg, value in zip(target._schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node):
            written.append(value)
    return written


def check_order(gm: fx.GraphModule, what: str = "graph") -> ScheduleSummary:
    seen: set[fx.Node] = set()
    in_flight: dict[fx.Node, fx.Node] = {}  # collective -> its input buffer
    per_group: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if arg not in seen:
                raise CheckError(f"schedule check ({what}): {node.name} reads {arg.name} before it is computed")
            if arg in in_flight and node.target is not WAIT:
                raise CheckError(f"schedule check ({what}): {node.name} reads collective {arg.name} before its wait")
        for buf in _writes(node):
            for coll, leased in in_flight.items():
                if leased is buf:
                    raise CheckError(f"schedule check ({what}): {node.name} writes {buf.name} while {coll.name} holds it")
        if node.op == "call_function" and node.target in OPS:
            info = OPS[node.target]
            in_flight[node] = node.args[0] if isinstance(node.args[0], fx.Node) else None
            val = node.meta.get("val")
            desc = f"{info.kind.value}:{getattr(val, 'dtype', '?')}:{tuple(getattr(val, 'shape', ()))}"
            per_group.setdefault(str(node.args[info.group_arg]), []).append(desc)
        if node.target is WAIT:
            in_flight.pop(node.args[0], None)
        seen.add(node)
    if in_flight:
        names = ", ".join(n.name for n in in_flight)
        raise CheckError(f"schedule check ({what}): collective(s) {names} are never waited on")
    text = "|".join(f"{g}={','.join(seq)}" for g, seq in sorted(per_group.items()))
    return ScheduleSummary(per_group, hashlib.sha256(text.encode()).hexdigest()[:16])
