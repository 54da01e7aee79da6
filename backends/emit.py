"""Emit: turn a checked c10d graph into something callable.

"eager": run the FX graph (boxed calling convention for AOTAutograd), less
three costs: an all_reduce of a buffer the graph has just made for it alone (a
bucket) reduces that buffer in place instead of a copy; `detach` nodes that only
ops read (no grad is recorded inside a compiled graph) are skipped; and a tied
embedding's gradient (the head's matmul gradient plus the embedding's) adds the
embedding's rows into the matmul's fresh result instead of building a zeroed
table of the whole vocabulary and summing two of them.
"inductor": hand the same graph to Inductor, which lowers the
`_c10d_functional` ops itself, with waits kept late (its "sink_waits" pass).

Both run a sum's reduce_scatter on gloo as an all_reduce of which this rank keeps
its own rows: gloo has no reduce-scatter of its own, and torch's emulation of it
cost about 1 ms more per call than that all_reduce and copy on 2 ranks here
(2.1 against 1.0 ms at 256 KiB, 7.1 against 6.3 at 4 MiB; docs/bench.md).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx as fx
from functorch.compile import make_boxed_func

from torch_hca.backends.staging import stage_collectives
from torch_hca._torch_private import (
    copy_graph_module,
    group_backend,
    group_rank,
    inductor_random_as_eager,
    inductor_waits_late,
)
from torch_hca.compiler.randomness import graph_draws
from torch_hca.spmd.events import is_view, written
from torch_hca.spmd.op_families import UNANNOTATED_VIEWS
from torch_hca.spmd.cost_model import scatter_runs_as_all_reduce

_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_ALL_REDUCE_IN_PLACE = torch.ops._c10d_functional.all_reduce_.default
_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_DETACH = torch.ops.aten.detach.default
_ADD = torch.ops.aten.add.Tensor
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default


def emit(
    gm: fx.GraphModule, example_inputs: list[Any], inner: str, is_backward: bool = False, staged: bool = False
) -> Callable:
    """`staged`: every collective through host buffers on gloo (`backends/staging.py`)."""
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner

        # Inductor rewrites the graph in place (all_reduce -> all_reduce_); the report
        # keeps the graph the passes emitted. Its scheduler would wait on each collective
        # right after starting it; the schedule pass placed the waits late, and so must it.
        gm = copy_graph_module(gm)
        changed = stage_collectives(gm) if staged else 0  # staged first: no reduce_scatter is left after
        if _scatter_by_all_reduce(gm) or changed:
            gm.recompile()
        # Draws through aten's kernels, as the decompositions were chosen (pipeline.lower).
        random_as_eager = inductor_random_as_eager() if graph_draws(gm) else contextlib.nullcontext()
        with inductor_waits_late(), random_as_eager:
            return compile_fx_inner(gm, example_inputs, is_backward=is_backward)
    return make_boxed_func(eager_graph(gm, staged).forward)


def eager_graph(gm: fx.GraphModule, staged: bool = False) -> fx.GraphModule:
    """What the eager emitter runs: a copy of `gm` whose reduce_scatters on gloo run as
    all_reduces, without skippable detaches, whose all_reduces of fresh, otherwise unread
    buffers run in place (`gm` itself, if none of these occurs).

    The functional all_reduce copies its input first (3 MiB of gradients cost about
    1 ms on one CPU core); where nothing else reads the input, that copy is waste. A
    detach costs a few microseconds of dispatch each, and a backward has dozens.
    The report keeps the graph as the passes emitted it. `staged`: the collectives staged
    first (`stage_collectives`), so none is left to run in place.
    """
    if not (
        staged
        or _scatters_on_gloo(gm)
        or _skippable_detaches(gm)
        or _reductions_in_place(gm)
        or _tied_embedding_sums(gm)
    ):
        return gm
    gm = copy_graph_module(gm)
    if staged:
        stage_collectives(gm)
    _scatter_by_all_reduce(gm)
    for node in _skippable_detaches(gm):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    in_place = _reductions_in_place(gm)  # before the sums below write their buffers
    for add, rows, dense in _tied_embedding_sums(gm):
        _add_rows_in_place(gm.graph, add, rows, dense)
    for node in in_place:
        node.target = _ALL_REDUCE_IN_PLACE
    gm.recompile()
    return gm


def _tied_embedding_sums(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(add, embedding_dense_backward, dense) for each `add(dense, embedding_dense_backward(...))` whose
    dense operand is a fresh buffer (through views) that nothing else reads, of the table's shape.

    That is a tied weight's gradient (GPT-2's LM head and token embedding): the embedding's part is a
    zeroed table with a few rows filled (on GPT-2 small 154 MB zeroed for 256 rows), then summed
    into a third table. Written into the head's gradient instead, the step skips both passes over
    the table: on this project's 2-core VM they were 0.5-0.6 s each of a 3.5 s step, mostly first-touch
    page faults of fresh memory (docs/bench.md)."""
    found = []
    for add in gm.graph.find_nodes(op="call_function", target=_ADD):
        if add.kwargs or len(add.args) != 2:
            continue
        for rows, dense in (add.args, reversed(add.args)):
            if not (
                isinstance(rows, fx.Node)
                and rows.target is _EMBEDDING_BACKWARD
                and len(rows.users) == 1
                and not rows.args[4]  # scale_grad_by_freq: rows are not plain sums
                and _owned_fresh(dense)
            ):
                continue
            want, have = rows.meta.get("val"), dense.meta.get("val")
            if (
                isinstance(want, torch.Tensor)
                and isinstance(have, torch.Tensor)
                and have.shape == want.shape
                and have.dtype == want.dtype
                and have.is_contiguous()
            ):
                found.append((add, rows, dense))
                break
    return found


