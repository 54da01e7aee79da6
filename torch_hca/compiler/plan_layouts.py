"""From what `hca.sharded` was given to layouts: globs, placements, the mesh, inputs and outputs, roles.

Each check names the parameter (or input, output, option) and says how to fix it;
nothing here touches a tensor's data.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from torch_hca.errors import MeshError, PlacementError, PlanError, UnsupportedError
from torch_hca.runtime.mesh import current_mesh
from torch_hca.spmd.chunks import local_piece_shape
from torch_hca.spmd.placements import layout_str, placement_str
from torch_hca.spmd.shares import UnevenShard, check_mesh_fit, uneven_dims, weight

Layout = tuple[Placement, ...]

# Cotangent roles for a parameter's gradient (docs/theory.md, section 4): "eager"
# reduces a partial gradient inside the backward graph, "deferred" keeps it
# partial until `hca.reduce_gradients` (e.g. once per k microbatches).
GRAD_ROLES = ("eager", "deferred")


def layout_of(value: Any, mesh: DeviceMesh, what: str) -> Layout:
    """Normalize a placement or a tuple of placements to one per mesh dimension.

    A bare placement stands for a 1-D mesh, except a bare ``Replicate()``, which
    is unambiguous on any mesh: replicated over every mesh dimension.
    """
    if isinstance(value, Replicate):
        return (Replicate(),) * mesh.ndim
    layout = (value,) if isinstance(value, Placement) else value
    if not isinstance(layout, tuple) or not all(isinstance(p, Placement) for p in layout):
        raise PlanError(
            f"{what}: {value!r} is not a placement; write Shard(d), Replicate(), or a tuple "
            f"of them, one per mesh dimension"
        )
    if len(layout) != mesh.ndim:
        raise PlacementError(
            f"{what}: {len(layout)} placement(s) {layout} for a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}; give one placement per mesh dimension"
        )
    return layout


def check_storage(layout: Layout, shape: torch.Size, mesh: DeviceMesh, what: str) -> Layout:
    """Parameters are stored Shard or Replicate; normalize Shard dims. A Shard that does not
    divide is cut as torch.chunk cuts (torch_hca.spmd.chunks)."""
    fixed = []
    for mesh_dim, p in enumerate(layout):
        if isinstance(p, Partial):
            raise PlacementError(
                f"{what}: Partial() is not a storage placement (a parameter is one value, "
                "not a sum of pieces); use Shard(d) or Replicate()"
            )
        if isinstance(p, UnevenShard):
            raise UnsupportedError(
                f"{what}: {p!r} cuts a parameter by shares, which is not built: a DTensor parameter's "
                "pieces are torch.chunk's (its full_tensor, the optimizer and checkpoints read them so), "
                f"so these shares would be ignored. Store it Shard({p.dim}) (torch.chunk's pieces) or "
                f"Replicate(), and cut the batch by shares instead: inputs=hca.Shard(0, shares={p.shares})"
            )
        if isinstance(p, Shard):
            dim = p.dim + len(shape) if p.dim < 0 else p.dim
            if not 0 <= dim < len(shape):
                raise PlacementError(
                    f"{what}: Shard({p.dim}) on a tensor of shape {tuple(shape)} with "
                    f"{len(shape)} dimension(s); "
                    + (
                        f"pick a dimension in 0..{len(shape) - 1}"
                        if shape
                        else "a 0-d tensor has nothing to shard: use Replicate()"
                    )
                )
            p = Shard(dim)
        fixed.append(p)
    # A cut that does not divide is torch.chunk's, DTensor's own (torch_hca.spmd.chunks), read
    # only as stored; every rank must hold a piece.
    coordinates = itertools.product(*(range(n) for n in mesh.shape))
    empty = next((c for c in coordinates if 0 in local_piece_shape(shape, fixed, mesh.shape, c)), None)
    if empty is not None:
        dim = local_piece_shape(shape, fixed, mesh.shape, empty).index(0)
        cut = placement_str(fixed[0]) if len(fixed) == 1 else layout_str(tuple(fixed))
        raise PlacementError(
            f"{what}: dimension {dim} of size {shape[dim]} cut by {cut} over the "
            f"mesh {tuple(mesh.shape)} leaves the rank at mesh coordinate {empty} without rows "
            "(torch.chunk's cut); change the size or the mesh, or shard another dimension"
        )
    return tuple(fixed)


def matching(pattern: str, names: list[str], what: str, then: str) -> list[str]:
    """The parameter names a glob matches; matching none is an error naming them all."""
    hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    if not hits:
        raise PlanError(f"hca.sharded: {what} matches no parameter{then} parameters are {sorted(names)}")
    return hits


def resolve_plan(module: nn.Module, plan: Mapping[str, Any], mesh: DeviceMesh) -> dict[str, Layout]:
    if not isinstance(plan, Mapping):
        raise PlanError(
            f"hca.sharded: the plan must map parameter-name patterns to placements, got {type(plan).__name__}"
        )
    named = dict(module.named_parameters())
    chosen: dict[str, tuple[str, Layout]] = {}
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise PlanError(f"hca.sharded: plan key {pattern!r} must be a glob string like 'fc1.*'")
        hits = matching(pattern, list(named), f"plan pattern {pattern!r}", f" of {type(module).__name__}; its")
        for name in hits:
            layout = layout_of(value, mesh, f"parameter {name!r} (pattern {pattern!r})")
            layout = check_storage(layout, named[name].shape, mesh, f"parameter {name!r} (pattern {pattern!r})")
            if name in chosen and chosen[name][1] != layout:
                other, other_layout = chosen[name]
                raise PlanError(
                    f"hca.sharded: parameter {name!r} is matched by {other!r} as {other_layout} "
                    f"and by {pattern!r} as {layout}; make the patterns disjoint"
                )
            chosen[name] = (pattern, layout)
    replicated = (Replicate(),) * mesh.ndim
    return {name: chosen.get(name, (None, replicated))[1] for name in named}


def resolve_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise MeshError("hca.sharded: no mesh given and none is current; call hca.init_mesh() first or pass mesh=...")
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"hca.sharded: mesh={mesh!r} is not a DeviceMesh; build one with hca.init_mesh")
    if dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise MeshError(
            f"hca.sharded: the mesh holds {mesh.size()} ranks but the world has "
            f"{dist.get_world_size()}; build the mesh over the whole world with hca.init_mesh"
        )
    return mesh


def io_layouts(inputs: Any, mesh: DeviceMesh) -> tuple[Any, bool]:
    if isinstance(inputs, list):
        return tuple(None if v is None else io_layout(v, mesh, f"inputs[{i}]") for i, v in enumerate(inputs)), True
    return io_layout(inputs, mesh, "inputs"), False


def io_layout(value: Any, mesh: DeviceMesh, what: str) -> Layout:
    layout = layout_of(value, mesh, f"hca.sharded {what}")
    check_mesh_fit(layout, tuple(mesh.shape), f"hca.sharded {what}")
    if any(isinstance(p, Partial) for p in layout):
        raise PlacementError(
            f"hca.sharded {what}: Partial() is not supported for forward arguments or results; "
            "use Shard(d) or Replicate()"
        )
    return layout


def resolve_roles(module: nn.Module, grad_reduction: Any) -> dict[str, str]:
    """One gradient role per parameter, from a role or a {pattern: role} mapping."""
    names = [n for n, _ in module.named_parameters()]
    rules = {"*": grad_reduction} if isinstance(grad_reduction, str) else grad_reduction
    if not isinstance(rules, Mapping):
        raise PlanError(
            f"hca.sharded: grad_reduction={grad_reduction!r}; give 'eager', 'deferred', or a "
            "mapping of parameter patterns to one of them"
        )
    roles = dict.fromkeys(names, "eager")
    for pattern, role in rules.items():
        if not isinstance(pattern, str):
            raise PlanError(f"hca.sharded: grad_reduction key {pattern!r} must be a glob string like 'fc1.*'")
        if role not in GRAD_ROLES:
            raise PlanError(f"hca.sharded: grad_reduction role {role!r} for {pattern!r}; use one of {GRAD_ROLES}")
        hits = matching(pattern, names, f"grad_reduction pattern {pattern!r}", "; the") if pattern != "*" else names
        roles.update(dict.fromkeys(hits, role))
    return roles


LOSS_REDUCTIONS = ("sum", "mean")


def grad_scale(loss_reduction: Any, mesh: DeviceMesh, outputs: Layout) -> float:
    """1/n for "mean", n the ranks holding different pieces of a result; 1 for "sum"."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise PlanError(
            f"hca.sharded: loss_reduction={loss_reduction!r}; use 'sum' (the ranks' losses over their pieces of "
            "the results add up to the loss) or 'mean' (they average, as under DDP)"
        )
    if loss_reduction == "sum":
        return 1.0
    pieces = 1
    for mesh_dim, p in enumerate(outputs):
        if isinstance(p, Shard) and not isinstance(p, UnevenShard):  # shares: `share_weight`
            pieces *= mesh.size(mesh_dim)
    return 1.0 / pieces


