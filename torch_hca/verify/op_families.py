"""The verifier's op families that need no argument but the reads (torch_hca/verify/op_rules.py):
elementwise ops with broadcasting, and products (matmul, linear, addmm).

Each rule sees one mesh dim: the output's logical shape and dtype and, for each read, its logical
shape and placement there (`At`), and returns the output placements its reads allow with the
reason (an empty set: none does), or None where it cannot decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

LINEAR = ("sum", "avg")  # the Partial reductions a linear op commutes with


@dataclass(frozen=True)
class Operand:
    """One read (or the output) on one mesh dim: its logical shape, placement there and dtype."""

    shape: tuple[int, ...]
    p: str
    dtype: str = "float32"
    nested: bool = False  # some dim of it cut on two mesh dims (its pieces may be strided)

    @property
    def kind(self) -> str:
        return self.p[0]

    @property
    def dim(self) -> int:
        return int(self.p[2:-1])

    @property
    def reduce(self) -> str:
        return self.p[2:-1]


@dataclass(frozen=True)
class At:
    """What a rule sees: the output's shape and dtype, the reads, the ranks of this mesh dim."""

    shape: tuple[int, ...]
    dtype: str
    reads: tuple[Operand, ...]
    n: int
    nested: bool = False  # the output has a dim cut on two mesh dims


# A rule returns the output placements the reads allow with a reason (empty: none does), or
# None where it cannot decide.
Verdict = Optional[tuple[frozenset, str]]
Rule = Callable[[At], Verdict]


# In a verdict's set: the shapes allow arguments under which the op allows other placements
# (a permutation of dims of one size, a reduction over one of two dims of one size).
UNSURE = "?"


def only(p: str, why: str) -> Verdict:
    return frozenset([p]), why


def none(why: str) -> Verdict:
    return frozenset(), why


# ----------------------------------------------------------------------------- pointwise


def spread(shape: tuple[int, ...], reads: tuple[Operand, ...]) -> Verdict:
    """The output placement shards force on a broadcast (no read Partial): right-aligned dims."""
    out = len(shape)
    target = None
    for r in reads:
        if r.kind != "S":
            continue
        if len(r.shape) > out or r.shape[r.dim] != shape[r.dim + out - len(r.shape)]:
            return None
        d = r.dim + out - len(r.shape)
        if target not in (None, d):
            return none(f"reads sharded on different output dims ({target} and {d})")
        target = d
    if target is None:
        return only("R", "every read replicated")
    for r in reads:
        j = target - (out - len(r.shape))
        size = r.shape[j] if j >= 0 else 1
        if size not in (1, shape[target]):
            return None
        want = f"S({j})" if size == shape[target] else "R"
        if r.p != want:
            return none(f"output dim {target} is sharded, so a read {list(r.shape)} must be {want}, not {r.p}")
    return only(f"S({target})", "the shards follow the broadcast")


def partial(reads: tuple[Operand, ...], linear: str, at_least: int) -> Verdict:
    """Where some read is Partial: the placement an op of this linearity makes of them."""
    ps = [i for i, r in enumerate(reads) if r.kind == "P"]
    if any(reads[i].reduce not in LINEAR for i in ps) or linear == "unknown" or len(reads) < at_least:
        return None  # a max/min partial, or an operand the file does not list
    if linear == "none":
        return none(f"{reads[ps[0]].p} read by an op not linear in it: a move must reduce it first")
    kinds = {reads[i].reduce for i in ps}
    if kinds == {"avg"} and linear in ("joint", "cond"):  # a replicated read is an average of itself
        ps = sorted(set(ps) | {i for i, r in enumerate(reads) if r.p == "R" and (i or linear == "joint")})
    rest = [r.p for i, r in enumerate(reads) if i not in ps]
    if linear == "one":  # a product: one factor partial, the others whole
        ok = len(ps) == 1
    elif linear == "first":  # a quotient: the dividend partial, the divisor whole
        ok = ps == [0]
    elif linear == "cond":  # where(cond, a, b): both branches partial alike, the condition whole
        ok = ps == list(range(1, len(reads)))
    else:  # "joint": a sum, every operand partial alike
        ok = len(ps) == len(reads)
    if ok and len(kinds) == 1 and all(p == "R" for p in rest):
        return only(f"P({kinds.pop()})", f"linear ({linear}) in its partial read")
    return none(f"reads {[r.p for r in reads]}: the sum of the ranks' results is not the op of the sums")


def admits(allowed: frozenset, p: str) -> bool:
    """`p` is one of the allowed placements, or holds the same data: a replicated value is also its
    own average, maximum and minimum over the ranks."""
    return p in allowed or (p in ("P(avg)", "P(max)", "P(min)") and "R" in allowed)


def pointwise(linear: str = "none", arity: int = 1) -> Rule:
    """An elementwise op of `arity` tensor operands; `linear`: how a Partial read may pass
    (none, one: a product, first: a quotient, joint: a sum, cond: where, unknown)."""

    def rule(at: At) -> Verdict:
        if not at.reads or len(at.reads) > arity:
            return None
        if any(r.kind == "P" for r in at.reads):
            return partial(at.reads, linear, arity)
        return spread(at.shape, at.reads)

    return rule


