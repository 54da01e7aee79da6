"""Emit: turn a checked c10d graph into something callable.

"eager": run the FX graph as is (boxed calling convention for AOTAutograd).
"inductor": hand the same graph to Inductor, which lowers the
`_c10d_functional` ops itself.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx
from functorch.compile import make_boxed_func


def emit(gm: fx.GraphModule, example_inputs: list[Any], inner: str, is_backward: bool = False) -> Callable:
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner

        from torch_hca._torch_private import copy_graph_module

        # Inductor rewrites the graph in place (all_reduce -> all_reduce_); the report
        # keeps the graph the passes emitted.
        return compile_fx_inner(copy_graph_module(gm), example_inputs, is_backward=is_backward)
    return make_boxed_func(gm.forward)


def decompositions(inner: str) -> dict | None:
    """The decomposition table AOTAutograd should apply for this emitter."""
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return None
