"""The strategy file's `issued`: what the compiled forward and backward issue, in program order.

Each issued collective (a bucket is one) with its members and where it starts and is last waited
on in its graph (indices of its nodes after the inputs), so that a reader can replay the bytes in flight at each start
against the schedule's `in_flight_bytes` bound (the verifier's rule `in flight`).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from torch_hca.spmd.collective_nodes import WAIT


def _last_wait(node: fx.Node, index: dict[fx.Node, int]) -> int | None:
    """The index of the last wait on `node`'s result (through a getitem of a tuple result)."""
    found, stack = [], list(node.users)
    while stack:
        u = stack.pop()
        if u.op == "call_function" and u.target is WAIT:
            found.append(index[u])
        elif u.op == "call_function" and getattr(u.target, "__name__", "") == "getitem":
            stack.extend(u.users)
    return max(found) if found else None


def issued_collectives(g: Any, facts: dict, bucket_tag: str) -> list[dict]:
    """The collectives the compiled forward and backward issue, in program order: a bucket is one."""
    nodes, index = {}, {}
    for which in ("forward", "backward"):
        gm = getattr(g, which)
        if gm is not None:
            nodes[which] = {n.name: n for n in gm.graph.nodes}
            # Counted after the inputs: ranks cut by shares differ in their size inputs, not their program.
            index[which] = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op != "placeholder")}
    out = []
    for c in g.collectives:
        node = nodes.get(c.direction, {}).get(c.node)
        members = list(node.meta.get(bucket_tag) or []) if node is not None else []
        out.append(
            {
                "id": f"{c.direction}:{c.node}",
                "direction": c.direction,
                "kind": c.kind,
                "group": c.group,
                "mesh_dim": facts.get("groups", {}).get(c.group),
                "bytes": c.bytes,
                "wire_bytes": c.wire_bytes,
                "members": [f"{c.direction}:{m}" for m in members] or [f"{c.direction}:{c.node}"],
                "start": index[c.direction][node] if node is not None else None,
                "last_wait": _last_wait(node, index[c.direction]) if node is not None else None,
            }
        )
    return out
