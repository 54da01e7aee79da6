"""Every rank's piece of a value, in one process: cut by a placement, put back together, moved.

The numerical refinement check (`torch_hca.verify.numeric`) keeps one tensor per rank for each
value. This module is the arithmetic of pieces, written from the placements' meaning alone
(docs/concepts.md), not from DTensor's code:

    cut        Shard(d): torch.chunk's piece of dim d at the rank's mesh coordinate (uneven shares
               as torch.chunk makes them); Replicate: the whole; Partial(sum): the whole divided by
               the mesh dim's size on each rank (DTensor's partition; avg/max/min: the whole)
    assemble   innermost mesh dim first: shards concatenated, partials reduced by their op,
               replicas compared (their largest difference is returned) and one kept
    step       one mesh dim of a move as its collective does it on the pieces of each group:
               all_gather concatenates, all_reduce sums, reduce_scatter sums then cuts, all_to_all
               concatenates on one dim and cuts another; a local step cuts or partitions; its
               backward is the backward the file states for that step (`backward` kind, or none)

All of it is differentiable (cat, narrow, sum), so autograd runs each rank's backward.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

Pieces = list  # one tensor per rank, indexed by rank


class NotSimulated(Exception):
    """A step or op the numerical check cannot run on pieces: that value is not compared."""


class Mesh:
    """The file's mesh: each rank's coordinates and, per mesh dim, its groups of ranks."""

    def __init__(self, shape: Sequence[int], ranks):
        self.sizes = list(shape)
        t = torch.tensor(ranks).reshape(self.sizes)
        self.world = t.numel()
        self.coords: list[tuple[int, ...]] = [()] * self.world
        for index in torch.cartesian_prod(*[torch.arange(n) for n in self.sizes]).reshape(self.world, -1).tolist():
            self.coords[int(t[tuple(index)])] = tuple(index)

    def groups(self, dim: int) -> list[list[int]]:
        """The ranks of each group along mesh dim `dim`, each in coordinate order."""
        lines: dict[tuple, list[tuple[int, int]]] = {}
        for r, c in enumerate(self.coords):
            lines.setdefault(c[:dim] + c[dim + 1 :], []).append((c[dim], r))
        return [[r for _, r in sorted(line)] for line in lines.values()]


def parse(p: str) -> tuple[str, int | str | None]:
    """'S(1)' -> ('S', 1); 'R' -> ('R', None); 'P(sum)' -> ('P', 'sum')."""
    if p == "R":
        return "R", None
    if p.startswith("S("):
        return "S", int(p[2:-1])
    return "P", p[2:-1]


def chunk(x: torch.Tensor, n: int, d: int, i: int) -> torch.Tensor:
    """torch.chunk(x, n, d)[i], or the empty piece where torch.chunk makes fewer than n."""
    size = x.shape[d]
    step = math.ceil(size / n) if size else 0
    start = min(i * step, size)
    return x.narrow(d, start, max(0, min(size, start + step) - start))


def local_shape(shape: Sequence[int], placements: Sequence[str], mesh: Mesh, rank: int) -> list[int]:
    """The shape of `rank`'s piece of a value of logical `shape` laid out as `placements`."""
    out = list(shape)
    for m, p in enumerate(placements):
        kind, d = parse(p)
        if kind == "S":
            n, i = mesh.sizes[m], mesh.coords[rank][m]
            step = math.ceil(out[d] / n) if out[d] else 0
            start = min(i * step, out[d])
            out[d] = max(0, min(out[d], start + step) - start)
    return out


def cut(t: torch.Tensor, placements: Sequence[str], mesh: Mesh) -> Pieces:
    """Each rank's piece of the whole tensor `t` (fresh tensors: an in-place op touches one rank)."""
    out = []
    for r in range(mesh.world):
        x = t
        for m, p in enumerate(placements):
            kind, arg = parse(p)
            if kind == "S":
                x = chunk(x, mesh.sizes[m], arg, mesh.coords[r][m])
            elif kind == "P" and arg == "sum":
                x = x / mesh.sizes[m]
        out.append(x.clone())
    return out


def _combine(xs: list[torch.Tensor], p: str) -> tuple[torch.Tensor, float]:
    kind, arg = parse(p)
    if kind == "S":
        return torch.cat(xs, dim=arg), 0.0
    if kind == "R":
        return xs[0], max(_apart(x, xs[0]) for x in xs)
    stacked = torch.stack(xs)
    if arg == "sum":
        return stacked.sum(0), 0.0
    if arg == "avg":
        return stacked.mean(0), 0.0
    if arg in ("max", "min"):
        return (stacked.amax(0) if arg == "max" else stacked.amin(0)), 0.0
    raise NotSimulated(f"a Partial({arg}) value")


