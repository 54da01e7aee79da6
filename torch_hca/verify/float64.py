"""The float64 side of the numerical refinement check (`torch_hca.verify.numeric`): the tensors the
model is re-traced on, every floating dtype the program names widened to float64, and how a value
put back together from the ranks' pieces is compared with the logical one."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

RTOL = 1e-6  # float64 on both sides: a misplaced value is off by O(1), rounding by about 1e-15


def float64(gen: torch.Generator):
    def parameter(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(tuple(p.shape), dtype=torch.float64, generator=gen) if p.is_floating_point() else whole(p)

    def buffer(b: torch.Tensor) -> torch.Tensor:
        value = whole(b)
        if value is None:
            return torch.randn(tuple(b.shape), dtype=torch.float64, generator=gen)
        return value.to(torch.float64) if value.is_floating_point() else value

    def tensor_input(x: torch.Tensor) -> torch.Tensor:
        x = whole(x)
        return x.to(torch.float64) if x.is_floating_point() else x

    return parameter, buffer, tensor_input


def whole(t: torch.Tensor) -> torch.Tensor | None:
    """A plain tensor's value; a DTensor's where every rank holds all of it (Replicate), else None."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return t.detach().clone()
    if all(type(p).__name__ == "Replicate" for p in placements):
        return t.to_local().detach().clone()
    return None


def scale(t: torch.Tensor) -> float:
    """What a difference is measured against: 1 + the largest magnitude of the logical value."""
    return 1.0 + (float(t.detach().abs().max()) if t.numel() and t.is_floating_point() else 0.0)


def differs(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    """How the put-together value differs from the logical one, or None within the tolerance."""
    if tuple(got.shape) != tuple(want.shape):
        return f"a whole of shape {list(got.shape)} where the logical {what} has {list(want.shape)}"
    if not want.numel():
        return None
    got, want = got.detach(), want.detach()
    if not want.is_floating_point():
        return None if torch.equal(got, want) else f"a whole whose elements are not the logical {what}'s"
    diff = float((got - want).abs().max())
    if diff > RTOL * scale(want) or diff != diff:
        return (
            f"a whole differing from the logical {what} by {diff:.3g} (max abs; largest |{what}| {scale(want) - 1:.3g})"
        )
    return None


NARROW = (torch.float32, torch.float16, torch.bfloat16)
METHODS = {"float": "double", "half": "double", "bfloat16": "double"}


def wide(x: Any) -> Any:
    """Every floating dtype the program names as float64 (a model's `.float()` or `.to(torch.float32)`
    around a norm, say), and every floating constant: both programs run in float64 throughout. The
    program was traced on meta tensors (`retrace.trace`): a device it names from them (``device=x.device``)
    is the CPU the float64 tensors are on."""
    if isinstance(x, torch.dtype):
        return torch.float64 if x in NARROW else x
    if isinstance(x, torch.device):
        return torch.device("cpu") if x.type == "meta" else x
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64) if x.dtype in NARROW else x
    if isinstance(x, (tuple, list)):
        return type(x)(wide(e) for e in x)
    if isinstance(x, dict):
        return {k: wide(v) for k, v in x.items()}
    return x


_AUGMENTED = (
    "add",
    "and",
    "concat",
    "floordiv",
    "lshift",
    "matmul",
    "mod",
    "mul",
    "or",
    "pow",
    "rshift",
    "sub",
    "truediv",
    "xor",
)
# Python's augmented assignments (x += y, x &= m) as Dynamo records them; operator.and_ and or_ are not in place.
_OPERATOR_IN_PLACE = frozenset(getattr(operator, f"i{op}") for op in _AUGMENTED)


def in_place(node: fx.Node) -> bool:
    if node.op not in ("call_method", "call_function"):
        return False
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return node.target in _OPERATOR_IN_PLACE
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.startswith("_")) or node.kwargs.get("inplace") is True


def natural(name: str) -> tuple:
    """'narrow_10' after 'narrow_2': FX numbers a name's repeats in program order."""
    stem, _, n = name.rpartition("_")
    return (stem, int(n)) if n.isdigit() else (name, -1)


def flat(x: Any) -> list:
    """The fx nodes of an output structure, in order."""
    if isinstance(x, fx.Node):
        return [x]
    if isinstance(x, (tuple, list)):
        return [n for e in x for n in flat(e)]
    if isinstance(x, dict):
        return [n for e in x.values() for n in flat(e)]
    return []
