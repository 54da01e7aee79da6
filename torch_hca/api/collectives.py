"""Local-view collectives: `hca.collectives`, for code written per rank (Megatron style).

Each op takes a plain local tensor, the group it communicates over, and the
*role* of its input (``src``) and output (``dst``) along that group. Roles on
other mesh dimensions are untouched: call one op per mesh dimension. The
roles decide the backward; the forward is the same collective either way.

Roles (``"R"``, ``"I"``, ``"V"``, ``"P"``, ``"S(d)"``, or DTensor's
``Replicate()``, ``Partial()``, ``Shard(d)``), and what a rank's *gradient*
of such a value means::

    role  value on the ranks              a rank's gradient of it
    R     the same on every rank          the whole gradient, the same on every rank
    I     the same on every rank          only this rank's summand: the gradient is their sum,
                                          not summed yet (backward sums it)
    V     different on every rank         this rank's own
    P     summands: the value is the sum  the whole gradient, the same on every rank
    S(d)  this rank's shard along dim d   the gradient of this shard

Declare R when everything downstream computes the same thing on every rank (a
loss each rank calls ``.backward()`` on); declare I when each rank goes on to
use the value differently (a column-parallel matmul), so the ranks' gradients
must be added. NB: spmd_types uses the two letters the other way round (its R
has a partial gradient, its I a complete one); the meanings above are ours.

Accepted roles, forward, and backward (the transpose from `collective_kinds`,
or what is left of it when the cotangent is already summed: dst R)::

    op              src -> dst     forward            backward
    all_reduce      P -> R         all_reduce         nothing (identity)
                    P -> I         all_reduce         all_reduce
    all_gather      S(d) -> R      all_gather d       local chunk d
                    S(d) -> I      all_gather d       reduce_scatter d
                    V -> R | I     the same on a new dim 0 (stack, not concat)
    reduce_scatter  P -> S(d)      reduce_scatter d   all_gather d
                    P -> V         reduce_scatter 0 of an (n, ...) input, dim 0 dropped
    all_to_all      S(a) -> S(b)   all_to_all a->b    all_to_all b->a      (a != b)
    broadcast       V -> R         broadcast root     keep the root's gradient, zero elsewhere
                    V -> I         broadcast root     reduce (sum) to root
    ppermute        V | S(d) -> V  permute (shift k)  permute (shift -k)

Pictures on three ranks (rows are ranks; ``+`` marks a pending sum)::

    all_reduce P -> R      +a          a+b+c        backward (R):  g  <=  g
                           +b    =>                  backward (I):  g0+g1+g2  <=  +g0 +g1 +g2
                           +c
    all_gather S(0) -> R   [a]
                           [b]   =>   [a b c]       backward (R): [ga] [gb] [gc]  <=  [ga gb gc]
                           [c]
    reduce_scatter P -> S  +[a0 b0 c0]     [a0+a1+a2]
                           +[a1 b1 c1] =>  [b0+b1+b2]   backward: [ga gb gc]  <=  [ga] [gb] [gc]
                           +[a2 b2 c2]     [c0+c1+c2]
    ppermute shift 1       a               c
                           b       =>      a            backward: shift -1
                           c               b

Anything else raises `RoleError`, naming the op, the roles, and the fix. The
classic trap: ``all_reduce(loss, src="R", ...)`` would count a replicated
value n times; declare it P if each rank holds a summand, or do not reduce it.

Before gloo sees an eager call (forward or backward), the ranks of its group
compare it through the rendezvous store: ranks that disagree on the op, roles,
root, shift, local shape or dtype get a `CollectiveError` listing each rank's
call (gloo would abort the process), and a call on some ranks only is a
`CheckError` naming the others after `torch_hca.runtime.mesh.timeout_s()`. Compiled
calls are not checked; `unchecked()` turns the check off for a block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from torch_hca.api.collective_groups import Where, agree, unchecked, where_of
from torch_hca.errors import CollectiveError, RoleError
from torch_hca.spmd.collective_kinds import RULES, Kind, already_summed

Tensor = torch.Tensor

__all__ = [
    "Role",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "ppermute",
    "reduce_scatter",
    "role",
    "unchecked",
]


# ----------------------------------------------------------------- roles


@dataclass(frozen=True)
class Role:
    kind: str  # "R", "I", "V", "P" or "S"
    dim: int | None = None  # the sharded dim, for "S"

    def __str__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind


_ROLE_TEXT = re.compile(r"^\s*(?:([RIVP])|S\(\s*(-?\d+)\s*\))\s*$")


def role(spec: Any) -> Role:
    """A `Role` from ``"R"``, ``"I"``, ``"V"``, ``"P"``, ``"S(d)"`` or a DTensor placement."""
    if isinstance(spec, Role):
        return spec
    if isinstance(spec, Replicate):
        return Role("R")
    if isinstance(spec, Partial):
        return Role("P")
    if isinstance(spec, Shard):
        return Role("S", spec.dim)
    match = _ROLE_TEXT.match(spec) if isinstance(spec, str) else None
    if match is None:
        raise RoleError(
            f"hca.collectives: {spec!r} is not a role; write 'R', 'I', 'V', 'P', 'S(d)' "
            "(d a tensor dim), or a Replicate(), Partial(), Shard(d) placement"
        )
    return Role(match[1]) if match[1] else Role("S", int(match[2]))


# ------------------------------------------------------ the autograd core

# A step is (kind, params), a kind of the table; a plan is a tuple of steps.


def _step(kind: Kind, **params: Any) -> tuple:
    return (kind, tuple(sorted(params.items())))


def _run(plan: tuple, x: Tensor, where: Where) -> Tensor:
    for kind, params in plan:
        x = RULES[kind].emit(x, where.group_name, rank=where.rank, size=where.size, **dict(params))
    return x


class _Collective(torch.autograd.Function):
    """Forward: run the plan `fwd`; backward: run the plan `bwd` on the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, where: Where, fwd: tuple, bwd: tuple) -> Tensor:
        ctx.where, ctx.bwd = where, bwd
        agree(where, "forward", fwd, x, then=bwd)
        return _run(fwd, x, where)

    @staticmethod
    def backward(ctx, grad: Tensor):
        agree(ctx.where, "backward", ctx.bwd, grad)
        return _run(ctx.bwd, grad, ctx.where), None, None, None


