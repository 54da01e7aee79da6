"""Work run on every rank by the checkpoint and conversion tests (importable by spawned ranks).

Every model here is made from a seed and trained with data made from the step
index, so a rank in another world rebuilds exactly what was saved and compares
bitwise. Plain module, no pytest.
"""

from __future__ import annotations

import copy
import glob
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import torch_hca as hca
from torch_hca.api import checkpoint
from torch_hca.compiler.parameters import parameter_name, parameter_role
from torch_hca.tools import zoo

DIM, HIDDEN = 8, 16


def sharded_mlp(seed: int, plan=None, hidden: int = HIDDEN):
    torch.manual_seed(seed)
    mesh = hca.init_mesh()
    return hca.sharded(zoo.MEGATRON_MLP if plan is None else plan, mesh=mesh)(zoo.MLP(DIM, hidden))


def train(model, opt, steps: range) -> None:
    """Eager sharded steps on data made from the step index: the same in every world."""
    for step in steps:
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1000 + step))
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def trained(seed: int, steps: int = 1):
    model = sharded_mlp(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(steps))
    return model, opt


def state_of(model, opt) -> dict[str, torch.Tensor]:
    """This rank's pieces of every parameter and optimizer state tensor."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.to_local().detach().clone()
        for key, value in opt.state[p].items() if opt is not None else ():
            if isinstance(value, torch.Tensor):
                out[f"{name}/{key}"] = (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
    return out


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


# ----------------------------------------------------------------------------- kills mid-save


def save_seed(path: str, seed: int) -> str:
    model, opt = trained(seed)
    return hca.save(model, opt, path, extra={"seed": seed})


def save_and_die(path: str, seed: int, point: str, victim: int) -> str:
    """Save, and have rank `victim` die at `point` (a torn file first at "written")."""

    def die(at: str, directory: str) -> None:
        if at != point or dist.get_rank() != victim:
            return
        if at == "written":  # killed while writing: leave this rank's file half written
            for file in glob.glob(os.path.join(directory, f"__{victim}_*")):
                os.truncate(file, os.path.getsize(file) // 2)
        os._exit(1)

    checkpoint.fault_hook = die
    try:
        return save_seed(path, seed)
    finally:
        checkpoint.fault_hook = None


def load_matches(path: str, seed: int) -> dict[str, Any]:
    """Load `path` into a differently initialised model; compare with the model saved from `seed`."""
    want = state_of(*trained(seed))
    model = sharded_mlp(99)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    extra = hca.load(model, opt, path)
    result = {"equal": bitwise_equal(state_of(model, opt), want), "extra": extra}
    # A save after an interrupted one starts clean and publishes the next version.
    result["next"] = os.path.basename(hca.save(model, opt, path, extra=extra))
    return result


# ----------------------------------------------------------------------------- resume


def _trained_saved_trained(path: str):
    model, opt = trained(0, steps=3)
    hca.save(model, opt, path, extra={"step": 3})
    train(model, opt, range(3, 5))
    return model, opt


def train_save_train(path: str) -> dict[str, torch.Tensor]:
    """3 steps, save, 2 more: the uninterrupted run."""
    return state_of(*_trained_saved_trained(path))


def load_train(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The resumed run: another initialisation, load, the same last 2 steps."""
    model = sharded_mlp(7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    extra = hca.load(model, opt, path)
    train(model, opt, range(extra["step"], 5))
    return state_of(model, opt), extra


# ----------------------------------------------------------------------------- errors


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except hca.HCAError as e:
        return type(e).__name__, str(e)
    except Exception as e:  # a raw error is a failure the test reports
        return f"raw {type(e).__name__}", str(e)
    return None


def checkpoint_errors(root: str) -> dict[str, Any]:
    """Each bad load or save, and what it raised (None: nothing)."""
    rank0 = dist.get_rank() == 0
    good = os.path.join(root, "good")
    model, opt = trained(3)
    hca.save(model, opt, good)
    out: dict[str, Any] = {}
    out["missing"] = _error(lambda: hca.load(sharded_mlp(0), None, os.path.join(root, "nowhere")))
    unpublished = os.path.join(root, "unpublished")
    if rank0:
        os.makedirs(os.path.join(unpublished, ".tmp-v00000001"))
    dist.barrier()
    out["unpublished"] = _error(lambda: hca.load(sharded_mlp(0), None, unpublished))
    out["shapes"] = _error(lambda: hca.load(sharded_mlp(0, hidden=32), None, good))
    out["model"] = _error(
        lambda: hca.load(hca.sharded({}, mesh=hca.init_mesh())(torch.nn.Linear(DIM, DIM)), None, good)
    )
    other_plan = {"fc1.*": Shard(0)}
    out["plan"] = _error(lambda: hca.load(sharded_mlp(0, plan=other_plan), None, good))
    resharded = sharded_mlp(0, plan=other_plan)
    hca.load(resharded, None, good, reshard=True)
    out["reshard_equal"] = all(
        torch.equal(p.full_tensor(), model.get_parameter(n).full_tensor()) for n, p in resharded.named_parameters()
    )
    model_only = os.path.join(root, "model_only")
    hca.save(sharded_mlp(4), None, model_only)
    fresh = sharded_mlp(0)
    out["no_optimizer"] = _error(lambda: hca.load(fresh, torch.optim.Adam(fresh.parameters()), model_only))
    foreign = os.path.join(root, "foreign")
    if rank0:
        os.makedirs(foreign)
        open(os.path.join(foreign, "notes.txt"), "w").close()
    dist.barrier()
    out["foreign"] = _error(lambda: hca.save(model, opt, foreign))
    damaged = os.path.join(root, "damaged")
    if rank0:
        import shutil

        shutil.copytree(good, damaged)
        file = sorted(glob.glob(os.path.join(damaged, "v*", "__1_*")))[0]
        os.truncate(file, os.path.getsize(file) - 1)
    dist.barrier()
    out["damaged"] = _error(lambda: hca.load(sharded_mlp(0), None, damaged))

    def disk_full(point: str, directory: str) -> None:
        if point == "written" and dist.get_rank() == 1:
            raise OSError(28, "No space left on device")

    checkpoint.fault_hook = disk_full
    try:
        out["write_fails"] = _error(lambda: hca.save(model, opt, good))
    finally:
        checkpoint.fault_hook = None
    out["latest_after_failure"] = open(os.path.join(good, "LATEST")).read().strip()
    # A compiled model's parameter names carry torch.compile's prefix; checkpoints do not.
    compiled_root = os.path.join(root, "compiled")
    hca.save(torch.compile(model, backend="hca"), opt, compiled_root)
    fresh = sharded_mlp(0)
    hca.load(fresh, None, compiled_root)
    out["compiled_equal"] = all(
        torch.equal(p.to_local(), model.get_parameter(n).to_local()) for n, p in fresh.named_parameters()
    )
    wide = sharded_mlp(0).double()  # a float32 checkpoint into a float64 model: values are cast
    hca.load(wide, None, compiled_root)
    out["cast_equal"] = all(
        torch.equal(p.to_local(), model.get_parameter(n).to_local().double()) for n, p in wide.named_parameters()
    )
    return out


# ----------------------------------------------------------------------------- single-device state dicts


def full_state_dict(file: str) -> dict[str, Any]:
    """A plain model's state dict (and a torch.save file of it) into a sharded model."""
    torch.manual_seed(0)
    ref = zoo.MLP(DIM, HIDDEN)
    torch.save(ref.state_dict(), file) if dist.get_rank() == 0 else None
    dist.barrier()
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(5))
    out: dict[str, Any] = {}
    for how in ("api", "file", "load_state_dict"):
        model = sharded_mlp(1)
        if how == "api":
            hca.load_full_state_dict(model, ref.state_dict())
        elif how == "file":
            hca.load_full_state_dict(model, file)
        else:
            model.load_state_dict(ref.state_dict())
        out[how] = all(torch.equal(p.full_tensor(), ref.get_parameter(n)) for n, p in model.named_parameters())
        out[f"{how}_out_err"] = ((model(x) - ref(x)).norm() / ref(x).norm()).item()
    ddp_style = {f"module.{k}": v for k, v in ref.state_dict().items()}
    out["prefixed"] = _error(lambda: hca.load_full_state_dict(sharded_mlp(1), ddp_style))
    local = {n: (p.to_local() if isinstance(p, DTensor) else p) for n, p in sharded_mlp(1).state_dict().items()}
    out["local_pieces"] = _error(lambda: hca.load_full_state_dict(sharded_mlp(1), local))
    return out


