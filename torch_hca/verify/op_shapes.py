"""The verifier's op families whose arguments the file does not keep, read from the logical
shapes instead (torch_hca/verify/op_rules.py): reductions (the reduced dims), views (the dim
mapping), transposes and permutes, narrow and cat (the dim), the normalizations.

Where the shapes allow several arguments, a rule returns every placement one of them allows,
marked `UNSURE` where they differ: `op_rules` then decides only that a placement none of them
allows is illegal.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

from .op_families import LINEAR, UNSURE, At, Rule, Verdict, none, only, partial, plus, pointwise


def _unsure(allowed: set) -> frozenset:
    """One placement for each argument the shapes allow: unsure where they differ."""
    return frozenset(allowed | ({UNSURE} if len(allowed) > 1 else set()))


# ----------------------------------------------------------------------------- reductions


def reductions(s: tuple, o: tuple) -> list[tuple[frozenset, dict]]:
    """Every (reduced dims, kept dim -> its output dim) a sum or mean of shape `s` to `o` may be."""
    ways = []
    if len(o) == len(s) and all(a == b or b == 1 for a, b in zip(s, o)):  # keepdim=True
        ways.append((frozenset(j for j in range(len(s)) if s[j] != o[j]), {j: j for j in range(len(s))}))
    if len(o) <= len(s) <= 12:  # keepdim=False: the kept dims, in order
        for kept in itertools.combinations(range(len(s)), len(o)):
            if all(s[k] == b for k, b in zip(kept, o)):
                ways.append((frozenset(range(len(s))) - set(kept), {k: i for i, k in enumerate(kept)}))
    return ways


def reduction(made: str) -> Rule:
    """sum (made "P(sum)") or mean ("P(avg)") over dims read from the shapes."""

    def rule(at: At) -> Verdict:
        if len(at.reads) != 1:
            return None
        r = at.reads[0]
        ways = reductions(r.shape, at.shape)
        if not ways or (r.kind == "P" and r.reduce not in LINEAR):
            return None
        if r.kind != "S":
            return only(r.p, "a linear reduction keeps it")
        allowed = {made if r.dim in dims else f"S({kept[r.dim]})" for dims, kept in ways}
        how = [f"reduced: {made}" if r.dim in dims else f"kept as output dim {kept[r.dim]}" for dims, kept in ways]
        return _unsure(allowed), f"its sharded dim {r.dim} {' or '.join(sorted(set(how)))}"

    return rule


# ----------------------------------------------------------------------------- views


def groups(s: tuple, o: tuple) -> Optional[list[tuple[list, list]]]:
    """A reshape's dims (sizes 1 left out) in groups of equal product: (input dims, output dims)."""
    a = [j for j, x in enumerate(s) if x != 1]
    b = [j for j, x in enumerate(o) if x != 1]
    if math.prod(s) != math.prod(o) or 0 in s:
        return None
    found, i, k = [], 0, 0
    while i < len(a):
        gi, go, pi, po = [a[i]], [], s[a[i]], 1
        i += 1
        while pi != po:
            if po < pi and k < len(b):
                go.append(b[k])
                po *= o[b[k]]
                k += 1
            elif i < len(a):
                gi.append(a[i])
                pi *= s[a[i]]
                i += 1
            else:
                return None
        found.append((gi, go))
    return found


def reshape(at: At) -> Verdict:
    """view / reshape / flatten / unflatten / (un)squeeze: row-major order kept, so a shard maps
    where the outermost dim of its group goes (and only there, cut evenly)."""
    if not at.reads:
        return None
    r = at.reads[0]
    found = groups(r.shape, at.shape)
    if found is None or r.dtype != at.dtype:  # x.view(dtype) reads the same bytes as other numbers
        return None
    if r.kind != "S":
        return only(r.p, "the same values, laid out again")
    if r.nested or at.nested or r.shape[r.dim] == 1:
        return None  # a dim cut on two mesh dims may be cut in strides, which the file writes as S(d)
    gi, go = next(g for g in found if r.dim in g[0])
    if r.dim != gi[0]:
        return none(f"dim {r.dim} is not the outermost of the dims {gi} the view merges")
    kept = len(gi) == 1 and len(go) == 1  # the cut dim stays as it is: torch.chunk's pieces stay too
    if r.shape[r.dim] % at.n and not kept:
        return none(f"dim {r.dim} (size {r.shape[r.dim]}) is cut unevenly and the view merges or splits it")
    if at.shape[go[0]] % at.n and not kept:
        return none(f"output dim {go[0]} (size {at.shape[go[0]]}) cannot be cut {at.n} ways")
    return only(f"S({go[0]})", f"input dims {gi} become output dims {go}")


