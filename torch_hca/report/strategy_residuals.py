"""The strategy file's residuals: what a graph's forward keeps for its backward, with lifetimes.

Part of the file `torch_hca.report.strategy_file` writes (docs/strategy.md, ``residuals``);
checked by `torch_hca.verify.residual_rules`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from torch_hca.spmd.placements import dtype_str


def residuals(g: Any) -> list[dict]:
    """What the forward keeps for the backward, with its lifetime: each value the backward graph takes
    besides the cotangents, its local shape, dtype and bytes on this rank, the forward node that
    makes it (index in the forward graph, or ``input`` for a kept argument) and the backward node
    that reads it last (index in the backward graph), after which it can be freed."""
    if g.forward is None or g.backward is None:
        return []
    index_of = {n: i for i, n in enumerate(_counted(g.forward))}
    (fw_out,) = g.forward.graph.find_nodes(op="output")
    returned = list(fw_out.args[0])
    saved = [n for n in g.backward.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    # The forward returns its outputs, then what it saves, in the order the backward takes them
    # (AOTAutograd's partition); the names may differ after the schedule pass renames its waits.
    makers = returned[len(returned) - len(saved) :] if len(saved) <= len(returned) else [None] * len(saved)
    if not all(_same_value(m, n) for m, n in zip(makers, saved)):  # another order: pair by name
        by_name = {n.name: n for n in g.forward.graph.nodes}
        makers = [by_name.get(n.name) for n in saved]
    last: dict[str, tuple[int, str]] = {}
    for i, node in enumerate(_counted(g.backward)):
        for a in node.all_input_nodes:
            last[a.name] = (i, node.name)
    out = []
    for node, maker in zip(saved, makers):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        index, reader = last.get(node.name, (None, None))
        made = (
            {"node": "input", "index": None}
            if isinstance(maker, fx.Node) and maker.op == "placeholder"
            else {"node": getattr(maker, "name", None), "index": index_of.get(maker)}
        )
        out.append(
            {
                "value": node.name,
                "shape": list(val.shape),
                "dtype": dtype_str(val.dtype),
                "bytes": val.numel() * val.element_size(),
                "made": made,
                "last_read": {"node": reader, "index": index},
            }
        )
    return out


def is_size_input(node: fx.Node) -> bool:
    """A size Dynamo or AOTAutograd passes in as a graph input (a piece's storage offset under
    shares): ranks can differ in these while they run one program, so the file counts none of them."""
    value = node.meta.get("val", node.meta.get("example_value"))
    return node.op == "placeholder" and isinstance(value, torch.SymInt)


def _counted(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a residual's index counts: all but the size inputs, so every rank writes the same index."""
    return [n for n in gm.graph.nodes if not is_size_input(n)]


def _same_value(a: Any, b: fx.Node) -> bool:
    """Whether forward output `a` and backward input `b` hold a value of one type, shape and dtype."""
    va, vb = getattr(a, "meta", {}).get("val"), b.meta.get("val")
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        return va.shape == vb.shape and va.dtype == vb.dtype
    return type(va) is type(vb)
