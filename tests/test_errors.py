"""Bad input: each mistake raises the right `HCAError` subclass with a message that
names the thing at fault and says what to write instead.

Fake process groups only (the `fake_pg` fixture, world size 4): nothing here runs
a collective, so these tests are fast.
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import torch_hca as hca
from torch_hca.tools import zoo
from torch_hca.runtime.mesh import reset_current_mesh
from torch_hca.compiler.options import Options

# Every option's name, as the message lists them (derived: a new option must not break these rows).
OPTION_NAMES = sorted(f.name for f in dataclasses.fields(Options) if f.name != "mode")


def _noop():
    """A module-level function for `hca.launch` (never actually run)."""
    return None


def _mesh_2d():
    """A (dp=2, tp=2) mesh inside the fake world of 4."""
    return hca.init_mesh((2, 2), ("dp", "tp"))


# --------------------------------------------------------------------------- plans


def test_pattern_matching_no_parameter(fake_pg):
    with pytest.raises(hca.PlanError, match=r"pattern 'fc3\.\*' matches no parameter of MLP") as info:
        hca.sharded({"fc3.*": Shard(0)})(zoo.MLP())
    # The message lists the parameters there are, so the typo is easy to spot.
    for name in ("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"):
        assert repr(name) in str(info.value)
    assert not isinstance(info.value, hca.PlacementError)


def test_plan_not_a_dict(fake_pg):
    with pytest.raises(hca.PlanError, match=r"the plan must map parameter-name patterns to placements, got list"):
        hca.sharded([("fc1.*", Shard(0))])(zoo.MLP())


def test_plan_key_not_a_string(fake_pg):
    with pytest.raises(hca.PlanError, match=r"plan key 0 must be a glob string like 'fc1\.\*'"):
        hca.sharded({0: Shard(0)})(zoo.MLP())


def test_plan_value_not_a_placement(fake_pg):
    with pytest.raises(
        hca.PlanError, match=r"parameter 'fc1\.weight' \(pattern 'fc1\.weight'\): 'shard' is not a placement"
    ) as info:
        hca.sharded({"fc1.weight": "shard"})(zoo.MLP())
    assert "write Shard(d), Replicate(), or a tuple" in str(info.value)
    assert not isinstance(info.value, hca.PlacementError)


def test_plan_value_placement_class_not_instance(fake_pg):
    # `Shard` without "(d)": the class, not a placement.
    with pytest.raises(
        hca.PlanError, match=r"parameter 'fc2\.bias' \(pattern 'fc2\.bias'\): .*is not a placement; write Shard\(d\)"
    ):
        hca.sharded({"fc2.bias": Replicate})(zoo.MLP())


def test_overlapping_patterns_disagree(fake_pg):
    plan = {"fc1.*": Shard(0), "*.weight": Shard(1)}
    with pytest.raises(
        hca.PlanError, match=r"parameter 'fc1\.weight' is matched by 'fc1\.\*' .* and by '\*\.weight'"
    ) as info:
        hca.sharded(plan)(zoo.MLP())
    assert "make the patterns disjoint" in str(info.value)


def test_overlapping_patterns_that_agree_are_fine(fake_pg):
    model = hca.sharded({"fc1.*": Shard(0), "fc1.weight": Shard(0)})(zoo.MLP())
    assert model.fc1.weight.placements == (Shard(0),)


def test_sharded_twice_on_an_instance(fake_pg):
    model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP())
    with pytest.raises(hca.PlanError, match=r"this MLP is already sharded; apply the decorator once"):
        hca.sharded(zoo.MEGATRON_MLP)(model)


def test_sharded_instance_of_decorated_class(fake_pg):
    @hca.sharded(zoo.MEGATRON_MLP)
    class MLP(zoo.MLP):
        pass

    with pytest.raises(
        hca.PlanError, match=r"already sharded; apply the decorator once, to the class or to the instance"
    ):
        hca.sharded(zoo.MEGATRON_MLP)(MLP())


@pytest.mark.parametrize("target", [lambda x: x, "MLP", 3])
def test_sharded_not_a_module(fake_pg, target):
    with pytest.raises(hca.PlanError, match=r"hca\.sharded decorates an nn\.Module class or instance, not "):
        hca.sharded(zoo.MEGATRON_MLP)(target)


def test_sharded_a_class_not_a_module_class(fake_pg):
    class NotAModule:
        pass

    with pytest.raises(hca.PlanError, match=r"decorates an nn\.Module class or instance, not type"):
        hca.sharded(zoo.MEGATRON_MLP)(NotAModule)


def test_failed_plan_leaves_the_module_untouched(fake_pg):
    model = zoo.MLP()
    with pytest.raises(hca.PlanError):
        hca.sharded({"fc1.*": Shard(0), "nope": Shard(0)})(model)
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert getattr(model, "_hca_spec", None) is None
    hca.sharded(zoo.MEGATRON_MLP)(model)  # the corrected plan still applies
    assert isinstance(model.fc1.weight, DTensor)


# ---------------------------------------------------------------------- placements


def test_shard_dimension_the_tensor_lacks(fake_pg):
    with pytest.raises(
        hca.PlacementError,
        match=r"parameter 'fc1\.bias' \(pattern 'fc1\.bias'\): Shard\(1\) on a tensor of shape \(32,\)",
    ) as info:
        hca.sharded({"fc1.bias": Shard(1)})(zoo.MLP())
    assert "pick a dimension in 0..0" in str(info.value)


def test_negative_shard_dimension_out_of_range(fake_pg):
    with pytest.raises(
        hca.PlacementError,
        match=r"parameter 'fc2\.weight' .*Shard\(-3\) on a tensor of shape \(16, 32\).*pick a dimension in 0\.\.1",
    ):
        hca.sharded({"fc2.weight": Shard(-3)})(zoo.MLP())


def test_uneven_shard_is_torch_chunks_cut(fake_pg):
    # hidden=30: fc1.weight is (30, 16); 30 rows over 4 ranks are cut as torch.chunk cuts (8, 8, 8, 6),
    # as DTensor stores them; read only as stored (tests/test_uneven_pieces.py).
    model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(dim=16, hidden=30))
    assert model.fc1.weight.to_local().shape == (8, 16)


def test_shard_leaving_a_rank_without_rows(fake_pg):
    # hidden=3 over 4 ranks: torch.chunk's pieces are 1, 1, 1 and none for rank 3.
    with pytest.raises(
        hca.PlacementError,
        match=r"parameter 'fc1\.weight' \(pattern 'fc1\.\*'\): dimension 0 of size 3 cut by S\(0\) over the mesh \(4,\) "
        r"leaves the rank at mesh coordinate \(3,\) without rows",
    ) as info:
        hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(dim=16, hidden=3))
    assert "change the size or the mesh, or shard another dimension" in str(info.value)


def test_uneven_shard_over_two_mesh_dims(fake_pg):
    mesh = _mesh_2d()
    # dim 0 of fc2.bias (size 3) split over dp and tp as DTensor cuts it: 2 : 1, then 1 : 1 and 1 : 0.
    with pytest.raises(
        hca.PlacementError,
        match=r"parameter 'fc2\.bias' .*dimension 0 of size 3 cut by \(S\(0\), S\(0\)\) over the mesh \(2, 2\) "
        r"leaves the rank at mesh coordinate \(1, 1\) without rows",
    ):
        hca.sharded({"fc2.bias": (Shard(0), Shard(0))}, mesh=mesh)(zoo.MLP(dim=3, hidden=8))


def test_wrong_number_of_placements_for_the_mesh(fake_pg):
    mesh = _mesh_2d()
    with pytest.raises(
        hca.PlacementError,
        match=r"parameter 'fc1\.weight' \(pattern 'fc1\.weight'\): 1 placement\(s\) \(Shard\(dim=0\),\) for a 2-D mesh \(2, 2\)",
    ) as info:
        hca.sharded({"fc1.weight": (Shard(0),)}, mesh=mesh)(zoo.MLP())
    assert "give one placement per mesh dimension" in str(info.value)


def test_bare_shard_on_a_2d_mesh(fake_pg):
    # A bare placement is a 1-D layout: Shard(0) alone is ambiguous on (dp, tp).
    _mesh_2d()  # current mesh
    with pytest.raises(
        hca.PlacementError,
        match=r"parameter 'fc2\.weight' .*1 placement\(s\) .* for a 2-D mesh .*one placement per mesh dimension",
    ):
        hca.sharded({"fc2.weight": Shard(1)})(zoo.MLP())


def test_bare_replicate_and_default_io_on_a_2d_mesh(fake_pg):
    # Not an error: a bare Replicate() (also the inputs/outputs default) is
    # unambiguous on any mesh, so the user need not spell (Replicate(), Replicate()).
    mesh = _mesh_2d()
    model = hca.sharded({"fc1.weight": (Replicate(), Shard(0)), "fc2.*": Replicate()}, mesh=mesh)(zoo.MLP())
    assert model.fc2.weight.placements == (Replicate(), Replicate())
    assert model._hca_spec.inputs == (Replicate(), Replicate())
    assert model._hca_spec.outputs == (Replicate(), Replicate())


def test_partial_as_parameter_storage(fake_pg):
    with pytest.raises(
        hca.PlacementError,
        match=r"parameter 'fc2\.weight' \(pattern 'fc2\.weight'\): Partial\(\) is not a storage placement",
    ) as info:
        hca.sharded({"fc2.weight": Partial()})(zoo.MLP())
    assert "use Shard(d) or Replicate()" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({"inputs": Partial()}, "inputs"),
        ({"outputs": Partial()}, "outputs"),
        ({"inputs": [Replicate(), Partial()]}, r"inputs\[1\]"),
    ],
)
def test_partial_as_forward_io(fake_pg, kwargs, what):
    with pytest.raises(
        hca.PlacementError,
        match=rf"hca\.sharded {what}: Partial\(\) is not supported for forward arguments or results; use Shard\(d\) or Replicate\(\)",
    ):
        hca.sharded(zoo.MEGATRON_MLP, **kwargs)(zoo.MLP())


def test_io_not_a_placement(fake_pg):
    with pytest.raises(
        hca.PlanError, match=r"hca\.sharded outputs: 'replicate' is not a placement; write Shard\(d\), Replicate\(\)"
    ):
        hca.sharded(zoo.MEGATRON_MLP, outputs="replicate")(zoo.MLP())


def test_input_shard_dimension_the_argument_lacks(fake_pg):
    model = hca.sharded(zoo.MEGATRON_MLP, inputs=Shard(2))(zoo.MLP())
    with pytest.raises(
        hca.PlacementError,
        match=r"forward argument 0: inputs placement Shard\(2\) on a tensor of shape \(8, 16\); change `inputs=` in hca\.sharded",
    ):
        model(torch.randn(8, 16))


# ----------------------------------------------------------------------------- mesh


def test_no_mesh_and_no_process_group():
    assert not dist.is_initialized()
    reset_current_mesh()
    with pytest.raises(
        hca.MeshError, match=r"no mesh given and none is current; call hca\.init_mesh\(\) first or pass mesh=\.\.\."
    ):
        hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP())


def test_init_mesh_without_process_group_or_env(monkeypatch):
    assert not dist.is_initialized()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        hca.MeshError,
        match=r"no process group is initialized and the environment lacks RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT\. Put the work in a function and end the script with `hca\.run\(main, n\)`",
    ):
        hca.init_mesh(device_type="cpu")
    assert not dist.is_initialized()


def test_no_mesh_in_a_world_without_current_mesh(fake_pg):
    reset_current_mesh()
    with pytest.raises(hca.MeshError, match=r"no mesh given and none is current"):
        hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP())


def test_mesh_not_a_device_mesh(fake_pg):
    with pytest.raises(hca.MeshError, match=r"mesh=4 is not a DeviceMesh; build one with hca\.init_mesh"):
        hca.sharded(zoo.MEGATRON_MLP, mesh=4)(zoo.MLP())


def test_mesh_size_does_not_match_world(fake_pg):
    with pytest.raises(
        hca.MeshError, match=r"mesh shape \(3,\) holds 3 ranks but the world has 4; pick a shape whose product is 4"
    ):
        hca.init_mesh((3,))
    with pytest.raises(hca.MeshError, match=r"mesh shape \(2, 4\) holds 8 ranks but the world has 4"):
        hca.init_mesh((2, 4), ("dp", "tp"))


def test_mesh_names_do_not_match_shape(fake_pg):
    with pytest.raises(
        hca.MeshError, match=r"1 names \('a',\) for a 2-D shape \(2, 2\); give one name per mesh dimension"
    ):
        hca.init_mesh((2, 2), ("a",))


@pytest.mark.parametrize(
    "names, message",
    [
        (("dp", "dp"), r"mesh dimension names \('dp', 'dp'\) must be distinct"),
        ((0, 1), r"mesh dimension names \(0, 1\) must be non-empty strings, e.g\. \('dp', 'tp'\)"),
        (("dp", ""), r"must be non-empty strings"),
    ],
)
def test_mesh_bad_names(fake_pg, names, message):
    with pytest.raises(hca.MeshError, match=message):
        hca.init_mesh((2, 2), names)


@pytest.mark.parametrize("shape", [(0, 4), (-2, -2), (2.0, 2), "4"])
def test_mesh_bad_shape(fake_pg, shape):
    with pytest.raises(
        hca.MeshError, match=r"init_mesh: shape .* must be positive integers, e\.g\. init_mesh\(\(2, 2\)\)"
    ):
        hca.init_mesh(shape)


def test_mesh_unknown_device_type(fake_pg):
    with pytest.raises(hca.MeshError, match=r"init_mesh: unknown device 'tpu'; use 'cpu' or 'cuda'"):
        hca.init_mesh(device_type="tpu")


def test_submesh_smaller_than_world(fake_pg):
    tp = _mesh_2d()["tp"]
    with pytest.raises(
        hca.MeshError, match=r"the mesh holds 2 ranks but the world has 4; build the mesh over the whole world"
    ):
        hca.sharded(zoo.MEGATRON_MLP, mesh=tp)(zoo.MLP())


# -------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "options, message",
    [
        ({"bogus": 1}, r"unknown option\(s\) \['bogus'\]; the options are " + re.escape(str(OPTION_NAMES))),
        ({"inner": "nope"}, r"options\['inner'\]='nope'; use one of \('eager', 'inductor', 'dtensor'\)"),
        ({"strict": "yes"}, r"options\['strict'\] must be a bool, got 'yes'"),
        ({"debug_dir": 5}, r"options\['debug_dir'\] must be a directory path, got 5"),
        ({"schedule": 1}, r"options\['schedule'\] must be a bool, got 1"),
        ({"layout": "ilp"}, r"options\['layout'\]='ilp'; use one of \('solve', 'dtensor', 'tune', 'as_written'\)"),
        ({"memory_budget": -1}, r"options\['memory_budget'\] must be a number >= 0, got -1"),
        ({"cost_model": 3}, r"options\['cost_model'\] must be a dict of CostModel fields, got 3"),
        ("inductor", r"options must be a dict, got str 'inductor'; write options=\{'inner': 'inductor'\}"),
    ],
)
def test_bad_options_parse(options, message):
    with pytest.raises(hca.OptionsError, match=rf"backend 'hca': {message}"):
        Options.parse(options)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"bogus": 1}, r"unknown option\(s\) \['bogus'\]; the options are " + re.escape(str(OPTION_NAMES))),
        ({"inner": "nope"}, r"options\['inner'\]='nope'; use one of \('eager', 'inductor', 'dtensor'\)"),
    ],
)
def test_bad_options_through_torch_compile(fake_pg, options, message):
    model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP())
    compiled = torch.compile(model, backend="hca", options=options)  # lazy: no error yet
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.randn(8, 16))
    inner = info.value.inner_exception
    assert isinstance(inner, hca.OptionsError)
    assert re.search(rf"backend 'hca': {message}", str(inner)), str(inner)


def test_a_failure_dynamo_would_answer_with_a_graph_break_is_an_error(fake_pg, monkeypatch):
    """Dynamo turns some backend exceptions (fake tensors missing data) into a graph break and a
    warning, and runs the rest outside the backend; hca raises instead, naming the cause."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from torch_hca.passes.layout import LayoutPass

    def needs_data(self, gm, ctx):
        raise DataDependentOutputException(torch.ops.aten.equal.default)

    monkeypatch.setattr(LayoutPass, "run", needs_data)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP()), backend="hca")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(torch.randn(8, 16))
    inner = info.value.inner_exception
    assert isinstance(inner, hca.UnsupportedError)
    assert "DataDependentOutputException: aten.equal.default" in str(inner)
    assert isinstance(inner.__cause__, DataDependentOutputException)
    assert not torch._dynamo.utils.counters["graph_break"]