def share_weight(loss_reduction: str, mesh: DeviceMesh, outputs: Layout) -> float:
    """Under "mean", this rank's share of the rows of a result cut by shares (1 for "sum" or none)."""
    uneven = uneven_dims(outputs)
    if loss_reduction != "mean" or not uneven:
        return 1.0
    mesh_dim, p = uneven[0]
    return weight(p.shares, mesh.get_coordinate()[mesh_dim])


def check_uneven(inputs: tuple[Layout | None, ...], outputs: Layout, params: Mapping[str, Layout]) -> bool:
    """Whether the forward arguments are cut by shares, once shares that cannot run are refused by name.

    One set of shares on one mesh dim; results cut on that mesh dim carry the same shares (the
    pieces of a result are the rows of the arguments'); parameters are not cut there (uneven
    parameter storage is not supported yet).
    """
    cuts = {(d, p.shares) for layout in inputs if layout is not None for d, p in uneven_dims(layout)}
    out_cuts = {(d, p.shares) for d, p in uneven_dims(outputs)}
    if not cuts:
        if out_cuts:
            raise PlanError(
                f"hca.sharded: outputs={outputs!r} are cut by shares but no input is; the pieces of a result "
                "are the rows of the inputs': give inputs= the same shares"
            )
        return False
    if len(cuts) > 1:
        raise PlanError(f"hca.sharded: inputs are cut by different shares {sorted(cuts)}; use one set of shares")
    ((mesh_dim, shares),) = cuts
    out = outputs[mesh_dim]
    if isinstance(out, Shard) and (mesh_dim, getattr(out, "shares", None)) not in cuts:
        raise PlanError(
            f"hca.sharded: inputs are cut by shares {shares} on mesh dim {mesh_dim} but outputs={outputs!r} cut it "
            f"evenly; the results' pieces follow the inputs' rows: write outputs=Shard({out.dim}, shares={shares})"
        )
    for name, layout in params.items():
        if isinstance(layout[mesh_dim], Shard):
            raise UnsupportedError(
                f"hca.sharded: parameter {name!r} is stored {layout} over mesh dim {mesh_dim}, which the inputs cut "
                f"by shares {shares}; uneven shares run data parallel only so far (parameters replicated over the "
                "uneven dim): store it Replicate() there, or put the shares on another mesh dim"
            )
    return True