def _apart(x: torch.Tensor, y: torch.Tensor) -> float:
    """How far two replicas are apart: the largest difference (inf: other shapes or integers)."""
    if x.shape != y.shape:
        return float("inf")
    if not x.numel():
        return 0.0
    if not x.is_floating_point():
        return 0.0 if torch.equal(x, y) else float("inf")
    return float((x - y).detach().abs().max())


def assemble(pieces: Pieces, placements: Sequence[str], mesh: Mesh) -> tuple[torch.Tensor, float]:
    """The whole value the pieces stand for, and the largest difference between replicas."""
    current = {mesh.coords[r]: x for r, x in enumerate(pieces)}
    spread = 0.0
    for m in reversed(range(len(mesh.sizes))):
        lines: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        for c, x in current.items():
            lines.setdefault(c[:m], []).append((c[m], x))
        current = {}
        for key, line in lines.items():
            whole, s = _combine([x for _, x in sorted(line, key=lambda e: e[0])], placements[m])
            current[key], spread = whole, max(spread, s)
    return current[()], spread


# ----------------------------------------------------------------------------- moves


def _forward(xs: list[torch.Tensor], a: str, b: str, n: int) -> list[torch.Tensor]:
    """One group's pieces (in coordinate order) moved from `a` to `b` on that mesh dim."""
    (ka, da), (kb, db) = parse(a), parse(b)
    if a == b:
        return [x.clone() for x in xs]
    if ka == "S":
        whole = torch.cat(xs, dim=da)  # all_gather (S -> R), all_to_all (S -> S)
        if kb == "R":
            return [whole.clone() for _ in xs]
        if kb == "S":
            return [chunk(whole, n, db, i).clone() for i in range(n)]
    if ka == "P" and da in ("sum", "avg"):
        whole = _combine(xs, a)[0]  # all_reduce (P -> R), reduce_scatter (P -> S)
        if kb == "R":
            return [whole.clone() for _ in xs]
        if kb == "S":
            return [chunk(whole, n, db, i).clone() for i in range(n)]
    if ka == "R" and kb == "S":
        return [chunk(x, n, db, i).clone() for i, x in enumerate(xs)]  # a local cut
    if ka == "R" and kb == "P":
        return [x / n if db == "sum" else x.clone() for x in xs]  # a local partition
    raise NotSimulated(f"a move {a} -> {b}")


def _backward(gs: list[torch.Tensor], a: str, b: str, kind: str | None, n: int) -> list[torch.Tensor]:
    """The cotangents of one group's pieces for a step `a` -> `b` whose backward the file states
    as `kind` (None: no collective, each rank's local conversion). The cotangent of a Partial
    input is taken replicated, as DTensor's redistribute does."""
    (ka, da), (kb, db) = parse(a), parse(b)
    if kind is None:
        # A mean over the ranks' pieces: each piece's share of the cotangent is 1/n of it (exact
        # adjoint); R -> P(avg) sums those n equal shares back.
        if ka == "P" and da == "avg" and kb == "R":
            return [g / n for g in gs]
        if ka == "R" and kb == "P" and db == "avg":
            return [g * n for g in gs]
        if a == b or (ka in ("P", "R") and kb in ("P", "R")):
            return [g.clone() for g in gs]  # P -> R, R -> P: the cotangent as it is
        if ka == "S" and kb == "R":
            return [chunk(g, n, da, i).clone() for i, g in enumerate(gs)]  # this rank's part of it
        if kb == "S" and ka in ("R", "P"):  # no gather: each rank's part alone, zeros elsewhere
            sizes = [g.shape[db] for g in gs]
            return [_pad(g, db, sum(sizes[:i]), sum(sizes)) for i, g in enumerate(gs)]
        raise NotSimulated(f"the backward of a move {a} -> {b} without a collective")
    if kind == "all_reduce":
        whole = torch.stack(gs).sum(0)
        return [whole.clone() for _ in gs]
    if kind == "reduce_scatter" and ka == "S":
        whole = torch.stack(gs).sum(0)
        return [chunk(whole, n, da, i).clone() for i in range(n)]
    if kind == "all_gather" and kb == "S":
        whole = torch.cat(gs, dim=db)
        if ka == "S":  # gloo's all_to_all: gathered, then each rank keeps its piece
            return [chunk(whole, n, da, i).clone() for i in range(n)]
        return [whole.clone() for _ in gs]
    if kind == "all_to_all" and ka == "S" and kb == "S":
        whole = torch.cat(gs, dim=db)
        return [chunk(whole, n, da, i).clone() for i in range(n)]
    raise NotSimulated(f"a backward {kind} for a move {a} -> {b}")