def _owned_fresh(node: Any) -> bool:
    """Whether `node` is new memory, or a chain of views of it, that only the next node in the chain
    (and, for `node` itself, its one reader) reads: writing through it changes nothing else."""
    while isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1 and is_view(node):
        node = node.args[0]
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and len(node.users) == 1
        and isinstance(node.target, torch._ops.OpOverload)
        and not is_view(node)
        and not written(node)
    )


def _add_rows_in_place(graph: fx.Graph, add: fx.Node, rows: fx.Node, dense: fx.Node) -> None:
    """add(dense, embedding_dense_backward(grad, ids, n, padding_idx, False)) ->
    dense.index_put_([ids.reshape(-1)], grad.reshape(-1, d) (padding_idx's rows zeroed), accumulate=True)."""
    aten = torch.ops.aten
    grad, ids, _, padding_idx = rows.args[:4]
    width = rows.meta["val"].shape[1]
    grad_val, ids_val = grad.meta["val"], ids.meta["val"]
    with graph.inserting_before(add):
        flat_ids = graph.call_function(aten.reshape.default, (ids, [-1]))
        flat_ids.meta["val"] = ids_val.reshape(-1)
        values = graph.call_function(aten.reshape.default, (grad, [-1, width]))
        values.meta["val"] = grad_val.reshape(-1, width)
        if padding_idx >= 0:  # the padding row's gradient stays zero, as embedding_dense_backward has it
            is_pad = graph.call_function(aten.eq.Scalar, (flat_ids, padding_idx))
            is_pad.meta["val"] = flat_ids.meta["val"] == padding_idx
            column = graph.call_function(aten.unsqueeze.default, (is_pad, 1))
            column.meta["val"] = is_pad.meta["val"].unsqueeze(1)
            values = graph.call_function(aten.masked_fill.Scalar, (values, column, 0))
            values.meta["val"] = torch.empty_like(grad_val.reshape(-1, width))
        summed = graph.call_function(aten.index_put_.default, (dense, [flat_ids], values, True))
    summed.meta["val"] = add.meta["val"]
    add.replace_all_uses_with(summed)
    graph.erase_node(add)
    graph.erase_node(rows)


def _scatters_on_gloo(gm: fx.GraphModule) -> list[fx.Node]:
    """The sums' reduce_scatters of CPU tensors on a group whose CPU transport is gloo."""
    found = []
    for rs in gm.graph.find_nodes(op="call_function", target=_REDUCE_SCATTER):
        x, op, n, group = rs.args[:4]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if (
            op == "sum"
            and isinstance(val, torch.Tensor)
            and isinstance(val.shape[0], int)
            and val.shape[0] % n == 0
            and scatter_runs_as_all_reduce(group_backend(group), val.device.type)
        ):
            found.append(rs)
    return found


