"""The layout solver finds the known-good strategies on its own (fake process group, world 4).

Each test states only how parameters are stored (and the I/O layouts); the
solver chooses every activation's layout. The collectives in the compiled
graphs, by kind and count, show which strategy it found. Scheduling is off
here so each collective is counted before bucketing merges them.
Numerics of the same layouts are checked on real ranks in test_parity.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import torch_hca as hca
from torch_hca.compiler.layout import candidates as layout_candidates
from torch_hca.compiler.layout import probes as layout_probes
from torch_hca.compiler.layout import solver as layout_solver
from torch_hca.compiler.layout.move_costs import Costs
from torch_hca.compiler.layout.value_row import ValueRow
from torch_hca.tools import zoo

from dist_cases import NormMLP


def compile_and_step(model, x, **options):
    compiled = torch.compile(
        model, backend="hca", options={"strict": True, "schedule": False, **options}, dynamic=False
    )
    compiled(x).sum().backward()
    rep = hca.report(compiled)
    if options.get("layout", "solve") == "solve":
        assert all(g.layout.left_to_dtensor == [] for g in rep.graphs), "DTensor still redistributes on its own"
    return rep


def counts(rep):
    return rep.collective_counts("forward"), rep.collective_counts("backward")


def test_megatron_mlp(fake_pg):
    rep = compile_and_step(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(64, 256)), torch.randn(8, 64))
    assert counts(rep) == ({"all_reduce": 1}, {})
    layout = rep.graph.layout
    assert layout.solver == "milp (scipy HiGHS)" and layout.status == "optimal"
    assert layout.bound_s == pytest.approx(layout.objective_s)


def test_megatron_block_one_all_reduce_per_half_each_way(fake_pg):
    rep = compile_and_step(hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512)), torch.randn(2, 6, 128))
    assert counts(rep) == ({"all_reduce": 2}, {"all_reduce": 2})


def test_small_weights_are_gathered_instead(fake_pg):
    # Same storage, tiny weights: gathering them (one bucket) beats two all-reduces
    # of the activations under the gloo model. The solver says so; it is not a bug.
    rep = compile_and_step(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16))
    assert counts(rep) == ({"all_gather": 3}, {})


def test_sequence_parallel_when_activation_memory_costs(fake_pg):
    plan = {"*.mlp.fc1.*": Shard(0), "*.mlp.fc2.weight": Shard(1)}
    x = torch.randn(2, 16, 128)
    two = lambda: nn.Sequential(NormMLP(128, 512), NormMLP(128, 512))
    free = compile_and_step(hca.sharded(plan)(two()), x)
    # Megatron: per block one all-reduce forward, one backward (each norm's output
    # feeds column-parallel weights; its cotangent is partial and the norm needs it whole).
    assert counts(free) == ({"all_reduce": 2}, {"all_reduce": 2})
    torch._dynamo.reset()
    tight = compile_and_step(hca.sharded(plan)(two()), x, memory_weight=1e-7)
    fw, bw = counts(tight)
    # Reduce-scatter into a sequence-sharded residual + norm region, all-gather out of it.
    assert "all_reduce" not in fw and fw["reduce_scatter"] == 2 and fw["all_gather"] >= 2, fw
    values = {r.value: r for r in tight.graph.layout.values}
    assert values["layer_norm_1"].placement == "(S(1))"
    assert values["layer_norm"].placement == "(R)"  # the input is replicated and needs no gradient
    # Backward: the transposes (all-gather <-> reduce-scatter) and the norm weights' partial gradients.
    assert bw.get("all_gather") == 2 and bw.get("reduce_scatter", 0) >= 1, bw


def test_data_parallel(fake_pg):
    model = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 4))
    rep = compile_and_step(model, torch.randn(8, 16))
    assert counts(rep) == ({}, {"all_reduce": 8})


def test_fsdp_gathers_weights_when_they_are_small(fake_pg):
    model = hca.sharded({"*": Shard(0)}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 4))
    rep = compile_and_step(model, torch.randn(64, 16))
    # Forward all-gather of every weight and bias, backward reduce-scatter of their gradients.
    assert counts(rep) == ({"all_gather": 8}, {"reduce_scatter": 8})


def test_fsdp_storage_gathers_activations_when_weights_are_big(fake_pg):
    model = hca.sharded({"*": Shard(0)}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(256, 2))
    rep = compile_and_step(model, torch.randn(1, 256))
    fw, _ = counts(rep)
    gathered = [c for c in rep.collectives if c.kind == "all_gather" and c.direction == "forward"]
    weights = 256 * 256 * 4
    assert gathered and all(c.bytes < weights for c in gathered), [c.bytes for c in gathered]


def _two_d_mlp(**options):
    torch.distributed.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch_hca.runtime.mesh import reset_current_mesh

    reset_current_mesh()
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    hca.init_mesh((2, 2), ("dp", "tp"))
    layout = (Shard(0), Replicate())
    model = hca.sharded(zoo.two_d(zoo.MEGATRON_MLP), inputs=layout, outputs=layout)(zoo.MLP(64, 256))
    return compile_and_step(model, torch.randn(4, 64), **options)


def test_two_d_mesh(fake_pg):
    rep = _two_d_mlp()
    fw, bw = counts(rep)
    assert fw == {"all_reduce": 1} and bw == {"all_reduce": 4}
    groups = {c.direction: c.group for c in rep.collectives}
    assert groups["forward"] != groups["backward"]  # tp in forward, dp in backward


def test_two_d_probes_each_mesh_dim_first_and_chooses_the_same(fake_pg, monkeypatch):
    """A combination of layouts on a (2, 2) mesh is probed whole only where each mesh dim's part
    runs alone on its 1-D mesh: far fewer of DTensor's slow 2-D probes, the same strategies."""

    def solve(shortcut: bool):
        monkeypatch.setattr(layout_probes, "_PROBES", {})  # the probe cache is process-wide
        if not shortcut:
            monkeypatch.setattr(layout_candidates, "submeshes", lambda mesh: [])
        rep = _two_d_mlp()
        whole = sum(len(key[-1]) == 2 for key in layout_probes._PROBES)  # key[-1]: the mesh's shape
        return rep, whole

    fast, fast_whole = solve(True)
    slow, slow_whole = solve(False)
    assert fast_whole < slow_whole / 4, (fast_whole, slow_whole)
    assert [(c.kind, c.bytes, c.direction, c.node) for c in fast.collectives] == [
        (c.kind, c.bytes, c.direction, c.node) for c in slow.collectives
    ]
    assert fast.graph.layout.values == slow.graph.layout.values