def _pad(g: torch.Tensor, d: int, start: int, size: int) -> torch.Tensor:
    before = list(g.shape)
    before[d] = start
    after = list(g.shape)
    after[d] = size - start - g.shape[d]
    return torch.cat([g.new_zeros(before), g, g.new_zeros(after)], dim=d)


class _Collective(torch.autograd.Function):
    """All ranks' pieces in, all ranks' pieces out: forward and backward given as functions."""

    @staticmethod
    def forward(ctx, forward: Callable, backward: Callable, *xs):
        ctx.backward = backward
        return tuple(forward([x.detach() for x in xs]))

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, *ctx.backward(list(gs)))


def per_group(mesh: Mesh, dim: int, fn: Callable[[list], list]) -> Callable[[Pieces], Pieces]:
    """`fn` on the pieces of each group along mesh dim `dim`, put back in rank order."""

    def run(pieces: Pieces) -> Pieces:
        out = [None] * mesh.world
        for group in mesh.groups(dim):
            for r, y in zip(group, fn([pieces[r] for r in group])):
                out[r] = y
        return out

    return run


def step(pieces: Pieces, mesh: Mesh, dim: int, a: str, b: str, backward_kind: str | None) -> Pieces:
    """One mesh dim of a move, forward as its collective and backward as the file states."""
    n = mesh.sizes[dim]
    fwd = per_group(mesh, dim, lambda xs: _forward(xs, a, b, n))
    bwd = per_group(mesh, dim, lambda gs: _backward(gs, a, b, backward_kind, n))
    return list(_Collective.apply(fwd, bwd, *pieces))


def divide_in_backward(pieces: Pieces, n: int) -> Pieces:
    """The identity forward; in the backward, each rank's cotangent divided by `n` (a whole
    cotangent added to partial ones as a partial of its own)."""
    return list(_Collective.apply(lambda xs: [x.clone() for x in xs], lambda gs: [g / n for g in gs], *pieces))


def reduce_in_backward(pieces: Pieces, mesh: Mesh, dim: int) -> Pieces:
    """The identity forward; in the backward, the cotangents summed over each group of `dim`
    (a gradient or cotangent reduction the file states: an all_reduce in the backward)."""
    bwd = per_group(mesh, dim, lambda gs: [torch.stack(gs).sum(0)] * len(gs))
    return list(_Collective.apply(lambda xs: [x.clone() for x in xs], bwd, *pieces))


def lookup(target, args, kwargs, placements, mesh: Mesh, rank: int, rows: int) -> torch.Tensor:
    """An embedding lookup on `rank`: in a table cut by rows (Shard(0)) each rank looks up the rows it
    holds, zeros elsewhere (a Partial result; a padding row is the padding row of the rank holding it);
    in any other table, the plain lookup. `rows`: the whole table's."""
    by_rows = [m for m, p in enumerate(placements or []) if p == "S(0)"]
    if not by_rows:
        return target(*args, **kwargs)
    options = _plain_lookup(target, args, kwargs)
    if len(by_rows) > 1 or options is None:
        raise NotSimulated("a lookup with options, or in a table cut by rows on several mesh dims")
    ids, table, padding = options
    padding = padding + rows if padding is not None and padding < 0 else padding  # F.embedding's reading
    m = by_rows[0]
    start = min(mesh.coords[rank][m] * -(-rows // mesh.sizes[m]), rows)
    outside = (ids < start) | (ids >= start + table.shape[0])
    local_pad = padding - start if padding is not None and 0 <= padding - start < table.shape[0] else None
    found = F.embedding((ids - start).masked_fill(outside, 0), table, local_pad)
    return found * (~outside).unsqueeze(-1).to(found.dtype)


def _plain_lookup(target, args, kwargs) -> tuple | None:
    """(ids, table, padding_idx) of an ``F.embedding`` call with no option but a padding row (Dynamo
    writes every default out), else None."""
    if target is not F.embedding:
        return (args[0], args[1], None) if len(args) == 2 and not kwargs else None
    try:
        bound = inspect.signature(F.embedding).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    if a["max_norm"] is not None or a["scale_grad_by_freq"] or a["sparse"]:
        return None
    return a["input"], a["weight"], a["padding_idx"]
