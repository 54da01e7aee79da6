"""The collective kinds the backend emits and reads, each defined once.

Every kind is one section below: its banner names the placements it maps
between (src -> dst) and its transpose; under it sit its emitter and its
registration, which records the transpose kind, how the parameters change
under transposition, the `_c10d_functional` ops the emitter issues, and the
bytes one rank sends in a ring implementation.

An emitter works on one rank's local tensor::

    RULES[kind].emit(x, group_name, **params) -> Tensor

It issues the functional collective and its `wait_tensor`, so the result is
ready to use. The rank and size of the group are looked up from its name;
code traced by Dynamo passes them as ``rank=`` and ``size=`` (the lookup is
opaque to Dynamo).

Every transpose is itself a kind in the table, so the table is closed under
transposition and each pair is checked as an adjoint identity
``<A x, y> = <x, A^T y>`` over the whole mesh (tests/test_collective_table.py).
The transposes are the physical ones. Which one backward needs depends on the
cotangent roles (docs/theory.md, section 4): all_reduce's physical transpose is
all_reduce, but a cotangent that is already the same on every rank needs no
communication (R -> P, the deferred role).

Wire bytes: ``payload`` is the size in bytes of the larger of the op's local
buffers (the full logical buffer for gathers and reductions, this rank's
buffer for all_to_all and permutations), ``n`` the group size; the result is
the bytes one rank sends, averaged over the ranks. A transpose moves as many
bytes as its forward (the same links, reversed).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._torch_private import group_rank, group_size
from ..errors import CheckError, CollectiveError
from .placements import letter

c10d = torch.ops._c10d_functional
Tensor = torch.Tensor


class Kind(enum.Enum):
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_REDUCE = "all_reduce"
    SCALED_ALL_REDUCE = "scaled_all_reduce"
    WEIGHTED_ALL_REDUCE = "weighted_all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    PERMUTE = "permute"
    LOCAL_CHUNK = "local_chunk"
    ZERO_EMBED = "zero_embed"
    GATHER = "gather"
    INDEX_ADD = "index_add"
    KEEP_ROOT = "keep_root"


def _same(params: dict) -> dict:
    return dict(params)


@dataclass(frozen=True)
class KindRule:
    kind: Kind
    placements: str  # "src -> dst"
    transpose: Kind  # the physical adjoint, itself a kind of this table
    wire_bytes: Callable[[int, int], float]  # (payload S, group size n) -> bytes per rank
    emit: Callable[..., Tensor]  # (x, group_name, **params) -> Tensor, waited
    ops: tuple = ()  # the _c10d_functional ops `emit` issues, each followed by one wait
    transpose_params: Callable[[dict], dict] = _same  # params of A -> params of A^T

    @property
    def communicates(self) -> bool:
        return bool(self.ops)


RULES: dict[Kind, KindRule] = {}


def _kind(kind: Kind, placements: str, transpose: Kind, wire, ops=(), transpose_params=_same):
    """Register the decorated function as `kind`'s emitter, with its rules."""

    def register(body: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if kind in RULES:
            raise CheckError(f"collective kind {kind.value} registered twice")

        def emit(x: Tensor, group_name: str, *, rank: int | None = None, size: int | None = None, **params):
            size = group_size(group_name) if size is None else size
            rank = group_rank(group_name) if rank is None else rank
            return body(x, group_name, rank, size, **params)

        emit.__name__ = emit.__qualname__ = f"emit_{kind.value}"
        emit.__doc__ = body.__doc__
        RULES[kind] = KindRule(kind, placements, transpose, wire, emit, tuple(ops), transpose_params)
        return body

    return register


def bytes_per_rank(kind: Kind, payload: int, group_size: int) -> float:
    """Analytical bytes one rank sends for `kind` on `payload` bytes over `group_size` ranks (ring model)."""
    if group_size < 1 or payload < 0:
        raise CollectiveError(
            f"bytes_per_rank({kind.value}): needs payload >= 0 and group_size >= 1, "
            f"got payload={payload}, group_size={group_size}"
        )
    return float(RULES[kind].wire_bytes(payload, group_size))


def _ring_once(s: int, n: int) -> float:
    return s * (n - 1) / n


def _ring_twice(s: int, n: int) -> float:
    return 2 * s * (n - 1) / n


def _whole(s: int, n: int) -> float:
    return float(s) if n > 1 else 0.0


def _free(s: int, n: int) -> float:
    return 0.0


# ---------------------------------------------------------------- helpers


def _wait(t: Tensor) -> Tensor:
    return c10d.wait_tensor(t)


def _dim(x: Tensor, dim: int, kind: str, ndim: int | None = None) -> int:
    """`dim` made non-negative, for a tensor of `ndim` dims (default: x's)."""
    ndim = x.dim() if ndim is None else ndim
    if not -ndim <= dim < ndim:
        raise CollectiveError(f"{kind}: dim {dim} is out of range for a {ndim}-d tensor (got shape {tuple(x.shape)})")
    return dim % ndim


def _divides(x: Tensor, dim: int, n: int, kind: str) -> int:
    if x.shape[dim] % n:
        raise CollectiveError(
            f"{kind}: dim {dim} of shape {tuple(x.shape)} has size {x.shape[dim]}, which the "
            f"{n} ranks cannot split evenly; pad it to a multiple of {n}"
        )
    return x.shape[dim] // n


def _rank_in(value: int, n: int, what: str, kind: str) -> int:
    if not 0 <= value < n:
        raise CollectiveError(f"{kind}: {what} {value} is not a rank of a group of {n}; use 0..{n - 1}")
    return value


def _front(x: Tensor, dim: int) -> Tensor:
    return x.movedim(dim, 0).contiguous()


def _resized(x: Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = size
    return shape


# ------------------------------------------------------------- the kinds


# broadcast: R(root) -> R         transpose: reduce (sum to root) R -> P(root)
@_kind(Kind.BROADCAST, "R(root) -> R", Kind.REDUCE, _ring_once, ops=(c10d.broadcast.default,))
def _broadcast(x, group_name, rank, n, *, root=0):
    """Every rank receives `root`'s tensor (root is the rank within the group)."""
    _rank_in(root, n, "root", "broadcast")
    return _wait(c10d.broadcast(x.contiguous(), root, group_name))


# reduce: P -> R(root)            transpose: broadcast R(root) -> R
# `_c10d_functional` has no reduce: it is emitted as all_reduce, the other ranks'
# results dropped (twice the model's bytes: the model is the ring reduce).
@_kind(Kind.REDUCE, "P -> R(root)", Kind.BROADCAST, _ring_once, ops=(c10d.all_reduce.default,))
def _reduce(x, group_name, rank, n, *, root=0):
    """The sum over the group on `root`, zeros on the other ranks."""
    _rank_in(root, n, "root", "reduce")
    return _keep_root(_wait(c10d.all_reduce(x.contiguous(), "sum", group_name)), group_name, rank, n, root=root)


# all_reduce: P -> R              transpose: all_reduce (physical; R -> P moves nothing
#                                 when the cotangent is already the same on every rank)
@_kind(Kind.ALL_REDUCE, "P -> R", Kind.ALL_REDUCE, _ring_twice, ops=(c10d.all_reduce.default,))
def _all_reduce(x, group_name, rank, n):
    """The sum over the group, on every rank."""
    return _wait(c10d.all_reduce(x.contiguous(), "sum", group_name))


# scaled all_reduce: P -> R, times `scale` (mean: 1/n)   transpose: the same scaled map
@_kind(Kind.SCALED_ALL_REDUCE, "P -> R (scaled)", Kind.SCALED_ALL_REDUCE, _ring_twice, ops=(c10d.all_reduce.default,))
def _scaled_all_reduce(x, group_name, rank, n, *, scale=None):
    """`scale` times the sum over the group (the mean when `scale` is None)."""
    scale = 1.0 / n if scale is None else scale
    return _wait(c10d.all_reduce(x.contiguous(), "sum", group_name)) * scale


# weighted all_reduce: P -> R, each rank's piece times its own weight (uneven shares: its share
# of the rows, docs/heterogeneous.md)   transpose: the same kind, the weight after the sum
def _weight_moves(params: dict) -> dict:
    return {**params, "after": not params.get("after", False)}


@_kind(
    Kind.WEIGHTED_ALL_REDUCE,
    "P -> R (weighted)",
    Kind.WEIGHTED_ALL_REDUCE,
    _ring_twice,
    ops=(c10d.all_reduce.default,),
    transpose_params=_weight_moves,
)
def _weighted_all_reduce(x, group_name, rank, n, *, weights=None, after=False):
    """The sum over the group of each rank's piece times ``weights[rank]`` (``after``: the sum,
    times this rank's weight: the transpose, which hands each rank its weighted cotangent)."""
    if weights is None or len(weights) != n:
        raise CollectiveError(f"weighted_all_reduce: give one weight per rank of the group of {n}, got {weights!r}")
    w = weights[rank]
    if after:
        return _wait(c10d.all_reduce(x.contiguous(), "sum", group_name)) * w
    return _wait(c10d.all_reduce((x * w).contiguous(), "sum", group_name))


# all_gather: S(d) -> R           transpose: reduce_scatter P -> S(d)
@_kind(Kind.ALL_GATHER, "S(d) -> R", Kind.REDUCE_SCATTER, _ring_once, ops=(c10d.all_gather_into_tensor.default,))
def _all_gather(x, group_name, rank, n, *, dim=0):
    """The shards of the group concatenated along `dim`, on every rank."""
    dim = _dim(x, dim, "all_gather")
    return _wait(c10d.all_gather_into_tensor(_front(x, dim), n, group_name)).movedim(0, dim)


# reduce_scatter: P -> S(d)       transpose: all_gather S(d) -> R
@_kind(Kind.REDUCE_SCATTER, "P -> S(d)", Kind.ALL_GATHER, _ring_once, ops=(c10d.reduce_scatter_tensor.default,))
def _reduce_scatter(x, group_name, rank, n, *, dim=0):
    """This rank's shard along `dim` of the sum over the group."""
    dim = _dim(x, dim, "reduce_scatter")
    _divides(x, dim, n, "reduce_scatter")
    return _wait(c10d.reduce_scatter_tensor(_front(x, dim), "sum", n, group_name)).movedim(0, dim)


def _swap_dims(params: dict) -> dict:
    return {"src_dim": params["dst_dim"], "dst_dim": params["src_dim"]}


# all_to_all: S(a) -> S(b)        transpose: all_to_all S(b) -> S(a)
@_kind(
    Kind.ALL_TO_ALL,
    "S(a) -> S(b)",
    Kind.ALL_TO_ALL,
    _ring_once,
    ops=(c10d.all_to_all_single.default,),
    transpose_params=_swap_dims,
)
def _all_to_all(x, group_name, rank, n, *, src_dim, dst_dim):
    """Trade a shard along `src_dim` for a shard along `dst_dim`."""
    a, b = _dim(x, src_dim, "all_to_all"), _dim(x, dst_dim, "all_to_all")
    if a == b:
        raise CollectiveError(f"all_to_all: src_dim and dst_dim are both {a}; they must differ")
    _divides(x, b, n, "all_to_all")
    blocks = torch.stack(x.chunk(n, b))  # row j goes to rank j
    got = _wait(c10d.all_to_all_single(blocks, [1] * n, [1] * n, group_name))
    return torch.cat(got.unbind(0), a)  # row j came from rank j, whose shard is j-th along a


def _inverse_route(params: dict) -> dict:
    if params.get("perm") is not None:
        perm = params["perm"]
        return {"perm": tuple(sorted(range(len(perm)), key=perm.__getitem__))}
    return {"shift": -params.get("shift", 0)}


def _destination(rank: int, n: int, shift: int, perm) -> tuple[int, int]:
    """(where this rank's buffer goes, whose buffer this rank receives)."""
    if perm is None:
        return (rank + shift) % n, (rank - shift) % n
    if sorted(perm) != list(range(n)):
        raise CollectiveError(f"permute: perm {tuple(perm)} is not a permutation of the {n} ranks 0..{n - 1}")
    return perm[rank], list(perm).index(rank)


# permute: V -> V, rank r's buffer to rank perm[r] (ring shift k: r + k)
#                                 transpose: the inverse permutation (shift -k)
# Emitted as all_to_all_single whose split sizes send the whole buffer to one peer.
@_kind(
    Kind.PERMUTE, "V -> V", Kind.PERMUTE, _whole, ops=(c10d.all_to_all_single.default,), transpose_params=_inverse_route
)
def _permute(x, group_name, rank, n, *, shift=0, perm=None):
    """Send this rank's buffer to rank ``perm[rank]`` (or ``rank + shift`` mod n)."""
    dest, source = _destination(rank, n, shift, perm)
    row = x.reshape(1, -1).contiguous()
    send = [int(j == dest) for j in range(n)]
    recv = [int(j == source) for j in range(n)]
    return _wait(c10d.all_to_all_single(row, recv, send, group_name)).reshape(x.shape)


# local chunk: R -> S(d)          transpose: zero-embed S(d) -> P        (no communication)
@_kind(Kind.LOCAL_CHUNK, "R -> S(d)", Kind.ZERO_EMBED, _free)
def _local_chunk(x, group_name, rank, n, *, dim=0):
    """This rank's shard of `x` along `dim` (a copy)."""
    dim = _dim(x, dim, "local_chunk")
    m = _divides(x, dim, n, "local_chunk")
    return x.narrow(dim, rank * m, m).clone()


# zero-embed: S(d) -> P           transpose: local chunk R -> S(d)       (no communication)
@_kind(Kind.ZERO_EMBED, "S(d) -> P", Kind.LOCAL_CHUNK, _free)
def _zero_embed(x, group_name, rank, n, *, dim=0):
    """`x` in its shard's place along `dim`, zeros around it: summed over ranks, the full tensor."""
    dim = _dim(x, dim, "zero_embed")
    m = x.shape[dim]
    return x.new_zeros(_resized(x, dim, m * n)).slice_scatter(x, dim, rank * m, (rank + 1) * m)


# gather: rows `index` of x (index_select, embedding; repeats allowed)
#                                 transpose: index_add into zeros         (no communication)
@_kind(Kind.GATHER, "any -> same (local)", Kind.INDEX_ADD, _free)
def _gather(x, group_name, rank, n, *, index, dim=0, length=None):
    """``x.index_select(dim, index)``; an n-d index replaces `dim` by its shape (embedding)."""
    dim = _dim(x, dim, "gather")
    rows = x.index_select(dim, index.reshape(-1))
    return rows.reshape(x.shape[:dim] + index.shape + x.shape[dim + 1 :])


# index_add: scatter-add rows into zeros of length `length`   transpose: gather  (no communication)
@_kind(Kind.INDEX_ADD, "any -> same (local)", Kind.GATHER, _free)
def _index_add(x, group_name, rank, n, *, index, length, dim=0):
    """Zeros of length `length` along `dim`, with row ``i`` of `x` added at ``index[i]``."""
    # `dim` counts in the result (the tensor gathered from), where the index's dims are one.
    dim = _dim(x, dim, "index_add", ndim=x.dim() - index.dim() + 1)
    x = x.reshape(x.shape[:dim] + (index.numel(),) + x.shape[dim + index.dim() :])
    return x.new_zeros(_resized(x, dim, length)).index_add(dim, index.reshape(-1), x)


# keep root: R -> R(root)          transpose: keep root (a projection)   (no communication)
# What is left of reduce when its input is already summed.
@_kind(Kind.KEEP_ROOT, "R -> R(root)", Kind.KEEP_ROOT, _free)
def _keep_root(x, group_name, rank, n, *, root=0):
    """`x` itself on `root`, zeros on the other ranks."""
    _rank_in(root, n, "root", "keep_root")
    return x if rank == root else torch.zeros_like(x)


def _ends(kind: Kind) -> tuple[str, str]:
    src, dst = RULES[kind].placements.split(" -> ")
    return src, dst


def already_summed(kind: Kind) -> tuple[Kind, ...] | None:
    """What is left of `kind`, a sum over the group (P -> X), when its input is already summed.

    That is the move R -> X: nothing when X is R, else the local kind the table
    registers for R -> X (reduce_scatter: local chunk; reduce: keep root).
    None when `kind` does not sum, or the table has no local R -> X.
    """
    src, dst = _ends(kind)
    if src != "P":
        return None
    if dst == "R":
        return ()
    local = tuple(k for k, r in RULES.items() if not r.communicates and _ends(k) == ("R", dst))
    return local or None


def emit(kind: Kind, x: Tensor, group_name: str, **params: Any) -> Tensor:
    """Shorthand for ``RULES[kind].emit(x, group_name, **params)``."""
    return RULES[kind].emit(x, group_name, **params)


def emit_transpose(kind: Kind, y: Tensor, group_name: str, **params: Any) -> Tensor:
    """Apply the transpose of ``kind`` (with ``params``) to `y`."""
    rule = RULES[kind]
    coords = {k: params.pop(k) for k in ("rank", "size") if k in params}
    return RULES[rule.transpose].emit(y, group_name, **coords, **rule.transpose_params(params))


# ----------------------------------------------------------------- moves
# A move changes one mesh dimension of a value's layout, from `src` to `dst`,
# each a letter: R, P or S<d>. The layout solver costs a move's forward and
# backward from these functions and the transpose pass checks a backward
# collective against them: one definition of what a move sends and owes.


def cotangent_letter(p, varying: bool = False) -> str:
    """The placement of the cotangent of a value laid out as `p`, as its consumers hand it back.

    A replicated value's cotangent is partial when its consumers used it
    differently on each rank (`varying`: each holds a summand), else replicated.
    """
    p = p if isinstance(p, str) else letter(p)
    if p == "R":
        return "P" if varying else "R"
    return "R" if p == "P" else p


def move_kind(src: str, dst: str) -> Kind | None:
    """The collective that moves one mesh dimension from `src` to `dst` (None: a local step)."""
    if src == dst or src == "R":
        return None  # R -> S is a local chunk, R -> P keeps one summand
    if src == "P":
        return Kind.ALL_REDUCE if dst == "R" else Kind.REDUCE_SCATTER
    if dst in ("R", "P"):
        return Kind.ALL_GATHER
    return Kind.ALL_TO_ALL


def backward_kinds(src: str, dst: str) -> frozenset[Kind]:
    """The collectives the backward of the move `src` -> `dst` may issue on its mesh dimension.

    The backward moves the cotangent from how it arrives (`dst`'s cotangent,
    partial or not) to `src`'s cotangent; a replicated source also owes the
    sum of a partial cotangent (the cotangent reduction, P -> R). So does a move into P
    (S(d) -> P, P -> P): its cotangent may arrive partial, as DTensor keeps P -> P in the
    backward, and each summand's cotangent is the whole, so it is summed there (a vocabulary-
    parallel embedding's partial rows under a residual stream whose readers are column-parallel).
    Gloo has no all_to_all: DTensor moves S(a) -> S(b) there as an all_gather and keeps its piece.
    """
    arrives = [cotangent_letter(dst, varying) for varying in (False, True)] + (["P"] if dst == "P" else [])
    kinds = {move_kind(c, cotangent_letter(src)) for c in arrives}
    if src == "R" or dst == "P":
        kinds.add(Kind.ALL_REDUCE)
    if Kind.ALL_TO_ALL in kinds:
        kinds.add(Kind.ALL_GATHER)
    return frozenset(kinds - {None})
