"""The embedding lookup with a vocabulary-parallel rule: a table cut by rows is read where it lies.

DTensor's own rule for a row-sharded table (``Shard(0)``) and replicated ids returns a
`_MaskPartial`, a placement that carries the mask of the ids it dropped as mutable state,
which the layout solver cannot offer (each probe would leave its fake mask behind). Without
it the only way to read such a table is to gather it whole: GPT-2's 50,257 x 768 table is
154 MB a step at fp32, forward and backward, where the lookup needs one all-reduce of the
looked-up rows (a 4 x 64 batch: 786 KB).

`embedding` is that lookup as plain ops on each rank's piece, so its result is an ordinary
``Partial`` sum: each rank looks up the ids that fall in its rows (the others read row 0 and
are zeroed), and the pieces sum to the whole lookup. The gradient of the table stays a
row shard (each rank's rows get exactly their ids' cotangents), and the ids' layout on the
other mesh dims carries to the result (a batch split stays split). Any other combination of
layouts is DTensor's rule (`F.embedding`). The lift pass puts it in place of ``F.embedding``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Placement, Shard

from torch_hca.compiler.logical import contiguous_stride


def embedding(ids, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    """``F.embedding``; a row-sharded `weight` read by replicated `ids` gives a Partial sum."""
    plain = max_norm is None and not scale_grad_by_freq and not sparse
    placements = _vocabulary_parallel(ids, weight) if plain else None
    if placements is None:
        return F.embedding(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    mesh, rows = weight.device_mesh, weight.shape[0]
    vocab_dim = next(m for m, p in enumerate(weight.placements) if p.is_shard(0))
    start, size = _row_range(rows, mesh.size(vocab_dim), mesh.get_local_rank(vocab_dim))
    local_ids = ids.to_local() - start
    mine = (local_ids >= 0) & (local_ids < size)
    local_pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < size else None
    looked_up = F.embedding(local_ids.masked_fill(~mine, 0), weight.to_local(), local_pad)
    local = looked_up.masked_fill(~mine.unsqueeze(-1), 0.0)
    shape = torch.Size((*ids.shape, weight.shape[1]))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=contiguous_stride(shape))


def _vocabulary_parallel(ids, weight) -> tuple[Placement, ...] | None:
    """The result's placements where `weight` is row-sharded on exactly one mesh dim that `ids`
    is replicated on (and, on the others, at most one of them is split); else None."""
    if not (isinstance(ids, DTensor) and isinstance(weight, DTensor)) or ids.device_mesh != weight.device_mesh:
        return None
    if sum(p.is_shard(0) for p in weight.placements) != 1 or weight.ndim != 2:
        return None
    out: list[Placement] = []
    for p_ids, p_w in zip(ids.placements, weight.placements):
        if p_w.is_shard(0):
            if not p_ids.is_replicate():
                return None
            out.append(Partial())
        elif p_w.is_replicate() and (p_ids.is_replicate() or p_ids.is_shard()):
            out.append(p_ids)
        elif p_w.is_shard(1) and p_ids.is_replicate():
            out.append(Shard(ids.ndim))
        else:
            return None
    return tuple(out)


def _row_range(rows: int, n: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of `rank`'s piece of `rows` cut n ways as DTensor's Shard cuts (torch.chunk)."""
    per = -(-rows // n)
    start = min(per * rank, rows)
    return start, min(per, rows - start)
