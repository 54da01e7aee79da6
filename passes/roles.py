"""Cotangent-role pass: where each parameter's partial gradient gets summed.

Reads the DTensor program. For every parameter with the eager role, its
reads go through `dtensor_ops.reduce_gradient_eagerly`, whose backward sums a
partial gradient inside the backward graph (DTensor alone would leave it
partial and reduce it later, one parameter at a time, outside the graph).
Parameters with the deferred role are left alone: their gradients stay
partial until `hca.reduce_gradients`.
"""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import Replicate

from torch_hca.compiler import dtensor_ops
from torch_hca._torch_private import graph_arg_example
from torch_hca.compiler.parameters import parameter_name, parameter_role

from .infra import PassContext, PassResult


class CotangentRolePass:
    name = "roles"
    reads = "DTensor program"
    writes = "DTensor program with eager gradient reductions marked on parameter reads"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        decisions = []
        for node in list(gm.graph.find_nodes(op="placeholder")):
            real = graph_arg_example(node)
            role = parameter_role(real) if real is not None else None
            if role is None:
                continue
            name = parameter_name(real)
            ctx.report.parameters.setdefault(name, {})["grad_reduction"] = role
            # Only a mesh dimension a parameter is replicated over can leave its
            # gradient partial (the cotangent of S(d) is S(d)): mark only those.
            replicated = any(isinstance(p, Replicate) for p in real.placements)
            if role != "eager" or not replicated or not node.users:
                decisions.append(
                    f"{name}: {role}" + ("" if replicated else " (sharded on every mesh dimension: never partial)")
                )
                continue
            with gm.graph.inserting_after(node):
                read = gm.graph.call_function(dtensor_ops.reduce_gradient_eagerly, (node,))
            node.replace_all_uses_with(read, delete_user_cb=lambda user: user is not read)
            read.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "hca_layout")})
            decisions.append(f"{name}: eager, read through {read.name}")
        return PassResult(gm, any("eager, read" in d for d in decisions), decisions)