def _differentiable(x: Tensor, where: Where, kind: Kind, dst: Role, **params: Any) -> Tensor:
    """Apply `kind`; backward is its transpose from the table, reduced to its local part for dst R."""
    if not isinstance(x, Tensor):
        raise CollectiveError(
            f"hca.collectives.{kind.value}: the value {x!r} is a {type(x).__name__}, not a tensor; pass this rank's tensor"
        )
    rule = RULES[kind]
    back_params = rule.transpose_params(params)
    # A cotangent that arrives as the whole gradient on every rank (dst R) is
    # already summed: of a summing transpose only its local part is left.
    local = already_summed(rule.transpose) if dst.kind == "R" else None
    steps = (rule.transpose,) if local is None else local
    return _Collective.apply(x, where, (_step(kind, **params),), tuple(_step(k, **back_params) for k in steps))


# ------------------------------------------------------------ role checks


def _reject(op: str, src: Role, dst: Role, why: str) -> RoleError:
    return RoleError(f"hca.collectives.{op}(src='{src}', dst='{dst}'): {why}")


def _dst_same_everywhere(op: str, src: Role, dst: Role) -> None:
    if dst.kind not in ("R", "I"):
        raise _reject(
            op,
            src,
            dst,
            (
                f"the result of {op} is the same on every rank, so dst must be 'R' (its gradient is the "
                "same on every rank, e.g. a loss every rank calls backward on) or 'I' (each rank's gradient "
                "is a summand, e.g. it feeds a column-parallel matmul)"
                + ("; for a shard of a sum use reduce_scatter(src='P', dst='S(d)')" if op == "all_reduce" else "")
            ),
        )


