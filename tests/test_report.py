"""`hca.report`: its artifacts, options reaching the backend, debug dumps (fake process group)."""

from __future__ import annotations

import json
import weakref

import pytest
import torch

import torch_hca as hca
from torch_hca.tools import zoo


def compile_mlp(**kwargs):
    torch.manual_seed(0)
    # Big enough weights that the layout solver picks Megatron (docs/layout.md).
    model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(64, 256))
    compiled = torch.compile(model, backend="hca", **kwargs)
    compiled(torch.randn(8, 64)).sum().backward()
    return compiled


def test_report_artifacts(fake_pg):
    rep = hca.report(compile_mlp())
    g = rep.graph
    assert isinstance(g.joint, torch.fx.GraphModule) and rep.forward is not None and rep.backward is not None
    # The row-parallel bias, read as one summand by the layout solver's choice; the output's P -> R.
    assert [(r.src, r.dst) for r in g.redistributions] == [("(R)", "(P(sum))"), ("(P(sum))", "(R)")]
    assert g.redistributions[0].value == "l_self_modules_fc2_parameters_bias_"
    assert g.redistributions[0].reason == "out reads it so (layout solver)"
    assert (
        g.redistributions[1].reason == "to_output reads it so (layout solver)"
    )  # the result, as the caller receives it
    # What the solver costed next to what was traced from each move (read from the origin tags).
    assert [(r.costed, r.emitted) for r in g.redistributions] == [("local", "local"), ("all_reduce@0", "all_reduce@0")]
    assert "all_reduce@0  all_reduce@0" in rep.moves() and "== moves ==" in str(rep)
    assert " fc2.bias " in rep.moves()  # the value as its module path, not Dynamo's l_self_modules_... name
    assert set(g.parameters) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert g.parameters["fc2.weight"]["placements"] == "(S(1))"
    (c,) = rep.collectives
    assert (c.kind, c.direction, c.group_size, c.bytes, c.shape) == ("all_reduce", "forward", 4, 8 * 64 * 4, (8, 64))
    assert c.wire_bytes == 2 * 3 / 4 * c.bytes  # ring all-reduce: 2(n-1)/n of the payload
    assert [p.name for p in g.passes] == [
        "lift",
        "layout",
        "roles",
        "origins",
        "transpose",
        "collective_rewrites",
        "backward_kept",
        "schedule_forward",
        "schedule_backward",
    ]
    assert g.schedules["forward"]["per_group"] and g.schedules["backward"]["per_group"] == {}


def test_strategy_is_json_and_versioned(fake_pg):
    data = json.loads(hca.report(compile_mlp()).to_json())
    assert data["version"] == 1 and data["mesh"] == {"shape": [4], "names": [], "device_type": "cpu"}
    (graph,) = data["graphs"]
    assert graph["parameters"]["fc1.weight"]["shape"] == [256, 64]
    assert graph["layout"]["solver"] == "milp (scipy HiGHS)" and graph["layout"]["status"] == "optimal"
    assert any(v["placements"] == "(P(sum))" for v in graph["values"].values())


def test_mode_and_options_reach_the_backend(fake_pg):
    rep = hca.report(compile_mlp(mode="max-autotune-no-cudagraphs"))
    assert rep.graph.options.mode == "max-autotune-no-cudagraphs"
    torch._dynamo.reset()
    rep = hca.report(compile_mlp(options={"strict": True}))
    assert rep.graph.options.strict and rep.graph.implicit_redistributions == []


def test_debug_dir_dumps_every_stage(fake_pg, tmp_path):
    compile_mlp(options={"debug_dir": str(tmp_path)})
    names = {p.name.split("_", 1)[1] for p in (tmp_path / "rank0").iterdir()}  # each rank its own folder
    for stage in (
        "dynamo.py",
        "layout_before.py",
        "layout_after.py",
        "transpose_after.py",
        "schedule_forward_after.py",
        "schedule_backward_after.py",
        "collectives.txt",
        "report.json",
        "strategy.json",
    ):
        assert stage in names, f"{stage} not dumped; got {sorted(names)}"


def test_debug_dirs_strategy_file_verifies_and_loads(fake_pg, tmp_path):
    """The graph's strategy file in debug_dir is a strategy file: the verifier accepts it, and a
    compile that loads it probes and solves nothing and gives the same program."""
    solved = hca.report(compile_mlp(options={"debug_dir": str(tmp_path / "debug")}))
    path = tmp_path / "debug" / "rank0" / f"graph{solved.graph.index}_strategy.json"
    assert hca.verify(str(path)).ok
    torch._dynamo.reset()
    loaded = hca.report(compile_mlp(options={"strategy": str(path)}))
    assert loaded.graph.layout.solver == f"strategy file {path}" and loaded.graph.layout.probe_seconds == 0.0
    assert loaded.table() == solved.table() and loaded.graph.dtensor_code == solved.graph.dtensor_code


def test_report_without_argument_is_the_last_graph(fake_pg):
    compiled = compile_mlp()
    assert hca.report().graph is hca.report(compiled).graph