# --------------------------------------------------------------- launch and report


@pytest.mark.parametrize("world_size", [0, -1, "2", 2.0])
def test_launch_invalid_world_size(world_size):
    with pytest.raises(hca.HCAError, match=r"hca\.launch: world_size must be a positive int, got "):
        hca.launch(_noop, world_size)


def test_report_of_an_uncompiled_module():
    with pytest.raises(
        hca.HCAError,
        match=r"no graph of this MLP was compiled with backend='hca'; .*call the compiled module once first",
    ):
        hca.report(zoo.MLP())


def test_report_of_a_non_module():
    with pytest.raises(hca.HCAError, match=r"hca\.report: expected the module torch\.compile returned, got int"):
        hca.report(42)


def test_report_with_nothing_compiled(monkeypatch):
    monkeypatch.setattr(importlib.import_module("torch_hca.report.compile_report"), "_GRAPHS", [])
    with pytest.raises(
        hca.HCAError, match=r"hca\.report\(\): nothing has been compiled with backend='hca' in this process"
    ):
        hca.report()


def test_every_error_is_an_hca_error():
    for cls in (
        hca.MeshError,
        hca.PlanError,
        hca.PlacementError,
        hca.OptionsError,
        hca.UnsupportedError,
        hca.CheckError,
        hca.RankError,
    ):
        assert issubclass(cls, hca.HCAError)
    assert issubclass(hca.PlacementError, hca.PlanError)
