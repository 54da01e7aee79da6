"""Op families: which ops are views, which are matmuls, and how many FLOPs an op does.

One table for every reader: the layout solver prices the traced (torch-level) program with the
`torch_*` entries; the timeline, the schedule pass and the emitter read the aten program with the
`aten_*` ones. Keyed by op objects (and, for the traced program, the method names Dynamo records
as strings), never by an op's printed name.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# ------------------------------------------------------------------ aten (the compiled graphs)

# Ops whose schema declares no alias but whose result shares its input's memory.
UNANNOTATED_VIEWS = frozenset({aten._unsafe_view.default})

# The aten matmuls, and the position of their first operand (addmm and baddbmm take the added
# term first): the cost model scales their rate by their smallest dimension.
ATEN_MATMULS = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1, aten.baddbmm.default: 1}


def is_view_op(op: Any) -> bool:
    """Every result aliases an input without writing it: no data moves, no compute."""
    if op in UNANNOTATED_VIEWS:
        return True
    schema = getattr(op, "_schema", None)
    returns = schema.returns if schema is not None else []
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def aten_flops(op: torch._ops.OpOverload, args, kwargs, out) -> float:
    """torch's FLOP formula for the op where it has one, else one FLOP per output element."""
    formula = flop_registry.get(op.overloadpacket)
    if formula is not None:
        try:
            return float(formula(*args, **kwargs, out_val=out))
        except (AssertionError, AttributeError, IndexError, TypeError, ValueError, RuntimeError):
            pass  # a formula that does not fit these arguments: count the op as elementwise
    return float(sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)))


# ------------------------------------------------------------ torch (the traced logical program)

# Ops (functions, or the method names Dynamo records) whose result aliases their input: no
# compute and no new memory.
TORCH_VIEWS = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "expand",
        "flatten",
        "t",
        "contiguous",
        torch.reshape,
        torch.transpose,
        torch.permute,
        torch.flatten,
        torch.unsqueeze,
        torch.squeeze,
    }
)
# The traced matmuls, and the position of their first matmul operand (addmm and baddbmm, as
# `torch.addmm(bias, x, w)` or the method `bias.addmm(x, w)`, take the added term first): HF
# GPT-2's Conv1D runs on addmm, so without it every block's matmul would count as elementwise.
TORCH_MATMULS = {
    F.linear: 0,
    torch.matmul: 0,
    torch.bmm: 0,
    torch.mm: 0,
    operator.matmul: 0,
    "matmul": 0,
    "bmm": 0,
    "mm": 0,
    torch.addmm: 1,
    torch.baddbmm: 1,
    "addmm": 1,
    "baddbmm": 1,
}
TORCH_ATTENTIONS = frozenset({F.scaled_dot_product_attention})


def torch_flops(target: Any, input_shapes: list[tuple[int, ...]], out_numel: int) -> float:
    """FLOPs of one traced op's forward: 2·m·n·k for a matmul, 4·(query rows)·(keys)·(head dim)
    for attention, nothing for a view, else one per output element."""
    if target in TORCH_VIEWS:
        return 0.0
    first = TORCH_MATMULS.get(target)
    if first is not None and len(input_shapes) > first and input_shapes[first]:
        return 2.0 * out_numel * input_shapes[first][-1]
    if target in TORCH_ATTENTIONS and len(input_shapes) > 1 and len(input_shapes[1]) >= 2:
        return 4.0 * out_numel * input_shapes[1][-2]  # q·kᵀ and the weights times v
    return float(out_numel)
