"""One test per wrapper in `torch_hca._torch_private`, the only home of private torch APIs.

A torch upgrade that moves one of them fails here first, under the wrapper's name.
All run on the fake process group: placements and shapes only, never numbers.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dist_cases
import torch_hca as hca
from torch_hca import _torch_private as tp
from torch_hca.tools import zoo

aten = torch.ops.aten


def test_graph_arg_example_is_the_real_parameter(fake_pg):
    # Dynamo erases the examples once the backend returns: read them inside it, as the pipeline does.
    seen: list[dict] = []

    def be(gm, example_inputs):
        seen.append({n.name: tp.graph_arg_example(n) for n in gm.graph.find_nodes(op="placeholder")})
        return gm.forward

    torch.manual_seed(0)
    model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP())
    x = torch.randn(8, 16)
    torch.compile(model, backend=be)(x)
    assert len(seen) == 1

    examples = seen[0]
    by_id = {id(v): name for name, v in examples.items() if v is not None}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        assert id(p) in by_id, f"no placeholder of the Dynamo graph carries parameter {name}"
        assert examples[by_id[id(p)]] is p  # the real parameter, not a fake copy
    assert any(v is x for v in examples.values()), "the user input is a graph argument too"


def test_graph_arg_example_is_none_without_a_grapharg():
    g = fx.Graph()
    x = g.placeholder("x")
    assert tp.graph_arg_example(x) is None

    class Erased:  # a GraphArg whose example is gone (erased, or an expired weakref)
        @property
        def example(self):
            raise RuntimeError("erased")

    x.meta["grapharg"] = Erased()
    assert tp.graph_arg_example(x) is None


@pytest.mark.parametrize("fake_pg", [2, 4], indirect=True)
def test_group_size(fake_pg):
    name = fake_pg.get_group().group_name
    assert isinstance(name, str)
    assert tp.group_size(name) == fake_pg.size() == torch.distributed.get_world_size()


def test_process_group(fake_pg):
    group = fake_pg.get_group()
    assert tp.process_group(group.group_name) is group


def test_group_backend(fake_pg):
    assert tp.group_backend(fake_pg.get_group().group_name) == "fake"


def test_record_implicit_redistributions(fake_pg):
    sharded = distribute_tensor(torch.randn(8, 4), fake_pg, [Shard(0)])
    replicated = distribute_tensor(torch.randn(8, 4), fake_pg, [Replicate()])
    from torch.distributed.tensor._dispatch import OpDispatcher

    original = OpDispatcher.__dict__["redistribute_local_args"]

    with tp.record_implicit_redistributions() as events:
        out = sharded + replicated
    assert out.placements == (Shard(0),)
    assert len(events) == 1, events
    (e,) = events
    assert isinstance(e, tp.RedistributionEvent)
    assert e.op == aten.add.Tensor
    assert e.arg_index == 1  # DTensor moves the replicated argument, no communication
    assert e.src.placements == (Replicate(),) and e.dst.placements == (Shard(0),)
    assert e.src.shape == e.dst.shape == torch.Size([8, 4])

    # An explicit redistribute is not implicit; an op that needs no move records nothing.
    with tp.record_implicit_redistributions() as events:
        moved = replicated.redistribute(fake_pg, [Shard(0)])
        sharded.redistribute(fake_pg, [Replicate()])
        (sharded + moved).sum()
    assert events == []

    # The dispatcher is restored on exit, also when the body raises.
    assert OpDispatcher.__dict__["redistribute_local_args"] is original
    with pytest.raises(ZeroDivisionError):
        with tp.record_implicit_redistributions():
            1 / 0
    assert OpDispatcher.__dict__["redistribute_local_args"] is original
    with tp.record_implicit_redistributions() as events:
        pass
    sharded + replicated  # outside the context: not recorded
    assert events == []


def test_record_implicit_redistributions_with_list_arguments(fake_pg):
    # layer_norm's normalized_shape is a list: DTensor indexes its arguments
    # unflattened, so a flattened reading would report the list's ints as moves.
    x = distribute_tensor(torch.randn(4, 8, 8), fake_pg, [Shard(2)])
    w = distribute_tensor(torch.randn(8, 8), fake_pg, [Replicate()])
    b = distribute_tensor(torch.randn(8, 8), fake_pg, [Replicate()])
    with tp.record_implicit_redistributions() as events:
        torch.nn.functional.layer_norm(x, (8, 8), w, b)
    assert [(e.arg_index, e.dst.placements) for e in events] == [(0, (Replicate(),))], events


def test_fake_mode_of(fake_pg):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = distribute_tensor(torch.randn(8, 4), fake_pg, [Shard(0)])
    assert tp.fake_mode_of([real, torch.ones(2), None, 3]) is None
    assert tp.fake_mode_of([]) is None

    mode = FakeTensorMode()
    with mode:
        local = torch.empty(2, 4)
        fake_dt = DTensor.from_local(local, fake_pg, [Shard(0)], run_check=False)
    assert isinstance(fake_dt, DTensor) and fake_dt.shape == torch.Size([8, 4])
    assert tp.fake_mode_of([None, real, fake_dt]) is mode
    assert tp.fake_mode_of([local]) is mode  # a plain fake tensor too


def test_fake_dtensor_work_enters_the_mode_and_clears_the_sharding_cache(fake_pg, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        local = torch.empty(2, 4)
    cleared = []
    monkeypatch.setattr(tp, "clear_dtensor_sharding_cache", lambda: cleared.append(True))
    with pytest.raises(RuntimeError, match="boom"):
        with tp.fake_dtensor_work([None, local]):
            assert isinstance(torch.empty(3), FakeTensor)
            raise RuntimeError("boom")
    assert cleared == [True]  # on errors too
    with tp.fake_dtensor_work([torch.ones(2)]):  # no fake values: no mode
        assert not isinstance(torch.empty(3), FakeTensor)
    assert cleared == [True, True]


def test_copy_graph_module_under_an_active_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    class WithConstant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(4.0))

        def forward(self, x):
            return x + self.table

    gm = fx.symbolic_trace(WithConstant())
    with FakeTensorMode():
        copy = tp.copy_graph_module(gm)
    assert copy is not gm and torch.equal(copy.table, gm.table) and type(copy.table) is torch.Tensor


def test_redistribute_to_partial(fake_pg):
    x = distribute_tensor(torch.randn(8, 4), fake_pg, [Replicate()]).requires_grad_()
    # What the wrapper is for: the public API refuses the move.
    with pytest.raises(RuntimeError, match="Partial"):
        x.redistribute(fake_pg, [Partial("sum")])

    y = tp.redistribute_to_partial(x, (Partial("sum"),))
    assert isinstance(y, DTensor)
    assert y.placements == (Partial("sum"),)
    assert y.device_mesh is x.device_mesh
    assert y.shape == x.shape == torch.Size([8, 4])
    assert y.to_local().shape == torch.Size([8, 4])
    assert y.dtype == x.dtype
    assert y.full_tensor().shape == torch.Size([8, 4])

    # Differentiable: the cotangent comes back to x in x's placement.
    y.to_local().sum().backward()
    assert x.grad is not None and x.grad.placements == (Replicate(),) and x.grad.shape == x.shape

    half = distribute_tensor(torch.randn(8, 4), fake_pg, [Replicate()]).to(torch.bfloat16)
    assert tp.redistribute_to_partial(half, (Partial("sum"),)).dtype == torch.bfloat16


def test_inductor_waits_late():
    import torch._inductor.config as inductor_config

    before = inductor_config.reorder_for_compute_comm_overlap
    with tp.inductor_waits_late():
        assert inductor_config.reorder_for_compute_comm_overlap is True
        assert inductor_config.reorder_for_compute_comm_overlap_passes == ["sink_waits"]
    assert inductor_config.reorder_for_compute_comm_overlap == before


def test_no_donated_buffers():
    before = torch._functorch.config.donated_buffer
    with tp.no_donated_buffers():
        assert torch._functorch.config.donated_buffer is False
    assert torch._functorch.config.donated_buffer == before


def test_dynamo_fallback_exceptions():
    from torch._subclasses.fake_tensor import DataDependentOutputException, UnsupportedFakeTensorException

    kinds = tp.dynamo_fallback_exceptions()
    assert DataDependentOutputException in kinds and UnsupportedFakeTensorException in kinds
    assert RuntimeError not in kinds  # any other backend error stays an error


def test_mask_partial_and_its_buffer_states(fake_pg):
    # A vocabulary-sharded embedding: DTensor masks the indices and leaves a _MaskPartial.
    weight = distribute_tensor(torch.randn(8, 4), fake_pg, [Shard(0)])
    ids = distribute_tensor(torch.tensor([0, 5, 7]), fake_pg, [Replicate()])
    out = torch.nn.functional.embedding(ids, weight)
    (placement,) = out.placements
    assert tp.is_mask_partial(placement) and placement.is_partial()
    assert not tp.is_mask_partial(Partial("sum")) and not tp.is_mask_partial(Replicate())

    restore = tp.mask_buffer_states([out, weight, None])
    out.redistribute(fake_pg, [Replicate()])  # the reduction uses the mask up
    with pytest.raises((AssertionError, RuntimeError)):
        out.redistribute(fake_pg, [Replicate()])
    restore()
    assert out.redistribute(fake_pg, [Replicate()]).shape == (3, 4)  # the mask is back


def test_clear_dtensor_sharding_cache_keeps_parameters_on_the_new_mesh():
    """After a process group is made again, new DTensors live on the new mesh, not a cached dead one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch_hca.runtime.mesh import reset_current_mesh

    meshes = []
    for _ in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        try:
            mesh = hca.init_mesh()
            t = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]) + 1
            meshes.append((mesh, t.device_mesh))
        finally:
            dist.destroy_process_group()
            reset_current_mesh()
    assert all(made is used for made, used in meshes)