def identity(at: At) -> Verdict:
    """Same values, same layout (contiguous, clone, detach): any placement passes through."""
    r = at.reads[0] if at.reads else None
    if r is None or r.shape != at.shape:
        return None
    return only(r.p, "the same values")


def cast(at: At) -> Verdict:
    """A dtype cast of the first read: shards pass; a partial passes between floating dtypes only."""
    if not at.reads:
        return None
    r = at.reads[0]
    if r.kind != "P":
        return spread(at.shape, (r,))
    floating = all(
        isinstance(t := getattr(torch, d, None), torch.dtype) and t.is_floating_point for d in (r.dtype, at.dtype)
    )
    return only(r.p, "a cast between floating dtypes is linear") if floating and r.reduce in LINEAR else None


# ----------------------------------------------------------------------------- products


def contract(out: list, operands: list[tuple[list, Operand]]) -> Verdict:
    """A product of operands labelled by dim (einsum style; None: a broadcast dim of size 1)."""
    reads = tuple(r for _, r in operands)
    if any(r.kind == "P" for r in reads):
        return partial(reads, "one", len(reads))
    sharded = {labels[r.dim] for labels, r in operands if r.kind == "S"}
    if not sharded:
        return only("R", "every operand replicated")
    if None in sharded:
        return None  # a broadcast dim of size 1 cannot be cut: the shapes are not what they say
    if len(sharded) > 1:
        return none(f"operands sharded on different dims ({sorted(sharded)})")
    (label,) = sharded
    for labels, r in operands:
        want = f"S({labels.index(label)})" if label in labels else "R"
        if r.p != want:
            return none(f"dim {label!r} is sharded, so an operand {list(r.shape)} must be {want}, not {r.p}")
    if label in out:
        return only(f"S({out.index(label)})", f"its dim {label!r} sharded through")
    return only("P(sum)", f"the contracted dim {label!r} sharded on every operand")


def _batch(shape: tuple[int, ...], out: tuple[int, ...]) -> list:
    """Labels of an operand's batch dims, right-aligned on the output's batch dims."""
    off = len(out) - len(shape)
    return [f"b{i + off}" if s == out[i + off] and s != 1 else None for i, s in enumerate(shape)]


def _matmul_labels(a: tuple, b: tuple, out: tuple) -> Optional[tuple[list, list, list]]:
    """torch.matmul's dims as labels, checked against the shapes (None where they do not fit)."""
    if not a or not b or a[-1] != (b[0] if len(b) == 1 else b[-2]):
        return None
    try:
        batch = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
    except RuntimeError:
        return None
    want = batch + (a[-2:-1] if len(a) > 1 else ()) + (b[-1:] if len(b) > 1 else ())
    if tuple(want) != out:
        return None
    la = (_batch(a[:-2], batch) + ["m", "k"]) if len(a) > 1 else ["k"]
    lb = (_batch(b[:-2], batch) + ["k", "n"]) if len(b) > 1 else ["k"]
    lo = [f"b{i}" for i in range(len(batch))] + (["m"] if len(a) > 1 else []) + (["n"] if len(b) > 1 else [])
    return la, lb, lo


def plus(at: At, verdict: Verdict, bias: Optional[Operand]) -> Verdict:
    """A product's placement with a bias added (broadcast)."""
    if bias is None or verdict is None or not verdict[0]:
        return verdict
    (p,) = verdict[0]
    added = pointwise("joint", 2)(At(at.shape, at.dtype, (Operand(at.shape, p), bias), at.n))
    return added and (added[0], f"{verdict[1]}; plus the bias {bias.p}: {added[1]}")


def matmul(at: At) -> Verdict:
    if len(at.reads) != 2:
        return None
    a, b = at.reads
    labels = _matmul_labels(a.shape, b.shape, at.shape)
    return labels and contract(labels[2], [(labels[0], a), (labels[1], b)])


def linear(at: At) -> Verdict:
    """F.linear(x, w, b): x @ w.T + b."""
    if len(at.reads) not in (2, 3):
        return None
    x, w = at.reads[:2]
    if len(w.shape) != 2 or not x.shape or x.shape[-1] != w.shape[1] or at.shape != x.shape[:-1] + w.shape[:1]:
        return None
    lx = [f"b{i}" for i in range(len(x.shape) - 1)] + ["k"]
    product = contract(lx[:-1] + ["n"], [(lx, x), (["n", "k"], w)])
    return plus(at, product, at.reads[2] if len(at.reads) == 3 else None)


def addmm(at: At) -> Verdict:
    """addmm / baddbmm(bias, a, b): bias + a @ b."""
    if len(at.reads) != 3:
        return None
    bias, a, b = at.reads
    if len(a.shape) != len(b.shape) or len(a.shape) not in (2, 3):
        return None
    labels = _matmul_labels(a.shape, b.shape, at.shape)
    return plus(at, labels and contract(labels[2], [(labels[0], a), (labels[1], b)]), bias)
