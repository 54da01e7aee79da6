"""`backends.emit`: the eager emitter reduces a bucket in place, and only a bucket, skips
the detaches only ops read, and adds a tied embedding's gradient rows into the head's gradient.

The functional all_reduce copies its input; `eager_graph` drops that copy where the
input is new memory nothing else reads. Graph-only, on the fake process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from torch_hca.backends.emit import eager_graph, emit

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _reduce_graph(source: str, also_returned: bool) -> fx.GraphModule:
    """all_reduce(buffer) -> wait, where buffer is a cat of the inputs, an input, or a view of a cat
    (for "unsafe_view", an `_unsafe_view` of a cat the graph also returns; for
    "unsafe_view_of_fresh", of a cat nothing else reads)."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    cat = None
    if source == "cat":
        buffer = g.call_function(aten.cat.default, ([a, b],))
    elif source == "input":
        buffer = a
    else:  # a view aliases memory someone else may hold
        cat = g.call_function(aten.cat.default, ([a, b],))
        view = aten.view.default if source == "view" else aten._unsafe_view.default  # unsafe_view*
        buffer = g.call_function(view, (cat, [-1]))
    reduced = g.call_function(
        c10d.wait_tensor.default,
        (g.call_function(c10d.all_reduce.default, (buffer, "sum", dist.group.WORLD.group_name)),),
    )
    g.output((reduced, buffer) if also_returned else (reduced, cat) if source == "unsafe_view" else (reduced,))
    return fx.GraphModule({}, g)


