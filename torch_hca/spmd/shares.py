"""Uneven shards: a dimension cut by shares, one per rank of a mesh dimension (docs/heterogeneous.md).

``hca.Shard(0, shares=(1, 3))`` says: along this mesh dimension, the rank at
coordinate c holds ``shares[c] / sum(shares)`` of the tensor's dim 0. It is a
torch ``Shard`` (every rule that reads a ``Shard`` reads it as one), carrying
its shares for the parts of the compiler that must know them: the weights of
a mean over ranks (`weight`), the input agreement check (`rows_agree`), the
marker text of the logical program (`share_text` / `read_share_text`).

The shares are exact proportions, not rounding targets: a piece of ``r`` rows
on a rank of share ``s`` says the whole has ``r * sum(shares) / s`` rows, so
every rank knows the whole from its own piece and the weight ``s / sum(shares)``
of its rows in a mean is exact.
"""

from __future__ import annotations

import math
from numbers import Integral

from torch.distributed.tensor import Shard as TorchShard

from torch_hca.errors import PlacementError


class UnevenShard(TorchShard):
    """``Shard(dim)`` whose pieces are in proportion to `shares`, one per rank of its mesh dimension."""

    def __init__(self, dim: int, shares: tuple[int, ...]):
        super().__init__(dim)
        self.shares = check_shares(shares, f"Shard({dim}, shares=...)")
        # Read by code Dynamo traces as text: a string stays a constant, while ints that
        # differ between two modules' compiles of one frame would turn symbolic.
        self.text = ":".join(map(str, self.shares))

    def __str__(self) -> str:
        return f"S({self.dim}, shares={self.text})"

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim}, shares={self.shares})"

    def __reduce__(self):
        return UnevenShard, (self.dim, self.shares)


class Shard(TorchShard):
    """``hca.Shard(dim)``: torch's ``Shard``; ``hca.Shard(dim, shares=(1, 3))``: an `UnevenShard`."""

    def __new__(cls, dim: int, shares: tuple[int, ...] | None = None):
        return TorchShard(dim) if shares is None else UnevenShard(dim, shares)


def check_shares(shares, what: str) -> tuple[int, ...]:
    """`shares` as a tuple of positive ints, or a `PlacementError` saying what to write."""
    if (
        not isinstance(shares, (tuple, list))
        or not shares
        or not all(isinstance(s, Integral) and not isinstance(s, bool) for s in shares)
    ):
        raise PlacementError(
            f"{what}: shares={shares!r}; give one positive integer per rank of the mesh dimension, "
            "in proportion to what each rank can do: shares=(1, 3) gives the second rank 3/4 of the rows"
        )
    if any(s <= 0 for s in shares):
        raise PlacementError(
            f"{what}: shares={tuple(shares)} has a share <= 0; every rank along the dimension holds a piece: "
            "give each a positive share, or build the mesh without the rank that should hold nothing"
        )
    return tuple(int(s) for s in shares)


def check_mesh_fit(layout, mesh_shape, what: str) -> None:
    """Each `UnevenShard` names one share per rank of its mesh dimension; at most one per layout."""
    uneven = [(d, p) for d, p in enumerate(layout) if isinstance(p, UnevenShard)]
    for mesh_dim, p in uneven:
        if len(p.shares) != mesh_shape[mesh_dim]:
            raise PlacementError(
                f"{what}: {p!r} gives {len(p.shares)} shares on mesh dim {mesh_dim}, which has "
                f"{mesh_shape[mesh_dim]} ranks; give one share per rank"
            )
    if len(uneven) > 1:
        raise PlacementError(f"{what}: shares on {len(uneven)} mesh dims; give shares on one mesh dim only")


def uneven_dims(layout) -> list[tuple[int, UnevenShard]]:
    """(mesh dim, placement) of each `UnevenShard` in `layout` (a layout of None has none)."""
    return [(d, p) for d, p in enumerate(layout or ()) if isinstance(p, UnevenShard)]