def test_two_d_mesh_with_cheaper_compute_gathers_the_batch(fake_pg):
    # Five times the default compute rate (what one core's sgemm reaches here): replicating
    # the small MLP's work over dp now beats reducing its gradients. The batch is gathered
    # over dp, and the output's tp all-reduce runs on this rank's dp chunk only. In
    # backward the chunk's transpose is an all-gather, paired by the transpose pass (strict).
    rep = _two_d_mlp(cost_model={"flops_per_s": 100e9})
    assert counts(rep) == ({"all_gather": 1, "all_reduce": 1}, {"all_gather": 1})
    (back,) = [c for c in rep.collectives if c.direction == "backward"]
    assert back.rule.startswith("transpose of the local chunk (R -> S) in redistribute")


def test_explain_names_every_value_and_why(fake_pg):
    rep = compile_and_step(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(64, 256)), torch.randn(8, 64))
    text = rep.explain()
    assert "layout by milp (scipy HiGHS), optimal" in text
    for row in rep.graph.layout.values:
        assert row.value[:24] in text
    assert "parameter storage" in text
    assert "linear" in text and "beat (R)" in text
    assert rep.strategy()["graphs"][0]["layout"]["solver"] == "milp (scipy HiGHS)"


def test_value_rows_are_typed_and_the_json_keeps_their_keys(fake_pg):
    """The solver writes one `ValueRow` per value; the report's JSON has each as the dict it always had."""
    rep = compile_and_step(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16))
    rows = rep.graph.layout.values
    assert rows and all(isinstance(r, ValueRow) for r in rows)
    written = json.loads(rep.to_json())["graphs"][0]["layout"]["values"]
    keys = {"value", "shape", "placement", "reads", "compute_us", "forward_comm_us", "backward_comm_us", "memory_bytes"}
    assert [set(d) for d in written] == [keys | {"why"}] * len(rows)
    assert written == [r.as_dict() for r in rows]
    assert all(isinstance(d["shape"], list) and isinstance(d["reads"], list) for d in written)


def test_dtensor_layout_option_keeps_dtensors_choices(fake_pg):
    rep = compile_and_step(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16), layout="dtensor")
    assert rep.graph.layout.solver.startswith("none")
    assert counts(rep) == ({"all_reduce": 1}, {})


