"""The vocabulary-parallel loss as the verifier reads it: ``F.cross_entropy`` over logits split by classes.

A file whose graph lists a value of op ``...cross_entropy.chunk_logsumexp`` holds the compiler's
expansion of an ``F.cross_entropy`` call (docs/strategy.md, "The vocabulary-parallel loss"); the
re-traced model has the one call. `expand` rewrites that call in the re-traced graph into the same
ops, written here from the loss's definition alone (nothing of the compiler is imported):

    chunk_logsumexp(x, n)   (N, n): column j the log-sum-exp of piece j of the classes, cut as
                            torch.chunk / Shard cut them (-inf for an empty piece)
    torch.logsumexp(., 1)   the whole row's log-sum-exp
    pick(x, target, ii)     x[i, target[i]] where the target is one of the classes, else 0
    sub, ne(target, ii), mul, then torch.sum / torch.sum (mean), torch.sum (sum), nothing (none)

FX names the new nodes after these functions as it names the compiler's, so the file's values pair
with them by name. On one device the expansion is the loss (to rounding; tests/test_verify_vocabulary.py).

`on_rank` is what each rank computes for the two ops of its own in the numerical check: on a piece
cut by classes (``Shard(1)`` on a 1-D mesh of n), ``chunk_logsumexp`` is the rank's own column and
``pick`` the logit of the targets in its classes (0 for the others: a ``Partial`` sum over ranks).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import pieces as P

CHUNKED = "cross_entropy.chunk_logsumexp"  # how the file's op name ends


def chunk_logsumexp(x: torch.Tensor, pieces: int) -> torch.Tensor:
    """(N, pieces): column j is the log-sum-exp of piece j of x's classes (``-inf`` if it is empty)."""
    columns = []
    for j in range(pieces):
        part = P.chunk(x, pieces, 1, j)
        columns.append(part.logsumexp(1) if part.shape[1] else x.new_full((x.shape[0],), float("-inf")))
    return torch.stack(columns, 1)


def pick(x: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Each row's target logit, 0 where the target is not a class (``ignore_index`` < 0); a row whose
    target is `ignore_index` is masked after, by ``ne``."""
    return _picked(x, target, 0)


def _picked(x: torch.Tensor, target: torch.Tensor, first: int) -> torch.Tensor:
    """``x[i, target[i] - first]`` where that column is one of x's, else 0."""
    size = x.shape[1]
    if not size:
        return x.new_zeros(target.shape)
    column = target - first
    inside = (column >= 0) & (column < size)
    got = x.gather(1, column.clamp(0, size - 1).unsqueeze(1)).squeeze(1)
    return torch.where(inside, got, torch.zeros_like(got))


PER_RANK = (chunk_logsumexp, pick)


def on_rank(target, args: Sequence, placements: Sequence, mesh: P.Mesh, rank: int, classes: int) -> torch.Tensor:
    """`target` (chunk_logsumexp or pick) on `rank`'s pieces `args`; `placements`: the file's placement
    of each tensor argument's read (None where unknown); `classes`: the whole logits' class count."""
    x_at = placements[0]
    by_classes = x_at == ["S(1)"] and len(mesh.sizes) == 1
    if target is chunk_logsumexp and by_classes and args[1] == mesh.sizes[0]:
        return args[0].logsumexp(1, keepdim=True)  # this rank's piece of the classes: its column
    if target is pick and by_classes and placements[1] == ["R"]:
        n, i = mesh.sizes[0], mesh.coords[rank][0]
        first = min(i * -(-classes // n), classes)
        return _picked(args[0], args[1], first)  # the targets in this rank's classes; a Partial sum
    return target(*args)  # rows cut or whole: every piece of the rows this rank holds


def split_rows(data: dict) -> set[int]:
    """The row counts of the 2-D parameters the file stores cut by rows: the class counts whose
    logits may arrive split by classes."""
    rows = set()
    for p in (data.get("model") or {}).get("parameters", {}).values():
        shape = p.get("shape") or []
        if len(shape) == 2 and "S(0)" in (p.get("placements") or []):
            rows.add(shape[0])
    return rows


def expand(graphs: list, data: dict) -> int:
    """Rewrite, in each re-traced graph whose file entry lists a ``chunk_logsumexp`` value, the plain
    ``F.cross_entropy`` calls over a class count the file stores split (`split_rows`) as the ops above.
    `graphs`: `retrace.capture`'s; returns how many calls were rewritten."""
    shape = list((data.get("mesh") or {}).get("shape") or [])
    entries = data.get("graphs") or []
    if len(shape) != 1:
        return 0
    classes, done = split_rows(data), 0
    for (gm, _read, _bound), entry in zip(graphs, entries):
        values = (entry.get("values") or {}) if isinstance(entry, dict) else {}
        if not any(str(v.get("op", "")).endswith(CHUNKED) for v in values.values() if isinstance(v, dict)):
            continue
        for node in list(gm.graph.find_nodes(op="call_function", target=F.cross_entropy)):
            done += _expand(gm.graph, node, shape[0], classes)
        gm.recompile()
    return done


def _plain(node: fx.Node, classes: set[int]) -> dict[str, Any] | None:
    """The call's arguments where it is the plain call the expansion covers (2-D logits over a split
    class count, class indices, no weights, no label smoothing), else None."""
    try:
        bound = inspect.signature(F.cross_entropy).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    if a["weight"] is not None or a["label_smoothing"] != 0.0 or a["reduction"] not in ("mean", "sum", "none"):
        return None
    if a["size_average"] is not None or a["reduce"] is not None or not isinstance(a["ignore_index"], int):
        return None
    x, t = (v.meta.get("example_value") if isinstance(v, fx.Node) else None for v in (a["input"], a["target"]))
    if not (isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor)):
        return None
    if x.ndim != 2 or not x.is_floating_point() or x.shape[1] not in classes:
        return None
    return a if t.ndim == 1 and t.dtype in (torch.int64, torch.int32) else None


def _expand(graph: fx.Graph, node: fx.Node, pieces: int, classes: set[int]) -> int:
    a = _plain(node, classes)
    if a is None:
        return 0
    meta = {}  # each node's value on meta tensors: the logical shape and dtype the trace lists
    for n in (a["input"], a["target"]):
        v = n.meta["example_value"]
        meta[n] = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")

    def call(fn, *args) -> fx.Node:
        new = graph.call_function(fn, args)
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        new.meta["example_value"] = meta[new] = fn(*(meta.get(x, x) if isinstance(x, fx.Node) else x for x in args))
        return new

    x, target, ignore = a["input"], a["target"], a["ignore_index"]
    with graph.inserting_before(node):
        lse = call(torch.logsumexp, call(chunk_logsumexp, x, pieces), 1)
        nll = call(operator.sub, lse, call(pick, x, target, ignore))
        valid = call(operator.ne, target, ignore)
        nll = call(operator.mul, nll, valid)
        if a["reduction"] == "mean":
            nll = call(operator.truediv, call(torch.sum, nll), call(torch.sum, valid))
        elif a["reduction"] == "sum":
            nll = call(torch.sum, nll)
    node.replace_all_uses_with(nll)
    graph.erase_node(node)
    return 1