def permutation(swap: bool) -> Rule:
    """transpose (`swap`: two dims exchanged) or permute: the shard goes where its dim goes."""

    def rule(at: At) -> Verdict:
        if not at.reads or sorted(at.reads[0].shape) != sorted(at.shape):
            return None
        r = at.reads[0]
        if r.kind != "S":
            return only(r.p, "the same values, dims reordered")
        s, o = list(r.shape), list(at.shape)
        if swap:
            pairs = [(a, b) for a in range(len(s)) for b in range(a, len(s))]
            to = {b if r.dim == a else a if r.dim == b else r.dim for a, b in pairs if _swapped(s, a, b) == o}
        else:
            to = {i for i, x in enumerate(o) if x == s[r.dim]}
        return _unsure({f"S({i})" for i in to}), f"its dim {r.dim} (size {s[r.dim]}) moved"

    return rule


def _swapped(s: list, a: int, b: int) -> list:
    t = list(s)
    t[a], t[b] = t[b], t[a]
    return t


def expand(at: At) -> Verdict:
    """expand / expand_as / broadcast_to of the first read: a broadcast of it alone; a replicated
    read may also come out cut on a dim the expand grows (each rank expands to its own piece)."""
    if not at.reads:
        return None
    r = at.reads[0]
    verdict = pointwise("joint", 1)(At(at.shape, at.dtype, (r,), at.n))
    if r.p != "R" or not verdict:
        return verdict
    off = len(at.shape) - len(r.shape)
    grown = [d for d, x in enumerate(at.shape) if (d < off or r.shape[d - off] == 1) and x > 1 and x % at.n == 0]
    return verdict[0] | {f"S({d})" for d in grown}, "a replicated read, expanded whole or to each rank's piece"


def narrow(at: At) -> Verdict:
    """narrow(x, dim, start, length): the one dim whose size changed is cut; shards elsewhere pass."""
    if not at.reads or len(at.reads[0].shape) != len(at.shape):
        return None
    r = at.reads[0]
    cut = [j for j, (a, b) in enumerate(zip(r.shape, at.shape)) if a != b]
    if len(cut) != 1:
        return None
    if r.kind == "S" and r.dim == cut[0]:
        return none(f"narrowing its sharded dim {r.dim}: each rank's piece is not the piece of the narrowed value")
    return only(r.p, f"dim {cut[0]} narrowed")


def cat(at: At) -> Verdict:
    """torch.cat along the dim whose sizes add up: every read laid out alike, not cut on that dim."""
    rs = at.reads
    if not rs or any(len(r.shape) != len(at.shape) for r in rs):
        return None
    dims = [
        d
        for d in range(len(at.shape))
        if sum(r.shape[d] for r in rs) == at.shape[d]
        and all(r.shape[:d] + r.shape[d + 1 :] == at.shape[:d] + at.shape[d + 1 :] for r in rs)
    ]
    if not dims or any(r.kind == "P" and r.reduce not in LINEAR for r in rs):
        return None
    layouts = {r.p for r in rs}
    if layouts == {"R", "P(avg)"}:  # a replicated read is an average of itself
        layouts = {"P(avg)"}
    if len(layouts) > 1:
        return none(f"reads laid out differently ({[r.p for r in rs]})")
    (p,) = layouts
    cut = [d for d in dims if p.startswith("S") and int(p[2:-1]) == d]
    if cut and len(dims) > 1:
        return None  # the shapes allow a cat along the sharded dim and along another
    if cut:
        return none(f"concatenated along its sharded dim {cut[0]}: each rank's pieces are not the piece of the whole")
    return only(p, f"concatenated along dim {dims[0] if len(dims) == 1 else dims}, laid out alike")


def normalize(at: At) -> Verdict:
    """layer_norm / rms_norm(x, shape, weight, bias) = x normalized over the trailing dims of the
    weight's shape (at least the last), times the weight, plus the bias: the normalized dims whole
    and x not partial; then a pointwise product and sum."""
    if not at.reads or len(at.reads) > 3:
        return None
    x, params = at.reads[0], at.reads[1:]
    inner = len(params[0].shape) if params else 1  # without a weight, only the last dim is surely normalized
    if x.kind == "P":
        return partial(at.reads[:1], "none", 1)
    if x.kind == "S" and x.dim >= len(x.shape) - inner:
        return none(f"its dim {x.dim} is normalized: a rank sees part of it")
    if (x.kind == "S" and not params) or (len(params) == 1 and params[0].kind == "P"):
        return None  # normalized_shape may cover this dim too; one read: a weight or a bias?
    verdict = pointwise("one", 2)(At(at.shape, at.dtype, (x, params[0]), at.n)) if params else only(x.p, "")
    verdict = plus(at, verdict, params[1] if len(params) == 2 else None)
    return verdict and (verdict[0], f"normalized whole, then {verdict[1] or 'kept'}")


def softmax(at: At) -> Verdict:
    """softmax / log_softmax over a dim the file does not keep: only R and P are decided."""
    if len(at.reads) != 1:
        return None
    r = at.reads[0]
    if r.kind == "P":
        return partial(at.reads, "none", 1)
    return only("R", "a replicated read") if r.kind == "R" else None
