"""Module conversions after `hca.sharded`: dtype and device moves, to_empty, meta init, pickling.

The mechanics run on the fake process group (in this process); one real gloo
world checks the numbers: a pickled, reloaded, ``.double()``'d model compiles
and steps with the fp64 gradients of one device.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist

import checkpoint_cases
import torch_hca as hca
from torch_hca.tools import zoo
from torch_hca.compiler.parameters import parameter_name, parameter_role
from torch_hca.runtime.mesh import reset_current_mesh

ROLES = {"fc1.weight": "eager", "fc1.bias": "eager", "fc2.weight": "eager", "fc2.bias": "deferred"}


def sharded(mesh, module=None):
    torch.manual_seed(0)
    module = zoo.MLP(8, 16) if module is None else module
    return hca.sharded(zoo.MEGATRON_MLP, mesh=mesh, grad_reduction={"fc2.bias": "deferred"})(module)


def names_and_roles(model) -> dict[str, tuple]:
    return {n: (parameter_name(p), parameter_role(p)) for n, p in model.named_parameters()}


def named_ok(model) -> bool:
    return names_and_roles(model) == {n: (n, r) for n, r in ROLES.items()}


@pytest.mark.parametrize(
    "convert,dtype",
    [
        (lambda m: m.double(), torch.float64),
        (lambda m: m.to(torch.float64), torch.float64),
        (lambda m: m.double().float(), torch.float32),
        (lambda m: m.to(torch.bfloat16), torch.bfloat16),
        (lambda m: m.to("cpu"), torch.float32),
        (lambda m: m.to(device="cpu", dtype=torch.float64), torch.float64),
    ],
    ids=["double", "to_dtype", "double_float", "bfloat16", "to_cpu", "to_device_dtype"],
)
def test_conversion_keeps_parameters_and_their_names(fake_pg, convert, dtype):
    model = sharded(fake_pg)
    before = {n: (id(p), p.to_local().clone(), p.placements) for n, p in model.named_parameters()}
    assert convert(model) is model
    for n, p in model.named_parameters():
        ident, local, placements = before[n]
        assert id(p) == ident, "the same Parameter objects: an optimizer built before still holds them"
        assert isinstance(p, torch.distributed.tensor.DTensor) and p.placements == placements
        assert p.dtype == dtype and torch.equal(p.to_local(), local.to(dtype))
    assert named_ok(model)


def test_to_empty_then_reinitialise(fake_pg):
    model = sharded(fake_pg)
    model.to_empty(device="cpu")
    assert named_ok(model)
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.constant_(p, 0.5)
    assert all(torch.equal(p.to_local(), torch.full_like(p.to_local(), 0.5)) for p in model.parameters())


def test_meta_device_model_shards_without_values(fake_pg):
    with torch.device("meta"):
        model = zoo.MLP(8, 16)
    model = sharded(fake_pg, model)
    assert all(p.is_meta for p in model.parameters())
    assert tuple(model.fc1.weight.to_local().shape) == (16 // 4, 8)  # each rank cut its piece, nothing sent
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    ref = zoo.MLP(8, 16)
    hca.load_full_state_dict(model, ref.state_dict())
    assert named_ok(model)
    assert torch.equal(model.fc1.weight.to_local(), ref.fc1.weight[:4])  # rank 0's piece of Shard(0)
    assert torch.equal(model.fc2.weight.to_local(), ref.fc2.weight[:, :4])  # and of Shard(1)


def test_optimizer_built_before_a_conversion_still_steps(fake_pg):
    model = sharded(fake_pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.double()
    for p in model.parameters():
        p.grad = torch.distributed.tensor.zeros(
            p.shape, dtype=p.dtype, device_mesh=p.device_mesh, placements=p.placements
        )
    opt.step()
    assert all(p.dtype == torch.float64 for g in opt.param_groups for p in g["params"])


def test_torch_save_load_round_trip(fake_pg):
    model = sharded(fake_pg).double()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded).__name__ == "MLP" and isinstance(loaded, zoo.MLP)
    assert loaded._hca_spec.params == model._hca_spec.params
    for (n, p), q in zip(loaded.named_parameters(), model.parameters()):
        assert p.placements == q.placements and torch.equal(p.to_local(), q.to_local())
    assert named_ok(loaded) and named_ok(model)
    buf = io.BytesIO()
    torch.save(loaded, buf)  # and again: the reloaded module pickles too


def test_deepcopy(fake_pg):
    model = sharded(fake_pg)
    twin = copy.deepcopy(model)
    assert twin.fc1.weight is not model.fc1.weight and torch.equal(
        twin.fc1.weight.to_local(), model.fc1.weight.to_local()
    )
    assert named_ok(twin) and named_ok(model)
    assert twin.__dict__["_hca_logical"].inner is twin


@hca.sharded({"fc1.*": hca.Shard(0)})
class DecoratedMLP(zoo.MLP):
    pass


def test_torch_save_of_a_decorated_class(fake_pg):
    model = DecoratedMLP(8, 16)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is DecoratedMLP
    assert parameter_name(loaded.fc1.weight) == "fc1.weight"


def test_torch_load_without_the_world_says_so(fake_pg):
    buf = io.BytesIO()
    torch.save(sharded(fake_pg), buf)
    dist.destroy_process_group()
    reset_current_mesh()
    try:
        buf.seek(0)
        with pytest.raises(hca.MeshError, match="sharded over 4 ranks with no process group initialized"):
            torch.load(buf, weights_only=False)
    finally:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)  # for the fixture to close


def test_load_state_dict_of_full_tensors(fake_pg):
    model = sharded(fake_pg)
    torch.manual_seed(1)
    ref = zoo.MLP(8, 16)
    model.load_state_dict(ref.state_dict())
    assert torch.equal(model.fc1.weight.to_local(), ref.fc1.weight[:4])
    assert named_ok(model)


def test_double_then_compile_gives_fp64_gradients_of_one_device(worlds, tmp_path):
    r = worlds(2).run(checkpoint_cases.double_then_compile, str(tmp_path))[0]
    assert r["round_trip"]
    expected = {n: (n, role) for n, role in ROLES.items()}
    assert r["names_loaded"] == expected and r["names_double"] == expected
    assert r["dtypes"] == ["torch.float64"] and r["grad_dtypes"] == ["torch.float64"]
    assert max(r["grad_errs"].values()) <= 1e-12, r["grad_errs"]
    assert r["report_parameters"] == sorted(ROLES)


def test_meta_device_recipe_on_two_ranks(worlds):
    r = worlds(2).run(checkpoint_cases.meta_init)
    assert all(x["meta"] and x["equal"] and x["out_err"] <= 1e-6 for x in r)
    assert r[0]["names"] == {n: (n, "eager") for n in ROLES}