def _src_partial(op: str, src: Role, dst: Role, n: int) -> None:
    if src.kind in ("R", "I"):
        raise _reject(
            op,
            src,
            dst,
            (
                f"a value declared {src} is already the same on every rank; {op} sums it over the "
                f"{n} ranks, counting it {n} times. Declare src='P' if each rank holds a summand, or do "
                "not reduce it"
                + (" (take this rank's shard with x.chunk(n, d)[rank])" if op == "reduce_scatter" else "")
            ),
        )
    if src.kind != "P":
        raise _reject(
            op,
            src,
            dst,
            (
                f"{op} sums its input over the ranks, so src must be 'P'; if the value is the sum of "
                f"the ranks' values declare src='P', and to collect {src} pieces use all_gather(src='{src}')"
            ),
        )


# --------------------------------------------------------- the collectives


def all_reduce(x: Tensor, src: Any, dst: Any, *, group: Any = None, mesh_dim: int | str | None = None) -> Tensor:
    """Sum `x` over the group; every rank gets the sum. Accepts P -> R and P -> I.

    ::

        +a                     backward, dst R:  g  <=  g          (the loss case)
        +b  =>  a+b+c          backward, dst I:  g0+g1+g2  <=  +g0 +g1 +g2
        +c
    """
    src, dst = role(src), role(dst)
    where = where_of(group, mesh_dim)
    _src_partial("all_reduce", src, dst, where.size)
    _dst_same_everywhere("all_reduce", src, dst)
    return _differentiable(x, where, Kind.ALL_REDUCE, dst)


def all_gather(x: Tensor, src: Any, dst: Any, *, group: Any = None, mesh_dim: int | str | None = None) -> Tensor:
    """Concatenate the ranks' shards (S(d) -> R | I), or stack their values on a new dim 0 (V -> R | I).

    ::

        [a]                     backward, dst R: this rank's chunk of the gradient (no communication)
        [b]  =>  [a b c]        backward, dst I: reduce_scatter of the ranks' gradients
        [c]
    """
    src, dst = role(src), role(dst)
    where = where_of(group, mesh_dim)
    if src.kind in ("R", "I"):
        raise _reject(
            "all_gather",
            src,
            dst,
            "the value is already whole on every rank; there is nothing to gather, use it as it is",
        )
    if src.kind == "P":
        raise _reject(
            "all_gather",
            src,
            dst,
            (
                "a partial value must be summed, not gathered: all_reduce(src='P', dst='R'), "
                "or reduce_scatter then all_gather"
            ),
        )
    _dst_same_everywhere("all_gather", src, dst)
    if src.kind == "V":
        return _differentiable(x.unsqueeze(0), where, Kind.ALL_GATHER, dst, dim=0)
    return _differentiable(x, where, Kind.ALL_GATHER, dst, dim=src.dim)


def reduce_scatter(x: Tensor, src: Any, dst: Any, *, group: Any = None, mesh_dim: int | str | None = None) -> Tensor:
    """This rank's shard of the sum over the group: P -> S(d), or P -> V (input (n, ...), row `rank`).

    ::

        +[a0 b0 c0]      [a0+a1+a2]
        +[a1 b1 c1]  =>  [b0+b1+b2]      backward: all_gather of the shard gradients
        +[a2 b2 c2]      [c0+c1+c2]
    """
    src, dst = role(src), role(dst)
    where = where_of(group, mesh_dim)
    _src_partial("reduce_scatter", src, dst, where.size)
    if dst.kind not in ("S", "V"):
        raise _reject(
            "reduce_scatter",
            src,
            dst,
            (
                "reduce_scatter leaves each rank a different shard, so dst must be 'S(d)' or 'V'; "
                "for the whole sum on every rank use all_reduce(src='P', dst='R')"
            ),
        )
    if dst.kind == "S":
        return _differentiable(x, where, Kind.REDUCE_SCATTER, dst, dim=dst.dim)
    if x.dim() == 0 or x.shape[0] != where.size:
        raise CollectiveError(
            f"hca.collectives.reduce_scatter(src='P', dst='V'): the input's dim 0 must be the group "
            f"size {where.size} (one row per rank), got shape {tuple(x.shape)}; or declare dst='S(0)'"
        )
    return _differentiable(x, where, Kind.REDUCE_SCATTER, dst, dim=0).squeeze(0)


