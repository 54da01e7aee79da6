"""How a placement, a layout and a dtype are written: one printer for the report, the solver and errors."""

from __future__ import annotations

import re

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from torch_hca.errors import StrategyError


def placement_str(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return repr(p)


def layout_str(layout) -> str:
    """A layout, one placement per mesh dim: ``(S(0), R)``; ``-`` for none (not a DTensor)."""
    if layout is None:
        return "-"
    return "(" + ", ".join(placement_str(p) for p in layout) + ")"


# One placement as `placement_str` writes it (a _StridedShard as its repr).
_PLACEMENT_TEXT = re.compile(r"S\(-?\d+\)|R|P\(\w+\)|_StridedShard\([^)]*\)")


def layout_texts(text: str | None) -> list[str] | None:
    """The inverse of `layout_str`: ``"(S(0), R)"`` -> ``["S(0)", "R"]``; None for ``-`` or None."""
    if text is None or text == "-":
        return None
    return _PLACEMENT_TEXT.findall(text)


# R, S(d) or P(op): a placement `parse_placement` reads back.
PLAIN_PLACEMENT = re.compile(r"S\((\d+)\)|R|P\((\w+)\)")


def parse_placement(text: str) -> Placement:
    """The inverse of `placement_str` for R, S(d) and P(op); a `StrategyError` for any other text."""
    m = PLAIN_PLACEMENT.fullmatch(text.strip())
    if m is None:
        raise StrategyError(f"strategy file: placement {text!r} is none of R, S(d), P(op)")
    if text == "R":
        return Replicate()
    return Shard(int(m.group(1))) if m.group(1) is not None else Partial(m.group(2))


def text_letter(text: str) -> str:
    """A placement's text as the move table reads it (`letter`): ``R``, ``P`` or ``S<d>``."""
    if text == "R":
        return "R"
    if text.startswith("P"):
        return "P"
    dim = re.search(r"-?\d+", text)
    return f"S{dim[0]}" if dim else "S"


def dtype_str(dtype) -> str:
    """A dtype as text: ``float32`` (no ``torch.`` prefix)."""
    return str(dtype).removeprefix("torch.")


def letter(p) -> str:
    """A placement as the move table reads it: R, P or S<d>."""
    if p.is_replicate():
        return "R"
    return "P" if p.is_partial() else f"S{p.dim}"


def partial_dims(t) -> tuple[int, ...]:
    """The mesh dimensions on which a DTensor (a gradient, typically) is still a partial sum."""
    return tuple(i for i, p in enumerate(t.placements) if p.is_partial())