def test_memory_budget_too_small_names_the_values(fake_pg):
    model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(64, 256))
    compiled = torch.compile(model, backend="hca", options={"memory_budget": 100}, dynamic=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.randn(8, 64))
    err = info.value.inner_exception
    assert isinstance(err, hca.PlanError)
    assert "no layout fits memory_budget=100 B per rank" in str(err) and "linear" in str(err)


def test_exact_beats_or_ties_greedy_and_costs_agree(fake_pg):
    from torch_hca._torch_private import fake_mode_of
    from torch_hca.spmd.cost_model import cost_model

    graphs = []
    model = hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512))
    torch.compile(model, backend=lambda g, _: graphs.append(g) or g.forward, dynamic=False)(torch.randn(2, 6, 128))
    (g,) = graphs
    costs = cost_model("gloo")
    fake = fake_mode_of([n.meta.get("example_value") for n in g.graph.find_nodes(op="placeholder")])
    params = {n for n in g.graph.find_nodes(op="placeholder") if "parameters" in n.name}
    storage = lambda n: tuple(n.meta["example_value"].placements) if n in params else None
    with fake:
        ops = layout_candidates.build_ops(g, hca.current_mesh(), costs, storage)
    c = Costs(hca.current_mesh(), costs)
    exact = layout_solver.solve(ops, c)
    greedy = layout_solver.greedy(ops, c, 0.0)
    # The integer program's objective is the model's cost of its choice, and no worse than greedy's.
    assert exact.objective_s == pytest.approx(layout_solver.total_cost(ops, c, exact.choice, 0.0))
    assert exact.objective_s <= layout_solver.total_cost(ops, c, greedy, 0.0) + 1e-12


def test_repeated_layers_are_probed_once(fake_pg):
    layout_probes._PROBES.clear()
    compile_and_step(hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 2)), torch.randn(8, 16))
    two = len(layout_probes._PROBES)
    torch._dynamo.reset()
    compile_and_step(hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 8)), torch.randn(8, 16))
    assert len(layout_probes._PROBES) == two  # six more layers, no new probe


def test_plan_with_a_budget_finds_megatron_storage(fake_pg):
    model = zoo.MLP(64, 256)
    x = torch.randn(8, 64)
    assert all(layout == (Replicate(),) for layout in hca.plan(model, (x,)).values())  # no budget: replicate
    plan = hca.plan(model, (x,), memory_budget=150_000)
    assert plan == {
        "fc1.weight": (Shard(0),),
        "fc1.bias": (Shard(0),),
        "fc2.weight": (Shard(1),),
        "fc2.bias": (Replicate(),),
    }
    # hca.sharded accepts it as is.
    rep = compile_and_step(hca.sharded(plan)(zoo.MLP(64, 256)), x)
    assert counts(rep) == ({"all_reduce": 1}, {})
    with pytest.raises(hca.PlanError, match=r"no layout fits memory_budget=60000 B per rank .*fc1_parameters_weight"):
        hca.plan(model, (x,), memory_budget=60_000)


def test_language_model_compiles_in_one_graph_without_strided_shards(fake_pg):
    # A flattened (batch, heads) dim sharded inside is a _StridedShard, which DTensor
    # cannot always move while tracing: the solver never picks a layout that makes one.
    model = hca.sharded(zoo.TP_LM)(zoo.TinyLM(vocab=64, dim=128, heads=4, hidden=512, layers=1))
    rep = compile_and_step(model, torch.randint(0, 64, (8, 64)))
    assert len(rep.graphs) == 1
    assert not any("_StridedShard" in str(v["placements"]) for v in rep.graph.values.values())


