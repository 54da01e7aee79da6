"""The verifier's own per-op-family legality rules: does each op value's placement follow from the
placements of the values it reads (after the file's moves)?

Written from what each op computes, one mesh dim at a time (a mesh dim of one rank is skipped:
every placement there is the whole value). On a mesh dim of n ranks, rank i runs the op on its
own pieces of the reads; the output's placement is legal when those local results are rank i's
piece of the logical output:

    pointwise    S(d) -> S(d) (broadcast right-aligned: a read of size 1 there must be R); R -> R;
                 P only through an op linear in that read (add/sub of P and P, neg, mul of P by R,
                 P / R, where of P and P); a nonlinear op (tanh, gelu, exp, ...) of a P read: illegal
    matmul       batch and free dims shard through; a contracted dim sharded on both operands makes
                 P(sum); one P operand times R operands stays P; then + bias as a pointwise add
    reduction    sum or mean over a sharded dim makes P(sum) or P(avg); kept dims renumbered
    views        a shard follows the view's dim mapping, read from the logical shapes alone
                 (reshape: the outermost dim of a merged or split group; permute: the moved dim);
                 narrow and cat: not cut on the narrowed or concatenated dim
    norms        layer_norm / rms_norm: the normalized dims whole and no partial input, then the
                 weight and bias as a pointwise product and sum; softmax: R and P only

The file keeps no op arguments, only each value's op, reads, logical shape and dtype, so each
argument a rule needs (reduced dims, permutation, cat dim) is read from the shapes: a rule takes
every argument the shapes allow and decides only where they agree (`op_shapes`). An op with fewer
reads than tensor operands (a scalar, a plain tensor, or one value read twice: ``x * x`` and
``x * 2`` read alike) decides nothing about a Partial read. Ops of no family here (embedding
lookups, attention kernels, the compiler's own ops, getitem, ...) and values a rule cannot decide
are counted as not checked (`tally`), never guessed. The rules: `op_families` (pointwise,
products) and `op_shapes` (the families whose arguments are read from shapes); nothing here comes
from the compiler or from DTensor's propagation rules (tests/test_layering.py).
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from .op_families import UNSURE, At, Operand, Rule, Verdict, addmm, admits, cast, identity, linear, matmul, pointwise
from .op_shapes import cat, expand, narrow, normalize, permutation, reduction, reshape, softmax
from .rules import Graph, Problem

RULE = "op placement"
_PLACEMENT = re.compile(r"S\(\d+\)|R|P\(\w+\)")

# op name, as the file writes it -> (family, rule); filled by `_family` below.
TABLE: dict[str, tuple[str, Rule]] = {}


def op_name(op: Any) -> str:
    """An op as the strategy file names it: a Tensor method by its name (an fx call_method
    target), a function by module and qualified name."""
    name = getattr(op, "__name__", None)
    if name is not None and getattr(torch.Tensor, name, None) is op:
        return name
    return f"{getattr(op, '__module__', '') or ''}.{getattr(op, '__qualname__', name)}"


def _each(names: str, *spaces: Any) -> list:
    """The ops of these names in each namespace (torch, torch.Tensor, F) where they exist."""
    return [getattr(s, n) for n in names.split() for s in spaces if callable(getattr(s, n, None))]


def _family(family: str, rule: Rule, ops: list) -> None:
    for op in ops:
        name = op_name(op)
        if name in TABLE:
            raise ValueError(f"op rules: {name} registered twice ({TABLE[name][0]}, {family})")
        TABLE[name] = (family, rule)


T = torch.Tensor
_UNARY = (
    "tanh sigmoid exp exp2 expm1 log log2 log10 log1p rsqrt sqrt abs sin cos sinh cosh atan asin acos erf "
    "erfc reciprocal square sign floor ceil round trunc relu logical_not isnan isinf isfinite"
)
_F_UNARY = (
    "gelu silu relu tanh sigmoid softplus elu selu celu leaky_relu hardtanh relu6 mish hardswish "
    "hardsigmoid logsigmoid softsign tanhshrink"
)
_BINARY = (
    "maximum minimum fmax fmin atan2 eq ne lt le gt ge logical_and logical_or logical_xor bitwise_and "
    "bitwise_or bitwise_xor remainder fmod floor_divide hypot pow copysign"
)
_family("pointwise", pointwise("none", 1), _each(_UNARY, torch, T) + _each(_F_UNARY, F) + [operator.invert])
_family(
    "pointwise",
    pointwise("none", 2),
    _each(_BINARY, torch, T) + _each("eq ne lt le gt ge and_ or_ xor mod floordiv pow", operator),
)
_family("pointwise", pointwise("none", 3), _each("clamp clip", torch, T))
_family("pointwise", pointwise("joint", 2), _each("add sub subtract", torch, T) + [operator.add, operator.sub])
_family("pointwise", pointwise("joint", 1), _each("neg negative", torch, T) + [operator.neg])
_family("pointwise", pointwise("one", 2), _each("mul multiply", torch, T) + [operator.mul])
_family("pointwise", pointwise("first", 2), [operator.truediv, torch.true_divide, T.true_divide])
_family("pointwise", pointwise("unknown", 2), _each("div divide", torch, T))  # rounding_mode is not in the file
_family("pointwise", pointwise("cond", 3), [torch.where])
_family("pointwise", pointwise("unknown", 3), _each("masked_fill", torch, T))
_family("pointwise", expand, _each("expand expand_as broadcast_to", T) + [torch.broadcast_to])
_family("pointwise", cast, _each("to float double half bfloat16 int long bool type type_as", T))
_family("pointwise", identity, _each("contiguous clone detach", T) + [torch.clone, torch.detach])
_family("matmul", matmul, _each("matmul mm bmm", torch, T) + [operator.matmul])
_family("matmul", linear, [F.linear])
_family("matmul", addmm, _each("addmm baddbmm", torch, T))
_family("reduction", reduction("P(sum)"), _each("sum", torch, T))
_family("reduction", reduction("P(avg)"), _each("mean", torch, T))
_VIEWS = "view reshape view_as reshape_as flatten unflatten squeeze unsqueeze"
_family("view", reshape, _each(_VIEWS, T) + _each("reshape flatten unflatten squeeze unsqueeze", torch))
_family("view", permutation(swap=True), _each("transpose swapaxes swapdims t", torch, T))
_family("view", permutation(swap=False), _each("permute movedim", torch, T))
_family("view", narrow, _each("narrow", torch, T))
_family("view", cat, _each("cat concat concatenate", torch))
_family("normalization", normalize, _each("layer_norm rms_norm", F))
_family("normalization", softmax, _each("softmax log_softmax", torch, T, F))


# ----------------------------------------------------------------------------- the rule


@dataclass
class OpTally:
    """How many op values of a file the op rules decided on every mesh dim, and which they did not."""

    checked: int = 0
    not_checked: Counter = field(default_factory=Counter)  # op -> values of it not checked

    def __str__(self) -> str:
        return f"op rules: {self.checked} values checked, {sum(self.not_checked.values())} not checked"


def _judged(G: Graph, v: dict) -> tuple[bool, list[tuple[int, Verdict]]]:
    """(decided on every mesh dim, [(mesh dim, verdict the file's placement breaks)])."""
    op, names = v.get("op"), v.get("reads")
    if not isinstance(op, str) or op not in TABLE or not isinstance(names, list):
        return False, []
    reads = [G.values.get(r) if isinstance(r, str) else None for r in names]
    if None in reads or not all(_parsed(u, len(G.sizes)) for u in [v, *reads]):
        return False, []
    rule = TABLE[op][1]
    decided, broken = True, []
    for m, n in enumerate(G.sizes):
        if n == 1:
            continue
        ins = tuple(
            Operand(tuple(u["shape"]), u["placements"][m], u.get("dtype", "float32"), _nested(G, u)) for u in reads
        )
        verdict = rule(At(tuple(v["shape"]), v.get("dtype", "float32"), ins, n, _nested(G, v)))
        if verdict is None or (admits(verdict[0], v["placements"][m]) and UNSURE in verdict[0]):
            decided = False  # legal under one argument the shapes allow, maybe not under the op's
        elif not admits(verdict[0], v["placements"][m]):
            broken.append((m, verdict))
    return decided, broken


def _parsed(v: dict, dims: int) -> bool:
    """Placements that parse, one per mesh dim, each shard on a dim of the shape (else the
    `placement` and `shard dim` rules speak)."""
    ps, shape = v.get("placements"), v.get("shape")
    if not isinstance(ps, list) or len(ps) != dims or not isinstance(shape, list):
        return False
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
        return False  # a symbolic size: nothing to read from it
    for p in ps:
        if not isinstance(p, str) or not _PLACEMENT.fullmatch(p) or (p[0] == "S" and int(p[2:-1]) >= len(shape)):
            return False
    return True


def _nested(G: Graph, v: dict) -> bool:
    cut = [p for p, n in zip(v["placements"], G.sizes) if p.startswith("S") and n > 1]
    return len(cut) != len(set(cut))


def op_placement(G: Graph) -> Iterator[Problem]:
    """Each op value's placement is, on every mesh dim, one its op family lets its reads make."""
    for name, v in G.values.items():
        if v.get("kind") != "op":
            continue
        for m, (allowed, why) in _judged(G, v)[1]:
            family = TABLE[v["op"]][0]
            reads = ", ".join(f"{r!r} {G.values[r]['shape']} {G.values[r]['placements'][m]}" for r in v["reads"])
            yield Problem(
                f"{G.at(name)} ({v['op']})",
                RULE,
                f"{v['placements'][m]} on mesh dim {m}, reading {reads or 'nothing'}",
                f"{' or '.join(sorted(allowed - {UNSURE}))} ({family}: {why})"
                if allowed
                else f"read from other placements: no output placement follows from these ({family}: {why})",
            )


def tally(data: dict) -> OpTally:
    """The op values of every graph the rules decided, and those they did not (by op)."""
    found = OpTally()
    for i, g in enumerate(data.get("graphs") or []):
        try:
            G = Graph(i, g, data)
        except (KeyError, TypeError, AttributeError):
            continue  # the schema rules name it
        for v in G.values.values():
            if not isinstance(v, dict) or v.get("kind") != "op":
                continue
            try:
                checked = _judged(G, v)[0]
            except (KeyError, TypeError, ValueError, AttributeError, IndexError):
                checked = False  # a malformed entry: the other rules name it
            if checked:
                found.checked += 1
            else:
                found.not_checked[str(v.get("op"))] += 1
    return found