# ----------------------------------------------------------------------------- conversions, numerically


def _names_and_roles(model) -> dict[str, tuple[str | None, str | None]]:
    return {n: (parameter_name(p), parameter_role(p)) for n, p in model.named_parameters()}


def double_then_compile(directory: str) -> dict[str, Any]:
    """torch.save / torch.load a sharded model, .double() it, compile, one step: fp64 gradients vs one device."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = zoo.MLP(DIM, HIDDEN)
    mesh = hca.init_mesh()
    model = hca.sharded(zoo.MEGATRON_MLP, mesh=mesh, grad_reduction={"fc2.bias": "deferred"})(copy.deepcopy(ref))
    file = os.path.join(directory, f"model.rank{dist.get_rank()}.pt")
    torch.save(model, file)
    loaded = torch.load(file, weights_only=False)
    out: dict[str, Any] = {
        "round_trip": bitwise_equal(state_of(loaded, None), state_of(model, None)),
        "names_loaded": _names_and_roles(loaded),
    }
    loaded.double()
    ref.double()
    out["dtypes"] = sorted({str(p.dtype) for p in loaded.parameters()})
    out["names_double"] = _names_and_roles(loaded)
    compiled = torch.compile(loaded, backend="hca")
    x = torch.randn(4, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    compiled(x).pow(2).sum().backward()
    hca.reduce_gradients(loaded)
    ref(x).pow(2).sum().backward()
    refs = dict(ref.named_parameters())
    out["grad_errs"] = {
        n: ((p.grad.full_tensor() - refs[n].grad).norm() / refs[n].grad.norm()).item()
        for n, p in loaded.named_parameters()
    }
    out["grad_dtypes"] = sorted({str(p.grad.dtype) for p in loaded.parameters()})
    out["report_parameters"] = sorted(hca.report(compiled).graph.parameters)
    return out


def meta_init() -> dict[str, Any]:
    """Build under the meta device, shard, to_empty, load weights: equals the single-device model."""
    torch.manual_seed(0)
    ref = zoo.MLP(DIM, HIDDEN)
    with torch.device("meta"):
        model = zoo.MLP(DIM, HIDDEN)
    model = hca.sharded(zoo.MEGATRON_MLP, mesh=hca.init_mesh())(model)
    out = {"meta": all(p.is_meta for p in model.parameters())}
    model.to_empty(device="cpu")
    hca.load_full_state_dict(model, ref.state_dict())
    out["equal"] = all(torch.equal(p.full_tensor(), ref.get_parameter(n)) for n, p in model.named_parameters())
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(5))
    out["out_err"] = ((model(x) - ref(x)).norm() / ref(x).norm()).item()  # fc2's pieces sum in another order
    out["names"] = _names_and_roles(model)
    return out


# ----------------------------------------------------------------------------- another world size


def full_state_of(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor whole (gathered): comparable across world sizes."""
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
    out = {}
    for name, p in model.named_parameters():
        out[name] = whole(p).detach().clone()
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"{name}/{key}"] = whole(value).detach().clone()
    return out


def train_save_train_whole(path: str) -> dict[str, torch.Tensor]:
    """`train_save_train`, its end state gathered whole."""
    return full_state_of(*_trained_saved_trained(path))


def load_train_whole(path: str, reshard: bool) -> dict[str, Any]:
    """In another world: load (`reshard`), train the last 2 steps; the end state whole, or the error."""
    model = sharded_mlp(7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        extra = hca.load(model, opt, path, reshard=reshard)
    except hca.HCAError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    train(model, opt, range(extra["step"], 5))
    return {"state": full_state_of(model, opt), "pieces": tuple(model.fc1.weight.to_local().shape)}
