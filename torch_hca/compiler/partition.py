"""What AOTAutograd's partition leaves in the backward that nobody reads: forward collectives.

The partition builds the backward by copying every node of the joint graph whose inputs the
backward holds (the saved values and the cotangents), then drops what no gradient needs, except
collectives, which it keeps as side effects. So a forward collective whose input the backward
can compute from saved values runs a second time in every backward, with the ops before it,
its result unread: on the zoo's Llama under the 2-D plan at 4 ranks, each layer's q, k and v
projections and their all_gathers over tp. Every rank's backward is the same graph, so every
rank removes the same collectives and the ranks' issue orders stay equal.
"""

from __future__ import annotations

import torch.fx as fx

from torch_hca.spmd.collective_nodes import OPS, WAIT


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in OPS or node.target is WAIT)


def without_unread_collectives(backward: fx.GraphModule) -> list[str]:
    """Remove from `backward` what no gradient reads: FX's dead code, then each collective (and
    wait) whose result nobody reads, then what only fed them; the names of the collectives and
    waits removed. (FX keeps a wait as a side effect, and AOTAutograd's own clean-up keeps every
    op that is not a collective.)"""
    before = [n.name for n in backward.graph.nodes if is_collective(n)]
    backward.graph.eliminate_dead_code()
    while unread := [n for n in backward.graph.nodes if is_collective(n) and not n.users]:
        for node in reversed(unread):
            backward.graph.erase_node(node)
        backward.graph.eliminate_dead_code()
    backward.recompile()
    left = {n.name for n in backward.graph.nodes}
    return [name for name in before if name not in left]