def test_group_rank():
    """This process's coordinate in the group an op names: rank 3 of the world is rank 1 of {1, 3}."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        world = dist.group.WORLD.group_name
        assert tp.group_rank(world) == 3
        odd = dist.new_group([1, 3])
        assert isinstance(odd.group_name, str) and odd.group_name != world
        assert tp.group_rank(odd.group_name) == 1 and tp.group_size(odd.group_name) == 2
    finally:
        dist.destroy_process_group()


def test_default_store_is_the_rendezvous_store():
    """The store behind the default group: what one rank sets, the group can read."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        tp.default_store().set("hca/test", b"42")
        assert tp.default_store().get("hca/test") == b"42"
    finally:
        dist.destroy_process_group()


def test_graph_arg_source_and_python_scalars():
    seen = []

    def backend(gm, example_inputs):  # Dynamo drops the grapharg records after the backend returns
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        seen.append(
            ([tp.graph_arg_source(n) for n in placeholders], [tp.graph_arg_is_python_scalar(n) for n in placeholders])
        )
        return gm.forward

    def f(x, scale):
        return x * scale

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend)
    compiled(torch.ones(2), 0.5)
    compiled(torch.ones(2), 0.25)  # a float that changed: Dynamo passes it as a 0-d tensor
    torch._dynamo.reset()
    assert seen[-1] == (["L['x']", "L['scale']"], [False, True])


