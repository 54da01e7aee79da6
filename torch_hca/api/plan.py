"""`hca.sharded`: a parameter storage plan, validated eagerly and applied to a module.

A plan maps parameter-name glob patterns to a layout: one placement per mesh
dimension (a bare placement on a 1-D mesh; a bare ``Replicate()`` on any mesh)::

    @hca.sharded({"fc1.*": Shard(0), "fc2.weight": Shard(1)}, inputs=Replicate())
    class MLP(nn.Module): ...

After ``__init__`` the parameters are DTensors stored as the plan says
(unmatched ones replicated). ``forward`` takes plain tensors, each this
rank's local piece of a tensor laid out as ``inputs``, and returns plain
tensors laid out as ``outputs``.
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from torch_hca.errors import MeshError, PlanError
from torch_hca.spmd.placements import dtype_str
from torch_hca.runtime.exchange import exchange, first_difference, needs_exchange
from torch_hca.compiler.logical import Holder, mesh_id
from torch_hca.compiler.parameters import register_sharded

from torch_hca.api.pretrained import whole_model_save
from torch_hca.api.sharding_spec import ShardingSpec
from torch_hca.api.sharded_forward import wrap_forward
from torch_hca.compiler.plan_layouts import (
    check_uneven,
    grad_scale,
    io_layout,
    io_layouts,
    resolve_mesh,
    resolve_plan,
    resolve_roles,
    share_weight,
)


def _distribute(module: nn.Module, spec: ShardingSpec) -> None:
    """Replace each parameter by a DTensor laid out as the spec says; buffers stay plain.

    A parameter shared under several names (tied embeddings) is replaced under
    every name by the same DTensor, so it keeps one gradient. Buffers are
    replicated by nature: every rank starts from rank 0's values. A module
    built under ``torch.device("meta")`` has no values to send: each rank cuts
    its own empty piece, for ``to_empty`` and an initialisation to fill.
    """
    new: dict[int, nn.Parameter] = {}
    first_name = {id(p): name for name, p in module.named_parameters()}
    for qualified, old in list(module.named_parameters(remove_duplicate=False)):
        owner_name, _, leaf = qualified.rpartition(".")
        owner = module.get_submodule(owner_name)
        if id(old) not in new:
            name = first_name[id(old)]
            # src_data_rank=0: every rank starts from rank 0's values; None: no communication.
            src = None if old.is_meta else 0
            dt = distribute_tensor(old.detach(), spec.mesh, spec.params[name], src_data_rank=src)
            new[id(old)] = nn.Parameter(dt, requires_grad=old.requires_grad)
        setattr(owner, leaf, new[id(old)])
    replicated = (Replicate(),) * spec.mesh.ndim
    for qualified, buf in list(module.named_buffers()):
        owner_name, _, leaf = qualified.rpartition(".")
        owner = module.get_submodule(owner_name)
        if not buf.is_meta:
            owner._buffers[leaf] = distribute_tensor(buf, spec.mesh, replicated).to_local()
    register_sharded(module)
    module.register_load_state_dict_pre_hook(_cut_full_tensors)
    if getattr(type(module).forward, "_hca_wrapped", False):  # a decorated class; an instance's class comes later
        support_pickling(type(module))


def _cut_full_tensors(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """`load_state_dict` of a single-device state dict: each rank keeps its piece of every full tensor.

    A value already a DTensor (`hca.load`, DCP's ``set_model_state_dict``) or
    not of the parameter's global shape is left to ``load_state_dict`` to judge.
    """
    for name, p in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if (
            isinstance(p, DTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.shape == p.shape
        ):
            state_dict[prefix + name] = distribute_tensor(
                value.detach(), p.device_mesh, p.placements, src_data_rank=None
            )


def _plan_lines(module: nn.Module, spec: ShardingSpec) -> list[str]:
    """The resolved plan as text, one line per parameter: what every rank must hold alike."""
    lines = [
        f"mesh {tuple(spec.mesh.shape)} {spec.mesh.mesh_dim_names}",
        f"inputs {spec.inputs!r}",
        f"outputs {spec.outputs!r} grad_scale {spec.grad_scale}",
    ]
    for name, p in module.named_parameters():
        lines.append(
            f"parameter {name!r} {tuple(p.shape)} {dtype_str(p.dtype)} {spec.params[name]} {spec.grad_roles[name]}"
        )
    return lines


def _check_same_plan(module: nn.Module, spec: ShardingSpec) -> None:
    """Ranks given different plans would hang in the first collective that distributes a parameter: compare first."""
    if not needs_exchange():
        return
    mine = _plan_lines(module, spec)
    what = f"hca.sharded({type(module).__name__})"
    for other, text in sorted(exchange("plan", "\n".join(mine), range(dist.get_world_size()), what).items()):
        theirs = text.split("\n")
        if theirs != mine:
            _, ours_line, their_line = first_difference(mine, theirs, "nothing")
            raise PlanError(
                f"{what}: rank {dist.get_rank()} and rank {other} were given different plans or models; the first "
                f"difference: rank {dist.get_rank()} has {ours_line}, rank {other} has {their_line}. Give every "
                "rank the same model, plan and mesh (no rank-dependent choices before hca.sharded)"
            )


def _strategy_path(strategy: Any) -> str | None:
    """``hca.sharded(..., strategy=)`` checked: None or the path of a strategy file."""
    if strategy is None:
        return None
    if not isinstance(strategy, (str, os.PathLike)):
        raise PlanError(
            f"hca.sharded: strategy= must be the path of a strategy file, got {strategy!r}; "
            "write one with hca.report(compiled).save_strategy(path)"
        )
    return os.fspath(strategy)


def _deployment(deployment: Any, mesh: DeviceMesh) -> Any:
    """``hca.sharded(..., deployment=)`` checked: None, or a `hca.Deployment` (or its file's path)
    of the mesh's world, this rank's device present."""
    if deployment is None:
        return None
    from torch_hca.api.deployment import Deployment

    if isinstance(deployment, (str, os.PathLike)):
        deployment = Deployment.load(deployment)
    if not isinstance(deployment, Deployment):
        raise PlanError(
            f"hca.sharded: deployment= must be a hca.Deployment or the path of its file, got {deployment!r}; "
            "measure one with hca.Deployment.measure() or write one (docs/heterogeneous.md)"
        )
    return deployment.check(world_size=mesh.mesh.numel(), rank=dist.get_rank() if dist.is_initialized() else None)


def _shard_instance(
    module: nn.Module, plan, mesh, inputs, outputs, grad_reduction, loss_reduction="sum", strategy=None, deployment=None
) -> nn.Module:
    if getattr(module, "_hca_spec", None) is not None:
        raise PlanError(
            f"hca.sharded: this {type(module).__name__} is already sharded; apply the "
            "decorator once, to the class or to the instance"
        )
    mesh = resolve_mesh(mesh)
    in_layouts, per_argument = io_layouts(inputs, mesh)
    out_layout = io_layout(outputs, mesh, "outputs")
    params = resolve_plan(module, plan, mesh)
    uneven = check_uneven(in_layouts if per_argument else (in_layouts,), out_layout, params)
    spec = ShardingSpec(
        mesh=mesh,
        params=params,
        inputs=in_layouts,
        outputs=out_layout,
        per_argument=per_argument,
        grad_roles=resolve_roles(module, grad_reduction),
        mesh_index=mesh_id(mesh),
        grad_scale=grad_scale(loss_reduction, mesh, out_layout),
        share_weight=share_weight(loss_reduction, mesh, out_layout),
        uneven=uneven,
        strategy=strategy,
        deployment=_deployment(deployment, mesh),
    )
    _check_same_plan(module, spec)
    _distribute(module, spec)
    module._hca_spec = spec
    forward = type(module).forward
    # The user's own forward, called on the module with its parameters swapped (torch_hca.compiler.logical).
    module.__dict__["_hca_logical"] = Holder(module, getattr(forward, "__wrapped__", forward))
    return module


def sharded(
    plan: Mapping[str, Any],
    *,
    mesh: DeviceMesh | None = None,
    inputs: Any = Replicate(),
    outputs: Any = Replicate(),
    grad_reduction: str | Mapping[str, str] = "eager",
    loss_reduction: str = "sum",
    strategy: str | os.PathLike | None = None,
    deployment: Any = None,
):
    """Store a module's parameters over a device mesh as `plan` says.

    ``plan``: ``{"glob pattern": placement or tuple of placements}``; a
    parameter no pattern matches is replicated. ``inputs``: the layout of
    every tensor argument of ``forward`` (a list gives one per positional
    argument, ``None`` leaving that one alone). ``outputs``: the layout of
    every tensor result. A plain tensor argument is this rank's local piece.
    ``grad_reduction``: when a gradient that comes out partial (a replicated
    parameter under a split batch) is summed over ranks: ``"eager"`` inside
    the backward graph, ``"deferred"`` only at `hca.reduce_gradients` (so k
    microbatches of accumulation communicate once); a ``{pattern: role}``
    mapping sets it per parameter (unmatched ones are eager).
    ``loss_reduction``: how the losses that the ranks compute from their own
    pieces of a sharded result (``outputs=Shard(0)``, a loop ported from DDP)
    combine: ``"sum"`` (default: gradients are those of their sum, the loss
    over the whole batch when each rank sums over its piece) or ``"mean"``
    (those of their mean, as DDP averages: each result's cotangent is divided
    by the number of ranks holding different pieces of it). A loss computed
    inside ``forward`` or on a replicated result is exact under either.
    ``strategy``: the path of a strategy file (``hca.report(c).save_strategy``)
    that a compile of this module loads instead of solving, as
    ``options={"strategy": path}`` does (docs/strategy.md); an option naming
    another file is an `OptionsError`.
    ``deployment``: a `hca.Deployment` (or its JSON file's path) of the mesh's
    ranks: with the batch cut by rows (by shares, or evenly), the report then
    gives each rank's rows and predicted step, the even cut's and the
    deployment's best cut (docs/heterogeneous.md); the strategy file records it.

    Use on a class (parameters are distributed at the end of ``__init__``) or
    on an instance (distributed at once, returns the same module)::

        @hca.sharded({"fc1.*": Shard(0)})
        class MLP(nn.Module): ...

        model = hca.sharded({"fc1.*": Shard(0)}, mesh=mesh)(MLP())
    """

    strategy = _strategy_path(strategy)

    def apply(target):
        if isinstance(target, nn.Module):
            _shard_instance(target, plan, mesh, inputs, outputs, grad_reduction, loss_reduction, strategy, deployment)
            if getattr(type(target).forward, "_hca_wrapped", False):
                support_pickling(type(target), made=False)  # torch.save(model): see "pickling"
            else:
                target.__class__ = _sharded_subclass(type(target))
            return target
        if isinstance(target, type) and issubclass(target, nn.Module):
            init = target.__init__

            @functools.wraps(init)
            def sharded_init(self, *args, **kwargs):
                init(self, *args, **kwargs)
                if type(self) is target:
                    _shard_instance(
                        self, plan, mesh, inputs, outputs, grad_reduction, loss_reduction, strategy, deployment
                    )

            target.__init__ = sharded_init
            target.forward = wrap_forward(target.forward)
            return target
        raise PlanError(f"hca.sharded decorates an nn.Module class or instance, not {type(target).__name__}")

    return apply


# ----------------------------------------------------------------------------- pickling
#
# `torch.save(model)` and `copy.deepcopy(model)` of a sharded module. Each rank
# pickles its own pieces (a DTensor pickles with its mesh, which finds its process
# group again by name), so loading needs a world of the same size. Pickled: the
# module's state less its Holder (a cycle through the user's forward); the class
# is the user's own, and the subclass `sharded(...)(instance)` made is made again
# on load. Names, roles and the load hook come back with the state.


def support_pickling(cls: type, made: bool = False) -> None:
    """Pickle and deep-copy instances of `cls`, a class whose ``forward`` hca wrapped.

    ``made``: `cls` is the subclass ``sharded(...)(instance)`` made, which no
    module can name: its instances are pickled as instances of its base.
    """
    if made:
        cls._hca_made = True
    copyreg.pickle(cls, _reduce_sharded)


def _reduce_sharded(module: nn.Module) -> tuple:
    spec = module.__dict__.get("_hca_spec")
    if spec is None:  # an instance of a decorated class's subclass, never sharded
        return module.__reduce_ex__(2)
    cls = type(module)
    made = cls.__dict__.get("_hca_made", False)
    state = module.__getstate__()
    state.pop("_hca_logical", None)
    state.pop("_hca_traced_call", None)
    return _new_sharded, (cls.__bases__[0] if made else cls, made, spec.mesh.size()), state


def _new_sharded(cls: type, made: bool, world_size: int) -> nn.Module:
    """An empty instance to receive a sharded module's state, once the world is known to fit."""
    here = dist.get_world_size() if dist.is_initialized() else None
    if here != world_size:
        raise MeshError(
            f"loading a {cls.__name__} sharded over {world_size} ranks "
            + ("with no process group initialized" if here is None else f"in a world of {here} ranks")
            + f": torch.load it on every rank of a {world_size}-rank world, after hca.init_mesh(); "
            "to load into another world, save with hca.save and load with hca.load(..., reshard=True)"
        )
    final = _sharded_subclass(cls) if made else cls
    receiving = type(
        cls.__name__,
        (final,),
        {
            "__setstate__": _restore_sharded,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
    return receiving.__new__(receiving)


def _sharded_subclass(cls: type) -> type:
    """The class `sharded(...)(instance)` gives an instance of `cls`: its forward wrapped, picklable,
    and a Hugging Face model's ``save_pretrained`` writing the whole model (torch_hca.api.pretrained)."""
    methods = {"forward": wrap_forward(cls.forward), "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if callable(getattr(cls, "save_pretrained", None)):
        methods["save_pretrained"] = whole_model_save(cls.save_pretrained)
    sub = type(cls.__name__, (cls,), methods)
    support_pickling(sub, made=True)
    return sub


def _restore_sharded(module: nn.Module, state: dict) -> None:
    """``__setstate__`` of the instance `_new_sharded` made: the state, then what pickling left out."""
    final = type(module).__bases__[0]
    nn.Module.__setstate__(module, state)
    spec = module.__dict__["_hca_spec"]
    module.__dict__["_hca_spec"] = dataclasses.replace(spec, mesh_index=mesh_id(spec.mesh))
    forward = final.forward
    module.__dict__["_hca_logical"] = Holder(module, getattr(forward, "__wrapped__", forward))
    module.__class__ = final
    register_sharded(module)
