"""Emit: turn a checked c10d graph into something callable.

"eager": run the FX graph (boxed calling convention for AOTAutograd), with one
change Inductor makes too: an all_reduce of a buffer the graph has just made
for it alone (a bucket) reduces that buffer in place instead of a copy.
"inductor": hand the same graph to Inductor, which lowers the
`_c10d_functional` ops itself.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func

from torch_hca._torch_private import copy_graph_module

_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_ALL_REDUCE_IN_PLACE = torch.ops._c10d_functional.all_reduce_.default


def emit(gm: fx.GraphModule, example_inputs: list[Any], inner: str, is_backward: bool = False) -> Callable:
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner

        # Inductor rewrites the graph in place (all_reduce -> all_reduce_); the report
        # keeps the graph the passes emitted.
        return compile_fx_inner(copy_graph_module(gm), example_inputs, is_backward=is_backward)
    return make_boxed_func(reduce_in_place(gm).forward)


def reduce_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose all_reduces of fresh, otherwise unread buffers run in place.

    The functional all_reduce copies its input first (3 MiB of gradients cost about
    1 ms on one CPU core); where nothing else reads the input, that copy is waste.
    The report keeps the graph as the passes emitted it.
    """
    targets = [n for n in gm.graph.find_nodes(op="call_function", target=_ALL_REDUCE)
               if _fresh_buffer(n.args[0]) and len(n.args[0].users) == 1]
    if not targets:
        return gm
    gm = copy_graph_module(gm)
    for node in gm.graph.find_nodes(op="call_function", target=_ALL_REDUCE):
        if _fresh_buffer(node.args[0]) and len(node.args[0].users) == 1:
            node.target = _ALL_REDUCE_IN_PLACE
    gm.recompile()
    return gm


def _fresh_buffer(node: Any) -> bool:
    """Whether `node` is an op that returns new memory: its schema mutates nothing and aliases nothing."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)):
        return False
    schema = node.target._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def decompositions(inner: str) -> dict | None:
    """The decomposition table AOTAutograd should apply for this emitter."""
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return None
