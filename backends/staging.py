"""Staged collectives in an emitted graph: each `_c10d_functional` collective becomes the
`hca::staged_*` op of `torch_hca.runtime.staging` (through the host buffers, on gloo) and its
`wait_tensor` goes, the staged op being synchronous.

The emitters run it last, on their own copy of the graph: the report keeps the collectives the
passes placed, with their bytes (a staged collective moves the same bytes on the wire).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_hca.errors import UnsupportedError
from torch_hca.runtime import staging  # noqa: F401  (registers the hca::staged_* ops)

c10d = torch.ops._c10d_functional
hca = torch.ops.hca

# Each collective and its staged op, which takes the same arguments.
STAGED = {
    c10d.all_reduce.default: hca.staged_all_reduce.default,
    c10d.all_gather_into_tensor.default: hca.staged_all_gather.default,
    c10d.reduce_scatter_tensor.default: hca.staged_reduce_scatter.default,
    c10d.broadcast.default: hca.staged_broadcast.default,
    c10d.all_to_all_single.default: hca.staged_all_to_all.default,
}
_WAIT = c10d.wait_tensor.default


def stage_collectives(gm: fx.GraphModule) -> int:
    """Rewrite `gm`'s collectives to staged ones, in place (the caller recompiles); how many.
    A collective with no staged form (a coalesced one, an in-place all_reduce) is an
    `UnsupportedError` naming the node: it would otherwise run on a device gloo cannot reach."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not str(node.target).startswith("_c10d_functional."):
            continue
        if node.target is _WAIT:
            continue
        staged = STAGED.get(node.target)
        if staged is None:
            raise UnsupportedError(
                f"staging: node {node.name} ({node.target}) has no staged form; staged are "
                f"{sorted(str(op) for op in STAGED)}. Run this job without staging (options staging='off') "
                "on ranks of one device type"
            )
        node.target = staged  # same arguments; the group is a name by the ops' schema
        for wait in [u for u in node.users if u.target is _WAIT]:
            wait.replace_all_uses_with(node)
            gm.graph.erase_node(wait)
        count += 1
    return count
