"""Ground truth for DTensor's sharding rules, one op family at a time.

Used by tests/test_op_families.py; plain module, no pytest here.

Every rank runs in this process under `LocalTensorMode`: an input's per-rank
pieces are cut by hand from one single-device tensor, wrapped as one
`LocalTensor`, and handed to DTensor with `DTensor.from_local`. Not by DTensor's
own `distribute_tensor`: the truth must not share code with what it checks, and
under LocalTensorMode (torch 2.13) it hands every rank the same piece for a
_StridedShard on a 1-D mesh or on mesh dim 0. DTensor then runs the op on every rank's piece. The
output's per-rank pieces are put back together by hand from the placements
DTensor claims for it and compared with the op on the whole tensors::

    x ──cut by placements──▶ {rank: piece} ──DTensor op──▶ {rank: out piece}
    │                                                        │ reassemble by the
    ▼                                                        ▼ claimed placements
    op(x) ─────────────────────── compare ─────────────── out

Cutting, per mesh dim in order (mesh dim 0 outermost), for each coordinate i
along a mesh dim of size n:
    Replicate           the same tensor
    Shard(d)            torch.chunk(t, n, d)[i]
    _StridedShard(d, k) chunk i of each of k equal blocks along d, concatenated
    Partial             n random summands of t (the last one makes the sum exact)
Reassembling undoes it, innermost mesh dim first: Shard concatenates, Partial
reduces by its op, Replicate checks that every copy agrees and keeps one.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torch_hca.compiler import attention as hca_attention
from torch_hca._torch_private import record_implicit_redistributions

try:  # only to stop at the first implicit move instead of performing it: a speed-up
    from torch.distributed.tensor._utils import ExplicitRedistributionContext

    def _stop_at_first_move():
        return ExplicitRedistributionContext(strict=True, mode="raise")
except ImportError:  # moved in a later torch: the recorder alone still decides, only slower
    import contextlib

    _stop_at_first_move = contextlib.nullcontext

RTOL = 1e-5  # fp32: max |out - ref| relative to max |ref|


# ------------------------------------------------------------------ families


@dataclass(frozen=True)
class Arg:
    """One tensor input: its shape, and for an index tensor the bound of its values."""

    shape: tuple[int, ...]
    index_high: int | None = None  # int64 values in [0, index_high)
    extra: tuple = ()  # placements to try besides the usual ones

    def make(self, gen: torch.Generator) -> torch.Tensor:
        if self.index_high is not None:
            return torch.randint(0, self.index_high, self.shape, generator=gen)
        return torch.randn(self.shape, generator=gen)

    def options(self) -> list:
        """Placements worth trying on one mesh dim: R, S(d) per dim, P for float values."""
        opts = [Replicate(), *(Shard(d) for d in range(len(self.shape))), *self.extra]
        return opts if self.index_high is not None else [*opts, Partial()]


@dataclass(frozen=True)
class Family:
    name: str
    fn: Callable[..., torch.Tensor]
    args: tuple[Arg, ...]


B, S, D, H = 4, 8, 8, 4  # batch, sequence, model dim, heads (head dim D // H = 2)
V, O = 16, 12  # vocabulary, linear out features
X3 = Arg((B, S, D))

FAMILIES: tuple[Family, ...] = (
    Family("linear_2d", F.linear, (Arg((B * S, D)), Arg((O, D)))),
    Family("linear_2d_bias", F.linear, (Arg((B * S, D)), Arg((O, D)), Arg((O,)))),
    Family("linear_3d", F.linear, (X3, Arg((O, D)))),
    Family("linear_3d_bias", F.linear, (X3, Arg((O, D)), Arg((O,)))),
    Family("matmul_3d", torch.matmul, (Arg((B, S, D)), Arg((B, D, S)))),
    Family("bmm", torch.bmm, (Arg((B, S, D)), Arg((B, D, S)))),
    Family("matmul_4d", torch.matmul, (Arg((B, H, S, 4)), Arg((B, H, 4, S)))),
    Family("gelu", F.gelu, (X3,)),
    Family("relu", F.relu, (X3,)),
    Family("add", torch.add, (X3, X3)),
    Family("add_broadcast", torch.add, (X3, Arg((D,)))),
    Family("mul_broadcast", torch.mul, (X3, Arg((B, 1, D)))),
    Family("add_scalar", lambda x: x + 2.5, (X3,)),
    Family("mul_scalar", lambda x: x * 3.0, (X3,)),
    Family("layer_norm", lambda x, w, b: F.layer_norm(x, (D,), w, b), (X3, Arg((D,)), Arg((D,)))),
    Family("softmax", lambda x: torch.softmax(x, dim=-1), (X3,)),
    Family("view_heads", lambda x: x.view(B, S, H, D // H), (X3,)),
    Family("reshape_heads_transpose", lambda x: x.reshape(B, S, H, D // H).transpose(1, 2), (X3,)),
    Family("merge_heads", lambda x: x.transpose(1, 2).reshape(B, S, D), (Arg((B, H, S, D // H)),)),
    Family("transpose", lambda x: x.transpose(1, 2), (X3,)),
    Family("flatten_tokens", lambda x: x.reshape(B * S, D), (X3,)),
    # Flattened tokens, also as flatten_tokens leaves them when the sequence is sharded:
    # _S(0, 4) for Shard(1) on one mesh dim, (Shard(0), _S(0, 2)) for (Shard(0), Shard(1)).
    Family(
        "unflatten_tokens",
        lambda x: x.view(B, S, D),
        (Arg((B * S, D), extra=(_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=4))),),
    ),
    Family("embedding", F.embedding, (Arg((B, S), index_high=V), Arg((V, D)))),
    Family("sum_dim", lambda x: x.sum(dim=1), (X3,)),
    Family("mean_dim", lambda x: x.mean(dim=-1), (X3,)),
    Family("cross_entropy", F.cross_entropy, (Arg((B * S, V)), Arg((B * S,), index_high=V))),
    Family(
        "cross_entropy_sum",
        lambda x, t: F.cross_entropy(x, t, reduction="sum"),
        (Arg((B * S, V)), Arg((B * S,), index_high=V)),
    ),
)
# The zoo's own ops: hca::attention (grouped-query heads, an additive [b, 1, L, S] mask) and a
# convolution, whose DTensor rule the layout solver restricts (layout_candidates.BATCH_SPLIT_ONLY).
FAMILIES += (
    Family(
        "hca_attention_gqa_mask",
        lambda q, k, v, m: hca_attention.sdpa(q, k, v, attn_mask=m, enable_gqa=True),
        (Arg((B, H, S, 2)), Arg((B, 2, S, 2)), Arg((B, 2, S, 2)), Arg((B, 1, S, S))),
    ),
    Family("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), (Arg((B, 2, 4, 4)), Arg((4, 2, 3, 3)), Arg((4,)))),
)
BY_NAME = {f.name: f for f in FAMILIES}


# ---------------------------------------------------------- cut and reassemble


def _coords(mesh) -> dict[int, tuple[int, ...]]:
    grid = mesh.mesh
    return {int(grid[c]): c for c in itertools.product(*(range(n) for n in grid.shape))}


# Two _StridedShard on one tensor dim: DTensor's own gather (full_tensor, real gloo
# ranks, torch 2.13) does not invert the left-to-right cut when their split factors
# differ, so their meaning is not settled; inputs avoid them, outputs are refused.
_UNSETTLED = "two _StridedShard on one tensor dim with different split factors"


def _unsettled(placements) -> bool:
    strided = {(p.dim, int(p.split_factor)) for p in placements if isinstance(p, _StridedShard)}
    return len(strided) != len({d for d, _ in strided})


def cut(x: torch.Tensor, mesh, placements: Sequence, gen: torch.Generator) -> dict[int, torch.Tensor] | None:
    """Each rank's piece of `x` under `placements`; None if a Shard does not divide
    evenly, or for placements whose meaning is not settled (_UNSETTLED)."""
    if _unsettled(placements):
        return None
    pieces: dict[tuple[int, ...], torch.Tensor] = {(): x}
    for n, p in zip(mesh.mesh.shape, placements):
        nxt = {}
        for c, t in pieces.items():
            if isinstance(p, (Shard, _StridedShard)):
                sf = int(p.split_factor) if isinstance(p, _StridedShard) else 1
                if t.size(p.dim) % (n * sf):
                    return None
                blocks = [b.chunk(n, p.dim) for b in t.chunk(sf, p.dim)]
                parts = [torch.cat([b[i] for b in blocks], p.dim) for i in range(n)]
            elif isinstance(p, Partial):
                parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
                parts.append(t - sum(parts))
            elif isinstance(p, Replicate):
                parts = [t] * n
            else:
                raise ValueError(f"no cut for placement {p}")
            nxt.update({(*c, i): part for i, part in enumerate(parts)})
        pieces = nxt
    return {r: pieces[c].contiguous().clone() for r, c in _coords(mesh).items()}


class Mismatch(AssertionError):
    """A claimed placement that the per-rank pieces do not satisfy."""


def _merge(parts: list[torch.Tensor], p) -> torch.Tensor:
    """Undo one mesh dim's cut: the pieces in coordinate order along it."""
    if isinstance(p, _StridedShard):  # rank i holds its chunk of each of split_factor blocks
        sf = int(p.split_factor)
        blocks = [part.chunk(sf, p.dim) for part in parts]
        return torch.cat([blocks[i][j] for j in range(sf) for i in range(len(parts))], p.dim)
    if isinstance(p, Shard):
        return torch.cat(parts, p.dim)
    if isinstance(p, Partial):
        reduce = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}
        if p.reduce_op not in reduce:
            raise Mismatch(f"no reassembly for Partial({p.reduce_op})")
        return reduce[p.reduce_op](torch.stack(parts), dim=0)
    if isinstance(p, Replicate):
        for i, part in enumerate(parts[1:], 1):
            if part.shape != parts[0].shape or rel_err(part, parts[0]) > RTOL:
                raise Mismatch(f"Replicate, but coordinate {i} differs from coordinate 0")
        return parts[0]
    raise Mismatch(f"no reassembly for placement {p}")