def test_graph_arg_is_tensor_property_for_a_views_size_and_offset():
    seen = []

    def backend(gm, example_inputs):
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        seen.append(
            [
                (tp.graph_arg_source(n), tp.graph_arg_is_tensor_property(n), tp.graph_arg_is_python_scalar(n))
                for n in placeholders
            ]
        )
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, n: x * n, backend=backend)
    rows = torch.ones(100, 4)
    compiled(rows[10:20], 3)
    compiled(rows[30:45], 4)  # another size and offset: both dynamic; an int that changed: a SymInt
    torch._dynamo.reset()
    # Dynamo's order of the inputs: whatever it is, each is named and classified.
    assert sorted(seen[-1]) == sorted(
        [
            ("L['x']", False, False),
            ("L['x'].size()[0]", True, False),
            ("L['x'].storage_offset()", True, False),
            ("L['n']", False, True),
        ]
    )


def test_group_members(fake_pg):
    world = dist.group.WORLD.group_name
    assert tp.group_members(world) == [0, 1, 2, 3]
    sub = dist.new_group([0, 2])  # this process is rank 0: a member
    assert tp.group_members(sub.group_name) == [0, 2]


def test_profiled_events_keep_tensor_list_shapes_and_memory(fake_pg):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        dist.all_reduce(torch.ones(3, 4))
        kept = torch.empty(1000)
    events = tp.profiled_events(prof)
    allreduce = next(e for e in events if e.name == "c10d::allreduce_")
    assert allreduce.shapes[0] == [[3, 4]] and allreduce.dtypes[0] == "TensorList"
    assert any(e.name == "[memory]" and e.nbytes == kept.numel() * 4 and e.on_cpu for e in events)


def test_ddp_bucket_bytes_hold_every_gradient(worlds):
    # On the test world's ranks, whose group outlives the module. Here, in pytest's process, the
    # module held the last reference to a one-rank gloo group, and its teardown hung once in CI:
    # ~ProcessGroupGloo, under the GIL, joined a worker that waited for the GIL.
    for buckets, parameters in worlds(2).run(dist_cases.ddp_bucket_and_parameter_bytes):
        assert buckets == parameters > 0


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_structured_trace_enabled_and_trace_artifact():
    from torch._logging._internal import trace_log

    handler = _Records()
    trace_log.addHandler(handler)  # what TORCH_TRACE=dir installs
    try:
        assert tp.structured_trace_enabled()
        tp.trace_artifact("hca_graph0_test", "string", lambda: "def forward(self): ...")
    finally:
        trace_log.removeHandler(handler)
    (record,) = handler.records
    assert record.metadata["artifact"] == {"name": "hca_graph0_test", "encoding": "string"}
    assert record.payload == "def forward(self): ..."


