"""Cotangent-role pass: where each parameter's partial gradient gets summed.

Reads the DTensor program. For every parameter with the eager role, its
reads go through `dtensor_ops.reduce_gradient_eagerly`, whose backward sums a
partial gradient inside the backward graph (DTensor alone would leave it
partial and reduce it later, one parameter at a time, outside the graph).
Parameters with the deferred role are left alone: their gradients stay
partial until `hca.reduce_gradients`.

Activations have a role too. A replicated value read by a column-parallel matmul (its other
operand split by output features, so the result is split where the value is whole) gets a
partial cotangent from that read. Left to DTensor, the partial cotangent flows on through the
backward of the ops that made the value (a norm, the residual stream) until some op needs it
whole; a row-parallel weight's gradient there gathers its saved input and multiplies the whole
of it on every rank (Llama's o_proj under Megatron storage: an all_gather a block and twice the
work). So such a value is read through `dtensor_ops.reduce_cotangent`, whose backward sums the
cotangent once, where Megatron's "f" operator does.
"""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch_hca.compiler import dtensor_ops
from torch_hca._torch_private import graph_arg_example
from torch_hca.compiler.parameters import parameter_name, parameter_role
from torch_hca.spmd.op_families import TORCH_MATMULS

from .infra import PassContext, PassResult


class CotangentRolePass:
    name = "roles"
    reads = "DTensor program"
    writes = "DTensor program with eager gradient reductions marked on parameter reads and column-parallel inputs"

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
        marked = _mark_column_parallel_inputs(gm)
        decisions += [f"{name}: its cotangent summed at its column-parallel reads" for name in marked]
        return PassResult(gm, bool(marked) or any("eager, read" in d for d in decisions), decisions)


def _mark_column_parallel_inputs(gm: fx.GraphModule) -> list[str]:
    """Read every activation `column_parallel_inputs` finds through `reduce_cotangent`; their names."""
    marked = []
    for node, dims in _column_parallel_inputs(gm).items():
        with gm.graph.inserting_after(node):
            read = gm.graph.call_function(dtensor_ops.reduce_cotangent, (node, dims))
        node.replace_all_uses_with(read, delete_user_cb=lambda user: user is not read)
        read.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "hca_layout")})
        marked.append(node.name)
    return marked


def _column_parallel_inputs(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, ...]]:
    """Computed floating values that need a gradient, read as a matmul's first operand (the
    activation: ``linear(x, w)``, ``x @ w``) replicated on a mesh dim over which the matmul writes
    its result split by its last dim (the other operand split by columns): their cotangent from
    that read is partial there. A parameter's read (a gathered weight) is not one: its partial
    gradient is the roles' above, or the transpose of its gather. Each with those mesh dims."""
    found: dict[fx.Node, tuple[int, ...]] = {}
    for node in gm.graph.nodes:
        first = TORCH_MATMULS.get(node.target) if node.op in ("call_function", "call_method") else None
        out = node.meta.get("example_value")
        if first is None or len(node.args) <= first or not isinstance(out, DTensor) or not out.ndim:
            continue
        arg, x = node.args[first], None
        if isinstance(arg, fx.Node) and arg.op == "call_function" and not _reads_a_parameter(arg):
            x = arg.meta.get("example_value")
        if not isinstance(x, DTensor) or not x.requires_grad or not x.is_floating_point():
            continue
        by_columns = [d for d, p in enumerate(out.placements) if p == Shard(out.ndim - 1) or p == Shard(-1)]
        dims = {d for d in by_columns if isinstance(x.placements[d], Replicate) and not _gathered(arg, d)}
        if dims:
            found[arg] = tuple(sorted(dims | set(found.get(arg, ()))))
    return found


def _gathered(node: fx.Node, dim: int, depth: int = 4) -> bool:
    """`node` is, or is made by elementwise ops from, a move that gathers a value split on mesh dim
    `dim` (sequence parallelism: the norm's output gathered, then scaled by its weight): that gather's
    transpose sums the cotangent there, as a reduce_scatter (half an all_reduce's bytes)."""
    if node.op != "call_function" or depth == 0:
        return False
    if node.target is dtensor_ops.redistribute:
        src = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) else None
        return isinstance(src, DTensor) and isinstance(src.placements[dim], Shard)
    out = node.meta.get("example_value")
    if not isinstance(out, DTensor) or not isinstance(out.placements[dim], Replicate):
        return False
    return any(_gathered(a, dim, depth - 1) for a in node.all_input_nodes if not _reads_a_parameter(a))


def _reads_a_parameter(node: fx.Node) -> bool:
    """A parameter (or input) as read: a placeholder, possibly moved or marked by our own ops."""
    while node.op == "call_function" and node.target in (dtensor_ops.redistribute, dtensor_ops.reduce_gradient_eagerly):
        node = node.args[0]
    return node.op == "placeholder"
