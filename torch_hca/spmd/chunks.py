"""Pieces of a `Shard` that does not divide: torch.chunk's cut, which DTensor uses.

A dimension of size 129 sharded over 2 ranks is held as 65 rows on rank 0 and 64 on rank 1
(``ceil(129 / 2)`` rows a piece, the last piece what is left). DTensor lays such a value out
that way on its own; torch_hca stores a parameter so (GPT-2's 50,257-token table cut by
vocabulary) and reads it only as stored: no collective of the program moves an uneven value
(docs/heterogeneous.md, "Uneven pieces of a parameter"). Shares (`torch_hca.spmd.shares`) are
another cut, by given ratios, of a call's inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Shard


def piece_size(size: int, n: int, index: int) -> int:
    """Rows of piece `index` when `size` rows are cut into `n` by torch.chunk."""
    full = -(-size // n)
    return max(0, min(full, size - index * full))


def pieces_nonempty(size: int, n: int) -> bool:
    """Whether torch.chunk gives each of `n` pieces at least one row (5 rows over 4 leave one empty)."""
    return piece_size(size, n, n - 1) > 0


def uneven_mesh_dims(shape: Sequence, layout: Sequence, mesh_shape: Sequence[int]) -> list[int]:
    """The mesh dims whose `Shard` does not cut its dimension into equal pieces (after the mesh
    dims before it have cut it, as DTensor does)."""
    local = list(shape)
    uneven = []
    for m, (p, n) in enumerate(zip(layout, mesh_shape)):
        if isinstance(p, Shard) and n > 1:
            size = local[p.dim]
            if not isinstance(size, int):
                continue
            if size % n:
                uneven.append(m)
            local[p.dim] = -(-size // n)
    return uneven


def is_uneven(shape: Sequence, layout: Sequence, mesh_shape: Sequence[int]) -> bool:
    return bool(uneven_mesh_dims(shape, layout, mesh_shape))


def local_piece_shape(shape: Sequence, layout: Sequence, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> list:
    """The shape of the piece the rank at `coordinate` of the mesh holds, cut as DTensor cuts."""
    local = list(shape)
    for p, n, c in zip(layout, mesh_shape, coordinate):
        if isinstance(p, Shard):
            size = local[p.dim]
            local[p.dim] = piece_size(size, n, c) if isinstance(size, int) else size // n
    return local


def rank_pieces(shape: Sequence, layout: Sequence, mesh_shape: Sequence[int], ranks) -> list[list] | None:
    """Each rank's piece shape, in rank order (`ranks`: the mesh's rank numbers, nested as the
    mesh), where `layout` (placements, or their texts "S(0)", "R") cuts `shape` unevenly; None
    where every cut divides or a size is symbolic."""
    layout = [Shard(int(p[2:-1])) if isinstance(p, str) and p.startswith("S(") else p for p in layout]
    if len(layout) != len(mesh_shape) or not all(isinstance(n, int) for n in shape):
        return None
    if not is_uneven(shape, layout, mesh_shape):
        return None
    grid = torch.tensor(ranks).reshape(list(mesh_shape))
    coordinate = {int(grid[c]): c for c in itertools.product(*(range(n) for n in mesh_shape))}
    return [local_piece_shape(shape, layout, mesh_shape, coordinate[r]) for r in sorted(coordinate)]