def _scatter_by_all_reduce(gm: fx.GraphModule) -> bool:
    """reduce_scatter(x) -> all_reduce(x)[this rank's rows], copied after the wait, in `gm`'s
    graph (the caller recompiles); whether there was any.

    The rows are a view of the sum, so the wait (which finds its collective by storage)
    completes them; the copy after it frees the other ranks' rows, whose memory a sharded
    gradient would otherwise keep alive.
    """
    graph = gm.graph
    scatters = _scatters_on_gloo(gm)
    for rs in scatters:
        x, op, n, group = rs.args[:4]
        rows = x.meta["val"].shape[0] // n
        start = group_rank(group) * rows
        with graph.inserting_before(rs):
            total = graph.call_function(_ALL_REDUCE, (x, op, group))
            mine = graph.call_function(torch.ops.aten.slice.Tensor, (total, 0, start, start + rows))
        total.meta["val"] = torch.empty_like(x.meta["val"])
        mine.meta["val"] = total.meta["val"][start : start + rows]
        rs.replace_all_uses_with(mine)
        graph.erase_node(rs)
        for wait in [u for u in mine.users if u.target is _WAIT]:
            with graph.inserting_after(wait):
                own = graph.call_function(torch.ops.aten.clone.default, (wait,))
            own.meta["val"] = mine.meta["val"].clone()
            wait.replace_all_uses_with(own, delete_user_cb=lambda user: user is not own)
    return bool(scatters)


def _skippable_detaches(gm: fx.GraphModule) -> list[fx.Node]:
    """Detaches only ops read: an output keeps its own tensor (AOTAutograd checks outputs' aliasing)."""
    return [
        n
        for n in gm.graph.find_nodes(op="call_function", target=_DETACH)
        if n.users and all(u.op == "call_function" for u in n.users)
    ]


def _reductions_in_place(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.find_nodes(op="call_function", target=_ALL_REDUCE) if _sole_reader_of_fresh(n.args[0])]


def _sole_reader_of_fresh(node: Any) -> bool:
    """Whether `node` is new memory (an op that, by its schema, neither views nor writes an input)
    that one node reads, or a chain of views with one reader each of such memory that ends
    contiguous and covers all of it: a view the schema does not declare (`_unsafe_view`: a matmul's
    result reshaped), a reduce_scatter bucket's `cat(dim=1).view(-1)` (which gloo runs as an
    all_reduce: 13 MB copied for nothing on the test Transformer's FSDP-like step, 6 ms of it), or
    `t(t(mm))` (the 125M Llama's 98 MB head gradient, copied first in every step)."""
    top, root, declared = node, node, False  # declared: a view its schema says aliases (t, view, ...)
    while (
        isinstance(root, fx.Node)
        and root.op == "call_function"
        and len(root.users) == 1
        and (root.target in UNANNOTATED_VIEWS or is_view(root))
    ):
        declared = declared or root.target not in UNANNOTATED_VIEWS
        root = root.args[0]
    if not (isinstance(root, fx.Node) and root.op == "call_function" and len(root.users) == 1):
        return False
    if not (isinstance(root.target, torch._ops.OpOverload) and not is_view(root) and not written(root)):
        return False
    return not declared or _covers(top, root)  # `_unsafe_view` reshapes a whole, contiguous result


def decompositions(inner: str) -> dict | None:
    """The decomposition table AOTAutograd should apply for this emitter."""
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return None


def _covers(view: fx.Node, base: fx.Node) -> bool:
    """`view` (of `base`, through views) is contiguous and holds every element of `base`: an
    elementwise reduction in place through it reduces the whole buffer and nothing else."""
    val, src = view.meta.get("val"), base.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and isinstance(src, torch.Tensor)
        and val.is_contiguous()
        and src.is_contiguous()
        and val.numel() == src.numel()
        and val.storage_offset() == src.storage_offset() == 0
    )
