"""DTensor's errors while AOTAutograd traces a placed program, told as the op at fault.

Lifting probes each op once, forward, on DTensors; an op can pass that probe and still fail
later, inside the decomposition AOTAutograd uses or inside its backward. `dtensor_failure` turns
such a failure into an `UnsupportedError` naming the op, its source line and its inputs' layouts.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from torch_hca._torch_private import fake_dtensor_work
from torch_hca.compiler.layout.candidates import op_name, source_line
from torch_hca.compiler.layout.probes import call_node
from torch_hca.errors import UnsupportedError
from torch_hca.spmd.placements import layout_str

_NO_RULE = re.compile(r"Operator (aten\.[\w.]+) does not have a sharding strategy")
_MIXED = re.compile(r"(aten\.[\w.]+) got mixed torch\.Tensor and DTensor")
_EXECUTING = re.compile(r"While executing %(\w+)")


def dtensor_failure(gm: fx.GraphModule, error: BaseException, graph_index: int) -> UnsupportedError | None:
    """DTensor's error while AOTAutograd traced the placed program `gm`, told as the op at fault (None: not DTensor's).

    Lifting probes each op once, forward, on DTensors; an op can pass that probe and still fail
    later, inside the decomposition AOTAutograd uses (``one_hot`` checks its classes with
    ``aten._assert_async``) or inside its backward (``cumprod``'s makes a plain tensor).
    """
    text = "\n".join([*map(str, error.args), *getattr(error, "__notes__", [])])
    found = _NO_RULE.search(text) or _MIXED.search(text)
    if found is None:
        return None
    why = "has no sharding rule for" if found.re is _NO_RULE else "cannot mix plain tensors and DTensors in"
    executing = _EXECUTING.search(text)
    node = next((n for n in gm.graph.nodes if executing and n.name == executing[1]), None)
    stage = "its decomposition"
    if node is None:
        node, stage = _failing_backward(gm, found[1]), "its backward"
    what = (
        "an op of the program (hca could not tell which)"
        if node is None
        else (
            f"{node.name} ({op_name(node)}, source: {source_line(node)}) with inputs laid out as {_input_layouts(node)}"
        )
    )
    return UnsupportedError(
        f"backend 'hca': graph {graph_index}: DTensor {why} {found[1]}, which {stage} runs, in {what}. "
        "hca's probe of the op on DTensors passed, so it did not run it replicated. Write that line with other ops, "
        "compute it outside the compiled module (under torch.compiler.disable), or try options={'inner': 'dtensor'} "
        "(DTensor's own eager program: no AOTAutograd decompositions)"
    )


def _input_layouts(node: fx.Node) -> str:
    parts = [
        f"{a.name}: {layout_str(v.placements)}"
        for a in node.all_input_nodes
        if isinstance(v := a.meta.get("example_value"), DTensor)
    ]
    return "{" + ", ".join(parts) + "}"


def _failing_backward(gm: fx.GraphModule, aten: str) -> fx.Node | None:
    """The op whose backward, run alone on fake DTensors, hits `aten` without a rule (best effort)."""
    placeholders = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    leaf = lambda v: v.detach().requires_grad_(v.dtype.is_floating_point) if isinstance(v, DTensor) else v
    with fake_dtensor_work(placeholders):
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method") or not isinstance(
                node.meta.get("example_value"), DTensor
            ):
                continue
            try:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: leaf(n.meta.get("example_value")))
                inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor) and a.requires_grad]
                out = call_node(gm, node, args, kwargs)
                if inputs and isinstance(out, DTensor) and out.requires_grad:
                    torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
            except Exception as e:  # noqa: BLE001 - looking for the one that fails like the program did
                if aten in str(e):
                    return node
    return None