def _mesh_dim_order(spec) -> list[int]:
    """Mesh dims outermost first: ascending, unless the spec's shard order says otherwise."""
    order = list(range(spec.mesh.ndim))
    for entry in spec.shard_order or ():
        dims = list(entry.mesh_dims)
        if dims != sorted(dims):
            if spec.mesh.ndim != 2:
                raise Mismatch(f"no reassembly for shard order {spec.shard_order}")
            order = dims
    return order


def reassemble(locals_: dict[int, torch.Tensor], spec) -> torch.Tensor:
    """The global tensor that per-rank pieces make under `spec` (placements, shard order)."""
    if _unsettled(spec.placements):
        raise Mismatch(f"no reassembly for {spec.placements}: {_UNSETTLED}")
    pieces = {c: locals_[r] for r, c in _coords(spec.mesh).items()}
    for k in reversed(_mesh_dim_order(spec)):  # innermost first
        groups: dict[tuple, list] = {}
        for c in sorted(pieces):
            groups.setdefault(c[:k] + (None,) + c[k + 1 :], []).append(pieces[c])
        pieces = {key: _merge(parts, spec.placements[k]) for key, parts in groups.items()}
    (out,) = pieces.values()
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


# ------------------------------------------------------------------ running


@dataclass
class Outcome:
    placements: tuple  # per input: its placements tuple
    accepted: bool
    reason: str = ""  # why not accepted: the implicit moves, or DTensor's error
    out_spec: object = None
    out_locals: dict[int, torch.Tensor] = field(default_factory=dict)
    reference: torch.Tensor | None = None

    @property
    def sharded(self) -> bool:
        return any(not isinstance(p, Replicate) for ps in self.placements for p in ps)

    def describe(self) -> str:
        ins = ", ".join("(" + ", ".join(map(str, ps)) + ")" for ps in self.placements)
        out = tuple(self.out_spec.placements) if self.out_spec is not None else None
        return f"inputs [{ins}] -> output {out}"