def test_quiet_cpu_alltoall_fallback_skips_only_that_warning(fake_pg):
    torch._logging.warning_once.cache_clear()  # DTensor warns once per process: start afresh
    handler = _Records()
    logger = logging.getLogger("torch.distributed.tensor._collective_utils")
    logger.addHandler(handler)
    move = lambda: distribute_tensor(torch.randn(8, 8), fake_pg, [Shard(0)]).redistribute(fake_pg, [Shard(1)])
    try:
        with tp.quiet_cpu_alltoall_fallback():
            move()
        assert not handler.records
        move()  # outside: warned, the once-per-process warning was not used up inside
        assert ["alltoall" in r.getMessage() for r in handler.records] == [True]
    finally:
        logger.removeHandler(handler)


def test_origin_tags_reach_the_forward_and_backward_graphs():
    """AOTAutograd copies node.meta["custom"] to what a node traces to, forward and backward (seq_nr)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                tp.set_origin(node, f"origin_{node.name}")
        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))(gm, example_inputs)

    torch._dynamo.reset()
    w = torch.randn(4, 4, requires_grad=True)
    torch.compile(lambda x: torch.tanh(x @ w), backend=backend)(torch.randn(2, 4)).sum().backward()
    tagged = lambda g: {tp.origin_of(n) for n in g.graph.nodes if n.op == "call_function"} - {None}
    assert len(tagged(graphs["forward"])) == 2 and tagged(graphs["backward"]) == tagged(graphs["forward"])
    assert tp.origin_of(next(iter(graphs["forward"].graph.find_nodes(op="placeholder")))) is None


def test_cpu_flash_attention_and_its_backward_are_sdpa_on_one_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(8, 8, dtype=torch.float64)
    out, lse = tp.cpu_flash_attention(q, k, v, mask, True, 0.3)
    assert lse.shape == (2, 4, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(
        *leaves, attn_mask=mask.masked_fill(~causal, float("-inf")), scale=0.3
    )
    grad = torch.randn_like(out)
    expected.backward(grad)
    torch.testing.assert_close(out, expected.detach())
    grads = tp.cpu_flash_attention_backward(grad, q, k, v, out, lse, mask, True, 0.3)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad)


def test_inductor_random_as_eager_keeps_aten_draws_in_the_decompositions():
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    assert aten.rand_like.default in select_decomp_table()  # Inductor's own generator, by default
    with tp.inductor_random_as_eager():
        assert inductor_config.fallback_random is True
        assert aten.rand_like.default not in select_decomp_table()
    assert inductor_config.fallback_random is False


def test_size_hint_reads_a_symbolic_size_as_the_examples():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from torch_hca._torch_private import size_hint

    env = ShapeEnv()
    rows = env.create_symintnode(env.create_symbol(6, ConstantSource("rows")), hint=6)
    assert isinstance(rows, torch.SymInt)
    assert size_hint(rows * 4) == 24 and size_hint(7) == 7


def test_storage_key_names_views_of_a_fake_dtensors_local_piece(fake_pg):
    """DTensor slices its local piece below autograd, so the view records no `_base`; its storage does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mesh = hca.init_mesh()
    with FakeTensorMode():
        y = DTensor.from_local(torch.randn(4, 8), mesh, (Replicate(),), run_check=False) * 1
        view, other = y[:, :4], y + 1
        assert view._local_tensor._base is None  # why the key is needed
        assert tp.storage_key(view._local_tensor) == tp.storage_key(y._local_tensor)
        assert tp.storage_key(other._local_tensor) != tp.storage_key(y._local_tensor)


def test_redistribute_plan_is_dtensors_order_of_steps():
    """A dim cut by both mesh dims is taken apart inner mesh dim first; a shard moved through
    Replicate where the nesting asks it (three steps for two changed placements)."""
    from torch.distributed.tensor import Partial

    assert tp.redistribute_plan([2, 2], [8, 4, 6], [Shard(0), Shard(0)], [Shard(1), Shard(2)]) == [
        (1, Shard(0), Shard(2)),
        (0, Shard(0), Shard(1)),
    ]
    assert tp.redistribute_plan([2, 2], [8, 4], [Shard(0), Shard(0)], [Replicate(), Shard(0)]) == [
        (1, Shard(0), Replicate()),
        (0, Shard(0), Replicate()),
        (1, Replicate(), Shard(0)),
    ]
    assert tp.redistribute_plan([4], [8], [Partial()], [Replicate()]) == [(0, Partial(), Replicate())]
