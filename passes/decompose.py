"""Decompose pass: replace ops DTensor cannot shard by equivalents it can.

A table of rewrites keyed by the function object in the Dynamo graph; each
applies only when the op sees a DTensor.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from torch_hca import dtensor_ops

from .infra import PassContext, PassResult

# Dynamo graph target -> replacement with the same signature.
REWRITES = {
    torch._C._nn.scaled_dot_product_attention: dtensor_ops.attention,
}


def _sees_dtensor(node: fx.Node) -> bool:
    return any(isinstance(a.meta.get("example_value"), DTensor) for a in node.all_input_nodes)


class DecomposePass:
    name = "decompose"
    reads = "Dynamo graph over DTensors"
    writes = "Dynamo graph over DTensors, every op one DTensor can shard"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        decisions = []
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in REWRITES and _sees_dtensor(node):
                old, node.target = node.target, REWRITES[node.target]
                decisions.append(f"{node.name}: {old.__name__} -> {node.target.__module__}.{node.target.__name__}")
        return PassResult(gm, bool(decisions), decisions)