def even(layout):
    """`layout` as DTensor runs it: each `UnevenShard` as the even ``Shard`` of this rank's own rows."""
    return tuple(TorchShard(p.dim) if isinstance(p, UnevenShard) else p for p in layout)


def weight(shares: tuple[int, ...], coordinate: int) -> float:
    """The weight of the rows of the rank at `coordinate` in a mean over all rows: its share of them."""
    return shares[coordinate] / sum(shares)


def rows_agree(shares: tuple[int, ...], rows: dict[int, int]) -> bool:
    """Whether pieces of `rows` (coordinate -> rows) are in exact proportion to `shares`."""
    return all(rows[a] * shares[b] == rows[b] * shares[a] for a in rows for b in rows)


def rows_for(shares: tuple[int, ...], total: int) -> tuple[int, ...] | None:
    """Each rank's rows of a whole of `total` rows cut by `shares`; None where they do not divide."""
    g = math.gcd(*shares)
    unit, rest = divmod(total, sum(shares) // g)
    return None if rest else tuple(unit * s // g for s in shares)


def smallest_whole(shares: tuple[int, ...]) -> int:
    """The smallest whole that `shares` cut exactly: the sum of the shares over their gcd."""
    return sum(shares) // math.gcd(*shares)


# ----------------------------------------------------------------------------- marker text


def share_text(p) -> str:
    """``"S0"`` for a Shard, ``"S0/1:3"`` for an `UnevenShard`: the suffix carries the shares."""
    return f"/{p.text}" if isinstance(p, UnevenShard) else ""


def read_share_text(text: str) -> tuple[str, tuple[int, ...] | None]:
    """The inverse of `share_text` on one placement's marker text: (``"S0"``, shares or None)."""
    head, _, shares = text.partition("/")
    return head, tuple(int(s) for s in shares.split(":")) if shares else None


# ----------------------------------------------------------------------------- shares from speeds


def rows_by_speed(speeds, total: int, min_rows: int = 2, fixed=None) -> tuple[int, ...]:
    """Each rank's rows of `total` rows for ranks of relative `speeds`: the split whose slowest
    rank, ``max(fixed[i] + rows[i] / speeds[i])``, finishes first, every rank holding at least
    `min_rows`. ``fixed``: each rank's time a step costs it whatever its rows (default 0, in the
    unit of ``rows / speeds``): a slow rank pays its fixed part slowly too, so it gets fewer rows.

    Water-filling: from `min_rows` each, every further row goes to the rank that would finish it
    soonest, ``fixed[i] + (rows[i] + 1) / speeds[i]`` (ties to the faster rank, then the lower
    index). Each rank's time grows with its rows, so adding rows one at a time to the rank that
    ends soonest minimises the largest time. The rows are exact shares: ``Shard(d, shares=rows)``
    cuts `total` into them.
    """
    speeds = tuple(float(s) for s in speeds)
    if not speeds or not all(math.isfinite(s) and s > 0 for s in speeds):
        raise PlacementError(f"rows_by_speed: speeds={speeds}; give one positive, finite speed per rank")
    fixed = (0.0,) * len(speeds) if fixed is None else tuple(float(f) for f in fixed)
    if len(fixed) != len(speeds) or not all(math.isfinite(f) and f >= 0 for f in fixed):
        raise PlacementError(f"rows_by_speed: fixed={fixed}; give one finite time >= 0 per rank of speeds={speeds}")
    if min_rows < 1 or total < min_rows * len(speeds):
        raise PlacementError(
            f"rows_by_speed: {total} rows cannot give each of {len(speeds)} ranks at least {min_rows}; "
            f"use a batch of at least {max(min_rows, 1) * len(speeds)} rows"
        )
    rows = [min_rows] * len(speeds)
    for _ in range(total - min_rows * len(speeds)):
        i = min(range(len(speeds)), key=lambda i: (fixed[i] + (rows[i] + 1) / speeds[i], -speeds[i], i))
        rows[i] += 1
    return tuple(rows)
