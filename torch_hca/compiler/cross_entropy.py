"""Cross-entropy over a vocabulary split by columns: the loss without gathering the logits.

A language model whose head is stored by vocabulary rows (``Shard(0)``) writes its logits split
by classes. ``F.cross_entropy`` has no DTensor rule that reads them so: the layout pass would
gather the whole logits (Llama's 32,000 classes x 512 rows: 65 MB at fp32) and every rank would
compute the whole batch's loss. The loss needs far less from each rank: per row, the
log-sum-exp of its own classes and the logit of the target if the target is one of them.

`expand` rewrites one ``F.cross_entropy`` node of the logical program into ops the layout pass
places like any other:

* ``chunk_logsumexp(x, n)``: an (N, n) value whose column j is the log-sum-exp of piece j of
  the classes (cut as ``Shard`` cuts them, torch.chunk): local on a class-split ``x``, its result
  split by columns;
* ``torch.logsumexp`` of it over the pieces: the whole row's log-sum-exp (N x n values gathered);
* ``pick(x, target, ignore_index)``: each row's target logit, a ``Partial`` sum on a class-split
  ``x`` (the rank holding the target's column gives it, the others 0), as the row-split lookup;
* the negative log-likelihood, masked by ``ignore_index`` and reduced as ``reduction`` says.

On one device the expansion is the same function (to rounding). It is used only where a table of
the class count's rows is stored split (otherwise the logits cannot arrive split by classes) on a
1-D mesh, and only for the plain call (2-D logits, class indices, no class weights, no label
smoothing).
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

from torch_hca.compiler.logical import ENTER, contiguous_stride, decode


def chunk_logsumexp(x: torch.Tensor, pieces: int) -> torch.Tensor:
    """(N, pieces): column j is the log-sum-exp of x's classes in piece j (``-inf`` for an empty one)."""
    if not isinstance(x, DTensor):
        return _pieces_lse(x, pieces)
    mesh, placements = x.device_mesh, tuple(x.placements)
    shape = torch.Size((x.shape[0], pieces))
    if mesh.ndim == 1 and placements[0].is_shard(1) and mesh.size(0) == pieces:
        local = x.to_local().logsumexp(1, keepdim=True)  # this rank's piece: its column
    elif all(p.is_replicate() or p.is_shard(0) for p in placements):
        local = _pieces_lse(x.to_local(), pieces)  # every piece of the rows this rank holds
    else:
        return _pieces_lse(x, pieces)  # DTensor's own rules (the layout pass will not pick this)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=contiguous_stride(shape))


def pick(x: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``x[i, target[i]]`` per row, 0 where the target is `ignore_index`; on logits split by classes
    and replicated targets, a ``Partial`` sum (each rank gives the targets in its classes)."""
    if not (isinstance(x, DTensor) and isinstance(target, DTensor)):
        return _gather(x, target, 0, x.shape[1])
    mesh = x.device_mesh
    xp, tp = tuple(x.placements), tuple(target.placements)
    shape = torch.Size((x.shape[0],))
    if mesh.ndim == 1 and xp[0].is_shard(1) and tp[0].is_replicate():
        start, size = _piece(x.shape[1], mesh.size(0), mesh.get_local_rank(0))
        local, out = _gather(x.to_local(), target.to_local(), start, size), (Partial(),)
    elif xp == tp and all(p.is_replicate() or p.is_shard(0) for p in xp):
        local, out = _gather(x.to_local(), target.to_local(), 0, x.shape[1]), xp
    else:
        return _gather(x, target, 0, x.shape[1])  # DTensor's own rules (the layout pass will not pick this)
    return DTensor.from_local(local, mesh, out, run_check=False, shape=shape, stride=contiguous_stride(shape))


def expand(graph: fx.Graph, node: fx.Node, pieces: int) -> list[fx.Node] | None:
    """Rewrite the ``F.cross_entropy`` call `node` in place as the ops above (the new nodes, in
    order), or None where its arguments are not the plain call this covers."""
    try:
        bound = inspect.signature(F.cross_entropy).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    x, target = a["input"], a["target"]
    if a["weight"] is not None or a["label_smoothing"] != 0.0 or a["reduction"] not in ("mean", "sum", "none"):
        return None
    if a["size_average"] is not None or a["reduce"] is not None or not isinstance(a["ignore_index"], int):
        return None
    xv, tv = (n.meta.get("example_value") if isinstance(n, fx.Node) else None for n in (x, target))
    if not (isinstance(xv, torch.Tensor) and isinstance(tv, torch.Tensor)):
        return None
    if xv.ndim != 2 or tv.ndim != 1 or tv.dtype not in (torch.int64, torch.int32) or not xv.is_floating_point():
        return None
    new: list[fx.Node] = []

    def call(fn, *args) -> fx.Node:
        n = graph.call_function(fn, args)
        n.meta["stack_trace"] = node.meta.get("stack_trace")
        new.append(n)
        return n

    with graph.inserting_before(node):
        lse = call(torch.logsumexp, call(chunk_logsumexp, x, pieces), 1)
        nll = call(operator.sub, lse, call(pick, x, target, a["ignore_index"]))
        valid = call(operator.ne, target, a["ignore_index"])
        nll = call(operator.mul, nll, valid)
        if a["reduction"] == "mean":
            nll = call(operator.truediv, call(torch.sum, nll), call(torch.sum, valid))
        elif a["reduction"] == "sum":
            nll = call(torch.sum, nll)
    node.replace_all_uses_with(nll)
    graph.erase_node(node)
    return new


def split_table_rows(markers: list[fx.Node]) -> set[int]:
    """The row counts of the 2-D parameters stored cut by rows, from the logical program's
    ``hca::enter`` markers: the class counts whose logits may arrive split."""
    rows = set()
    for m in markers:
        if m.target is ENTER and m.args[0].op == "call_method" and m.args[0].target == "to_local":
            shape = m.args[2]
            if len(shape) == 2 and isinstance(shape[0], int) and any(p.is_shard(0) for p in decode(m.args[1])):
                rows.add(shape[0])
    return rows


def _pieces_lse(x: torch.Tensor, pieces: int) -> torch.Tensor:
    classes = x.shape[1]
    columns = []
    for j in range(pieces):
        start, size = _piece(classes, pieces, j)
        part = x[:, start : start + size]
        columns.append(part.logsumexp(1) if size else torch.full_like(x[:, 0], float("-inf")))
    return torch.stack(columns, 1)


def _gather(x: torch.Tensor, target: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """``x[i, target[i] - start]`` where that column is in ``[0, size)``, else 0."""
    if size == 0:
        return x.new_zeros(target.shape)
    index = target - start
    mine = (index >= 0) & (index < size)
    got = x.gather(1, index.clamp(0, size - 1).unsqueeze(1)).squeeze(1)
    return got * mine


def _piece(n: int, pieces: int, j: int) -> tuple[int, int]:
    """(first, count) of piece j of n cut `pieces` ways as ``Shard`` cuts (torch.chunk)."""
    per = -(-n // pieces)
    start = min(per * j, n)
    return start, min(per, n - start)