def run(family: Family, mesh, placements: Sequence[tuple], seed: int = 0) -> Outcome | None:
    """Run `family` through DTensor on every rank; None if a Shard does not divide evenly."""
    gen = torch.Generator().manual_seed(seed)
    values = [a.make(gen) for a in family.args]
    pieces = [cut(v, mesh, ps, gen) for v, ps in zip(values, placements)]
    if any(p is None for p in pieces):
        return None
    outcome = Outcome(tuple(tuple(ps) for ps in placements), accepted=False)
    with LocalTensorMode(mesh.size()):
        args = [
            DTensor.from_local(LocalTensor(pc), mesh, ps, run_check=False, shape=v.shape, stride=v.stride())
            for pc, ps, v in zip(pieces, placements, values)
        ]
        events: list = []
        try:
            with record_implicit_redistributions() as events, _stop_at_first_move():
                out = family.fn(*args)
        except Exception as e:  # the recorder saw a move first, or DTensor has no rule
            if not events:
                outcome.reason = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                return outcome
    if events:
        moves = "; ".join(f"{e.op} arg {e.arg_index}: {e.src.placements} -> {e.dst.placements}" for e in events)
        outcome.reason = f"implicit redistribution: {moves}"
        return outcome
    outcome.accepted = True
    outcome.out_spec = out._spec
    outcome.out_locals = {r: t.clone() for r, t in out._local_tensor._local_tensors.items()}
    outcome.reference = family.fn(*values)
    return outcome


def check(outcome: Outcome, spec=None) -> float:
    """Relative error of the reassembled output (by `spec`, default the claimed one)."""
    spec = spec or outcome.out_spec
    got = reassemble(outcome.out_locals, spec)
    if got.shape != outcome.reference.shape:
        raise Mismatch(f"reassembled shape {tuple(got.shape)}, expected {tuple(outcome.reference.shape)}")
    return rel_err(got, outcome.reference)


def combos_1d(family: Family) -> list[list[tuple]]:
    """Every choice of one placement per input on a 1-D mesh."""
    return [[(p,) for p in choice] for choice in itertools.product(*(a.options() for a in family.args))]


def combos_2d(
    family: Family, accepted_1d: list[Sequence[tuple]], extra: int, cap: int, seed: int, full_up_to: int
) -> list[list[tuple]]:
    """2-D candidates: all choices if there are at most `full_up_to`; else pairs of
    combinations accepted on a 1-D mesh (one per mesh dim), at most `cap` of them,
    plus `extra` drawn from all choices."""
    options = [[(p, q) for p in a.options() for q in a.options()] for a in family.args]
    every = [list(c) for c in itertools.product(*options)]
    if len(every) <= full_up_to:
        return every
    rng = random.Random(seed)
    pairs = [[(a, b) for (a,), (b,) in zip(c0, c1)] for c0 in accepted_1d for c1 in accepted_1d]
    rng.shuffle(pairs)
    return pairs[:cap] + [list(rng.choice(every)) for _ in range(extra)]