def all_to_all(x: Tensor, src: Any, dst: Any, *, group: Any = None, mesh_dim: int | str | None = None) -> Tensor:
    """Trade this rank's shard along dim a for its shard along dim b: S(a) -> S(b), a != b.

    ::

        [a0 a1 a2]      [a0 b0 c0]
        [b0 b1 b2]  =>  [a1 b1 c1]       (rows: ranks; S(0) -> S(1) of a 3x3 block matrix)
        [c0 c1 c2]      [a2 b2 c2]       backward: all_to_all S(b) -> S(a)
    """
    src, dst = role(src), role(dst)
    where = where_of(group, mesh_dim)
    if src.kind != "S" or dst.kind != "S":
        raise _reject("all_to_all", src, dst, "all_to_all trades one shard for another: write src='S(a)', dst='S(b)'")
    a, b = (d % max(x.dim(), 1) for d in (src.dim, dst.dim))
    if a == b:
        raise _reject(
            "all_to_all",
            src,
            dst,
            "src and dst shard the same dim; the value is already sharded that way, do not move it",
        )
    return _differentiable(x, where, Kind.ALL_TO_ALL, dst, src_dim=src.dim, dst_dim=dst.dim)


def broadcast(
    x: Tensor, src: Any, dst: Any, *, root: int = 0, group: Any = None, mesh_dim: int | str | None = None
) -> Tensor:
    """Every rank gets rank `root`'s value (root: the rank within the group). Accepts V -> R | I.

    ::

        a                    backward, dst R: the root keeps the gradient, the others get zero
        b  =>  b  (root 1)   backward, dst I: the ranks' gradients summed onto the root
        c
    """
    src, dst = role(src), role(dst)
    where = where_of(group, mesh_dim)
    if src.kind in ("R", "I"):
        raise _reject(
            "broadcast", src, dst, "the value is already the same on every rank; there is nothing to broadcast"
        )
    if src.kind != "V":
        raise _reject(
            "broadcast",
            src,
            dst,
            f"broadcast copies the root's value, so src must be 'V' (a {src} value is not the root's alone)",
        )
    _dst_same_everywhere("broadcast", src, dst)
    if isinstance(root, bool) or not isinstance(root, int):
        raise CollectiveError(
            f"hca.collectives.broadcast: root={root!r} must be an int, the root's rank within the group"
        )
    return _differentiable(x, where, Kind.BROADCAST, dst, root=root)


def ppermute(
    x: Tensor,
    src: Any,
    dst: Any,
    *,
    shift: int | None = None,
    perm=None,
    group: Any = None,
    mesh_dim: int | str | None = None,
) -> Tensor:
    """Send this rank's value to rank ``rank + shift`` (mod n), or to ``perm[rank]``. Accepts V | S(d) -> V.

    ::

        a        c
        b   =>   a      (shift 1)      backward: shift -1 (the inverse permutation)
        c        b
    """
    src, dst = role(src), role(dst)
    where = where_of(group, mesh_dim)
    if src.kind not in ("V", "S") or dst.kind != "V":
        raise _reject(
            "ppermute",
            src,
            dst,
            (
                "ppermute moves each rank's value to another rank, so the result differs per rank: "
                "write src='V' (or 'S(d)'), dst='V'"
            ),
        )
    if (shift is None) == (perm is None):
        raise CollectiveError(
            "hca.collectives.ppermute: give exactly one of shift= (a ring shift) or perm= (rank r sends to perm[r])"
        )
    if shift is not None and (isinstance(shift, bool) or not isinstance(shift, int)):
        raise CollectiveError(
            f"hca.collectives.ppermute: shift={shift!r} must be an int (rank r sends to r + shift mod n)"
        )
    route = {"shift": shift} if perm is None else {"perm": tuple(perm)}
    return _differentiable(x, where, Kind.PERMUTE, dst, **route)