def test_a_linears_compute_is_priced_at_its_pieces_smallest_dimension(fake_pg, monkeypatch):
    """With matmul_half_dim h the solver prices each strategy of a Linear(16, 16) on 4 rows a
    rank at d / (d + h) of the rate, d the smallest of this rank's rows, reduction and width:
    the batch split leaves 4 rows, the whole op min(4n, 16)."""
    built, build_ops = [], layout_candidates.build_ops
    monkeypatch.setattr(layout_candidates, "build_ops", lambda *a, **k: built.append(build_ops(*a, **k)) or built[-1])
    for extra in ({}, {"matmul_half_dim": 8}):
        torch._dynamo.reset()
        model = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(nn.Linear(16, 16))
        compile_and_step(model, torch.randn(4, 16), cost_model={"memory_bytes_per_s": 1e30, **extra})
    flat, scaled = [
        {
            (st.inputs, st.output): st.compute_s
            for op in ops
            if op.node.target is torch._C._nn.linear
            for st in op.strategies
        }
        for ops in built
    ]
    assert flat.keys() == scaled.keys()
    n = hca.current_mesh().size()
    split = ((Shard(0),), (Replicate(),), (Replicate(),)), (Shard(0),)
    whole = ((Replicate(),), (Replicate(),), (Replicate(),)), (Replicate(),)
    assert scaled[split] == pytest.approx(flat[split] * (4 + 8) / 4)
    d = min(4 * n, 16)
    assert scaled[whole] == pytest.approx(flat[whole] * (d + 8) / d)
    assert flat[whole] == pytest.approx(n * flat[split])  # without h, a rank's share of the rows costs its share


def test_each_strategy_is_charged_by_its_local_pieces(fake_pg, monkeypatch):
    """A rank does the work its pieces hold: a replicated weight read as Partial beside a
    replicated input (each rank holds the whole weight, halved) is the whole matmul on every
    rank; a batch split is each rank's rows; a weight split is each rank's columns."""
    built, build_ops = [], layout_candidates.build_ops
    monkeypatch.setattr(layout_candidates, "build_ops", lambda *a, **k: built.append(build_ops(*a, **k)) or built[-1])
    model = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(nn.Linear(64, 64, bias=False))
    compile_and_step(model, torch.randn(32, 64), cost_model={"memory_bytes_per_s": 1e30})  # 32 rows a rank
    (ops,) = built
    priced = {
        (st.inputs, st.output): st.compute_s
        for op in ops
        if op.node.target is torch._C._nn.linear
        for st in op.strategies
    }
    n = hca.current_mesh().size()
    R, P = (Replicate(),), (torch.distributed.tensor.Partial(),)
    whole = priced[(R, R), R]
    assert priced[(P, R), P] == pytest.approx(whole)  # not whole / n: every rank multiplies it all
    assert priced[(R, P), P] == pytest.approx(whole)
    assert priced[((Shard(0),), R), (Shard(0),)] == pytest.approx(whole / n)  # rows split
    built.clear()
    torch._dynamo.reset()
    model = hca.sharded({"weight": Shard(0)}, inputs=Replicate(), outputs=Replicate())(nn.Linear(64, 64, bias=False))
    compile_and_step(model, torch.randn(32 * n, 64), cost_model={"memory_bytes_per_s": 1e30})  # the same global rows
    column = {
        (st.inputs, st.output): st.compute_s
        for op in built[0]
        if op.node.target is torch._C._nn.linear
        for st in op.strategies
    }
    assert column[(R, (Shard(0),)), (Shard(1),)] == pytest.approx(whole / n)  # each rank its output columns


def test_a_shard_to_shard_move_is_priced_as_what_runs(fake_pg):
    """DTensor runs S(a) -> S(b) on a CPU mesh as an all_gather of the whole value (it assumes gloo
    has no all_to_all), forward and in the backward (the transpose is S(b) -> S(a)); on a CUDA mesh
    it is an all_to_all, which sends from each rank's piece: a quarter of those bytes at 4 ranks."""
    from types import SimpleNamespace

    from torch_hca.spmd.collective_kinds import Kind
    from torch_hca.spmd.cost_model import DEFAULTS

    model, nbytes, n = DEFAULTS["gloo"], 64 * 2**20, 4
    cpu, cuda = Costs(hca.current_mesh(), model), Costs(SimpleNamespace(shape=(n,), device_type="cuda"), model)
    gather, piece = model.collective_s(Kind.ALL_GATHER, nbytes, n), model.collective_s(Kind.ALL_TO_ALL, nbytes / n, n)
    assert piece < gather / 3
    assert cpu.forward(nbytes, (Shard(0),), (Shard(1),)) == pytest.approx(gather)
    assert cpu.backward(nbytes, (Shard(0),), (Shard(1),), (True,))[0] == pytest.approx(gather)
    assert cuda.forward(nbytes, (Shard(0),), (Shard(1),)) == pytest.approx(piece)
    assert cuda.backward(nbytes, (Shard(0),), (Shard(1),), (True,))[0] == pytest.approx(piece)