def test_str_shows_program_and_table(fake_pg):
    text = str(hca.report(compile_mlp()))
    assert "DTensor program" in text and "all_reduce" in text and "torch_hca_compiler_dtensor_ops_redistribute" in text


def test_report_never_matches_a_dead_models_graph(fake_pg):
    """A new model may reuse a dead model's parameter ids; its report must not inherit that graph."""
    import gc

    for _ in range(3):
        compile_mlp()
        gc.collect()
    torch.manual_seed(0)
    model = hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock())
    compiled = torch.compile(model, backend="hca")
    compiled(torch.randn(2, 6, 16)).sum().backward()
    rep = hca.report(compiled)
    assert len(rep.graphs) == 1 and "norm1" in rep.dtensor_code


def test_graph_report_checks_identity_not_just_id():
    from torch_hca.report.records import GraphReport

    g = GraphReport(index=0, options=None)
    old, new = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    g.param_refs[id(new)] = weakref.ref(old)  # what a reused id looks like
    assert not g.reads_any([new])
    g.add_parameter(new)
    assert g.reads_any([new])


def test_measured_sets_the_clock_beside_the_prediction(fake_pg):
    from torch_hca.report.timeline import CALL

    compiled = compile_mlp(options={"cost_model": {"call_s": 1e-3}})  # the first call: compiled, checked, not timed
    rep = hca.report(compiled)
    with pytest.raises(hca.HCAError, match="has not run after its first call"):
        rep.measured()
    for _ in range(3):
        compiled(torch.randn(8, 64)).sum().backward()
    got = rep.measured()
    g = rep.graph
    assert [len(g.call_times[w]) for w in ("forward", "backward")] == [3, 3] and got.calls == 3
    medians = {f"graph{g.index}.{w}": sorted(g.call_times[w])[1] for w in ("forward", "backward")}
    assert got.per_graph_s == medians and got.measured_s == pytest.approx(sum(medians.values()))
    after = rep.timeline().after
    calls = [e for e in after.events if e.name == CALL]
    # The host work around each call (call_s) is outside what the clock here sees.
    assert [e.duration_s for e in calls] == pytest.approx([1e-3, 1e-3]) and got.predicted_s == pytest.approx(
        after.total_s - 2e-3
    )
    assert got.error == pytest.approx(got.predicted_s / got.measured_s - 1)
    assert str(got).startswith(f"predicted {got.predicted_s * 1e3:.2f} ms vs measured {got.measured_s * 1e3:.2f} ms")
    with pytest.raises(hca.HCAError, match="inner='dtensor' runs the DTensor program eagerly"):
        hca.report(compile_mlp(options={"inner": "dtensor"})).measured()
    rep.graph.mesh = {**rep.graph.mesh, "device_type": "cuda"}  # a CUDA call returns before its kernels finish
    with pytest.raises(hca.HCAError, match="torch.profiler"):
        rep.measured()


def test_module_paths_as_people_write_them():
    from torch_hca.report.text import module_path

    assert module_path("getattr(L['self'].__dict__['_hca_logical'].inner.blocks, '0').attn.wq") == "blocks.0.attn.wq"
    assert module_path("L['self'].__dict__['_hca_logical'].inner.norm") == "norm"
    assert module_path("getattr(getattr(L['self'].layers, '0'), '1').fc") == "layers.0.1.fc"
    assert module_path("L['self']._modules['fc1']") == "fc1"
    assert module_path("L['self']") == "" and module_path("fc2.bias") == "fc2.bias"


def test_rules_name_mesh_dimensions_where_the_mesh_has_names():
    from torch_hca.passes.origins import Origin

    named = Origin("redistribute", "redistribute", (("P", "S0"),), ("R", "S0"), "blocks.0", mesh_names=("tp", "dp"))
    assert named.describe(0) == "redistribute (redistribute, blocks.0; mesh dim 'tp': P -> R)"
    unnamed = Origin("redistribute", "redistribute", (("P",),), ("R",), "blocks.0")
    assert unnamed.describe(0) == "redistribute (redistribute, blocks.0; mesh dim 0: P -> R)"


def test_report_rule_cells_are_at_most_three_lines_and_json_keeps_them_whole(fake_pg):
    rep = hca.report(compile_mlp())
    rule = rep.graph.collectives[0].rule = "why " * 100
    from torch_hca.report.text import WIDTH

    lines = rep.table(WIDTH).splitlines()
    assert len(lines) == 4 and lines[-1].endswith("...") and all(len(line) <= WIDTH for line in lines)
    assert rule in rep.to_json() and rule.strip() in rep.table()
    # str(report): no line wider than WIDTH, Dynamo's sources nowhere.
    text = str(rep)
    assert not [line for line in text.splitlines() if len(line) > WIDTH] and "L['self']" not in text


def test_moves_name_mesh_dims_as_the_mesh_does():
    from torch_hca.report.text import mesh_dims_named

    assert mesh_dims_named("all_gather@0, all_reduce@1", ["dp", "tp"]) == "all_gather@dp, all_reduce@tp"
    assert mesh_dims_named("all_reduce@0", []) == "all_reduce@0"  # an unnamed mesh keeps its dim numbers
    assert mesh_dims_named("local", ["dp"]) == "local"