def _targets(gm: fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("source", ["cat", "unsafe_view_of_fresh"])
def test_a_bucket_only_the_reduction_reads_is_reduced_in_place(fake_pg, source):
    gm = _reduce_graph(source, also_returned=False)
    emitted = eager_graph(gm)
    assert c10d.all_reduce_.default in _targets(emitted) and c10d.all_reduce.default not in _targets(emitted)
    assert c10d.all_reduce.default in _targets(gm)  # the report's graph is left as the passes made it
    a, b = torch.randn(3), torch.randn(2)
    (out,) = emit(gm, [a, b], "eager")([a, b])
    assert torch.equal(out, torch.cat([a, b]))


@pytest.mark.parametrize("through,in_place", [("t_t", True), ("narrow", False), ("t", False)])
def test_a_reduction_through_views_of_a_fresh_result_is_in_place_only_when_it_covers_it(fake_pg, through, in_place):
    """A weight gradient as AOTAutograd writes it, `t(t(mm))`: contiguous and the whole of the mm's
    fresh result, so reduced in place (the 125M Llama's 98 MB head gradient was copied first). A view
    of part of it, or one that is not contiguous, keeps the functional all_reduce (its copy)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b):
        g = a @ b
        g = {"t_t": lambda: g.t().t(), "narrow": lambda: g.narrow(0, 0, 2), "t": lambda: g.t()}[through]()
        return c10d.wait_tensor(c10d.all_reduce(g, "sum", dist.group.WORLD.group_name))

    a, b = torch.randn(4, 3), torch.randn(3, 5)
    gm = make_fx(f, tracing_mode="fake")(a, b)
    emitted = eager_graph(gm)
    assert (c10d.all_reduce_.default in _targets(emitted)) is in_place, emitted.code
    assert (c10d.all_reduce.default in _targets(emitted)) is not in_place, emitted.code
    out = emit(gm, [a, b], "eager")([a, b])
    want = {"t_t": lambda g: g, "narrow": lambda g: g[:2], "t": lambda g: g.t()}[through](a @ b)
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, want)  # a fake group: no sum


# `_unsafe_view`'s schema declares no alias, but its result shares its input's memory.
@pytest.mark.parametrize(
    "source,also_returned", [("cat", True), ("input", False), ("view", False), ("unsafe_view", False)]
)
def test_a_buffer_someone_else_may_read_keeps_the_copy(fake_pg, source, also_returned):
    gm = _reduce_graph(source, also_returned)
    assert eager_graph(gm) is gm
    assert c10d.all_reduce_.default not in _targets(gm)


def test_detaches_only_ops_read_are_skipped_and_an_output_keeps_its_own():
    g = fx.Graph()
    a = g.placeholder("a")
    inner = g.call_function(aten.detach.default, (a,))
    doubled = g.call_function(aten.add.Tensor, (inner, inner))
    returned = g.call_function(aten.detach.default, (doubled,))
    g.output((doubled, returned))
    gm = fx.GraphModule({}, g)

    emitted = eager_graph(gm)
    detaches = lambda m: [n.args[0].name for n in m.graph.find_nodes(op="call_function", target=aten.detach.default)]
    assert detaches(emitted) == [doubled.name] and detaches(gm) == ["a", doubled.name]
    x = torch.randn(3)
    assert all(torch.equal(o, 2 * x) for o in emitted(x))


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_runs_a_reduce_scatter_as_an_all_reduce_keeping_its_own_rows(worlds, world_size):
    """gloo emulates reduce_scatter more slowly than it runs the all_reduce of the same bucket;
    the emitter runs that all_reduce (in place: the bucket is fresh) and copies out this rank's
    rows, so the result owns its memory. The report's graph keeps the reduce_scatter."""
    from collective_cases import reduce_scatter_as_emitted

    for r in worlds(world_size).run(reduce_scatter_as_emitted, 7):
        assert r["ops"] == [
            "aten.cat.default",
            "_c10d_functional.all_reduce_.default",
            "aten.slice.Tensor",
            "_c10d_functional.wait_tensor.default",
            "aten.clone.default",
        ]
        assert "_c10d_functional.reduce_scatter_tensor.default" in r["report_ops"]
        assert r["err"] <= 1e-6 and r["shape"] == [3, 3] and r["own_storage"]
    # A bucket as the schedule pass makes it, viewed flat: still summed in place, no copy of the bucket.
    for r in worlds(world_size).run(reduce_scatter_as_emitted, 7, True):
        assert r["ops"] == [
            "aten.cat.default",
            "aten.view.default",
            "_c10d_functional.all_reduce_.default",
            "aten.slice.Tensor",
            "_c10d_functional.wait_tensor.default",
            "aten.clone.default",
        ]
        assert r["err"] <= 1e-6 and r["shape"] == [9] and r["own_storage"]


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_sharded_gradients_by_all_reduce_match_one_device(worlds, inner):
    """FSDP storage on gloo: every gradient's reduce_scatter runs as an all_reduce (eager and
    Inductor), and the gradients and Adam steps still match one device."""
    import dist_cases

    first = worlds(2).run(dist_cases.parity, "fsdp", 2, {"inner": inner})[0]
    assert first["backward"].get("reduce_scatter", 0) >= 1  # the report keeps what the passes chose
    assert first["out_err"] <= 1e-5
    assert all(e <= 1e-5 for e in first["grad_errs"].values()), first["grad_errs"]
    assert all(e <= 1e-5 for e in first["param_errs"].values()), first["param_errs"]


def _tied_gradient_graph(padding_idx: int, also_returned: bool) -> tuple[fx.GraphModule, tuple]:
    """A tied weight's gradient as AOTAutograd writes it: the head's matmul gradient (seen through
    two transposes) plus the embedding's, `add(t(t(mm)), embedding_dense_backward(...))`."""
    from torch.fx.experimental.proxy_tensor import make_fx

    vocab, width = 11, 4

    def gradient(h, g_logits, g_rows, ids):
        dense = aten.t.default(aten.t.default(aten.mm.default(g_logits, h)))
        rows = aten.embedding_dense_backward.default(g_rows, ids, vocab, padding_idx, False)
        total = aten.add.Tensor(dense, rows)
        return (total, dense) if also_returned else (total,)

    # Repeated ids (4 and 0 twice) and the padding row: the sums and the zeroed row are both checked.
    args = (
        torch.randn(6, width),
        torch.randn(vocab, 6),
        torch.randn(2, 3, width),
        torch.tensor([[4, 0, 4], [9, 0, 1]]),
    )
    return make_fx(gradient, tracing_mode="fake")(*args), args


@pytest.mark.parametrize("padding_idx", [-1, 0])
def test_a_tied_embedding_gradient_adds_its_rows_into_the_head_gradient(padding_idx):
    """No zeroed vocabulary-sized table and no sum of two: the rows are added into the matmul's
    fresh result in place (GPT-2 small: two passes over 154 MB a step). Equal to the graph as traced."""
    gm, args = _tied_gradient_graph(padding_idx, also_returned=False)
    emitted = eager_graph(gm)
    assert aten.index_put_.default in _targets(emitted)
    assert not {aten.embedding_dense_backward.default, aten.add.Tensor} & _targets(emitted)
    assert aten.embedding_dense_backward.default in _targets(gm)  # the report's graph is unchanged
    (want,), (got,) = gm(*args), emitted(*args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if padding_idx >= 0:  # the padding row holds the head's gradient alone
        h, g_logits = args[:2]
        torch.testing.assert_close(got[padding_idx], (g_logits @ h)[padding_idx], rtol=1e-6, atol=1e-6)


def test_a_head_gradient_someone_else_reads_is_not_written():
    gm, _ = _tied_gradient_graph(-1, also_returned=True)
    assert eager_graph(gm) is gm
