"""Asking DTensor which layout an op writes: one FX node run on fake DTensors in given layouts.

`probe` runs a node with its DTensor inputs in chosen layouts and returns the layout DTensor's
sharding rule gives its result, or None where DTensor would redistribute on its own; answers
are cached for the process (`_PROBES`). `submeshes` gives each mesh dim's 1-D mesh, on which
`torch_hca.compiler.layout.candidates` probes a combination's parts first. `call_node` runs
one node on given arguments (the layout pass and lifting use it too).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torch_hca._torch_private import quiet_cpu_alltoall_fallback, record_implicit_redistributions
from torch_hca.compiler.logical import Layout
from torch_hca.errors import UnsupportedError
from torch_hca.spmd.chunks import local_piece_shape
from torch_hca.spmd.placements import letter


def _fake_dtensor(like: DTensor, layout: Layout, mesh: DeviceMesh | None = None) -> DTensor:
    """A DTensor of `like`'s global shape in `layout` over `mesh` (default: `like`'s mesh)."""
    mesh = mesh if mesh is not None else like.device_mesh
    # This rank's own piece: where a Shard does not divide, the pieces differ by rank (torch.chunk's).
    shape = local_piece_shape(like.shape, layout, mesh.shape, mesh.get_coordinate())
    data = torch.empty(shape, dtype=like.dtype, device=like._local_tensor.device)
    return DTensor.from_local(data, mesh, layout, run_check=False, shape=like.shape, stride=like.stride())


def call_node(gm: fx.GraphModule, node: fx.Node, args, kwargs) -> Any:
    """Run one FX node on given arguments (the layout pass and the probes both do)."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "get_attr":
        return _attr(gm, node.target)
    raise UnsupportedError(f"layout: unexpected node kind {node.op} at {node.name}")


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _describe_arg(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), a.dtype)
    if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return a
    return repr(a)


# (op, args described, layouts) -> (output layout or None) ; shared by every compile in the process
_PROBES: dict[Any, Layout | None] = {}


def probe(
    gm: fx.GraphModule,
    node: fx.Node,
    slots: list[fx.Node],
    layouts: tuple[Layout, ...],
    value_of,
    mesh: DeviceMesh | None = None,
) -> Layout | None:
    """The layout DTensor writes when `node` reads `slots` in `layouts` over `mesh` (default: the
    traced values' mesh); None if it would redistribute."""
    swap = dict(zip(slots, layouts))
    described = fx.node.map_arg(
        (node.args, node.kwargs), lambda n: ("slot", slots.index(n)) if n in swap else _describe_arg(value_of(n))
    )
    target = node.target if node.op != "call_module" else type(gm.get_submodule(node.target))
    mesh = mesh if mesh is not None else value_of(slots[0]).device_mesh
    key = (
        node.op,
        target,
        repr(described),
        tuple(tuple(map(letter, lay)) for lay in layouts),
        tuple(tuple(value_of(s).shape) for s in slots),
        tuple(mesh.shape),
    )
    if key in _PROBES:
        return _PROBES[key]
    args, kwargs = fx.node.map_arg(
        (node.args, node.kwargs), lambda n: _fake_dtensor(value_of(n), swap[n], mesh) if n in swap else value_of(n)
    )
    result = None
    try:
        # A probe that makes DTensor move Shard(i) -> Shard(j) on a CPU mesh would log its
        # gloo all_to_all fallback warning: about a move the program may never make.
        with record_implicit_redistributions() as events, quiet_cpu_alltoall_fallback():
            out = call_node(gm, node, args, kwargs)
        # Only plain Shard / Replicate / Partial results: DTensor cannot always move a
        # _StridedShard (a flattened dim whose inner part is sharded) while tracing,
        # and its view rules mislabel some (tests/test_op_families.py, KNOWN_WRONG).
        if (
            not events
            and isinstance(out, DTensor)
            and all(type(p) in (Shard, Replicate, Partial) for p in out.placements)
        ):
            result = tuple(out.placements)
    except Exception:  # a combination DTensor has no rule for
        result = None
    _PROBES[key] = result
    return result


def submeshes(mesh: DeviceMesh) -> list[tuple[int, DeviceMesh]]:
    """(mesh dim, its 1-D mesh) for each dim of a mesh of two or more dims with more than one rank.

    DTensor builds a sharding rule on several mesh dims as the product of its rules on one
    (`expand_to_full_mesh_op_strategy`), so a combination of layouts runs without moving
    data only if each mesh dim's part of it does alone. Probing those parts first on each
    dim's 1-D mesh (a few milliseconds, cached across combinations) skips most full
    probes, which cost ~45 ms each on a 2 x 2 mesh: 395 of a two-layer MLP's 457 found
    nothing, and its compile took 19 s. Should some rule break that product form, the
    solver loses a candidate, never gains a wrong one: each kept combination is still
    probed whole.
    """
    if mesh.ndim < 2 or mesh.mesh_dim_names is None:
        return []
    return [(m, mesh[name]) for m, name in enumerate(mesh.mesh_dim_names) if mesh.shape[m] > 1]
