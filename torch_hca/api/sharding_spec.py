"""A sharded module's resolved plan (`hca.sharded` makes it, the sharded forward reads it)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from torch_hca.compiler.logical import ScaleGrad, check_input_layout, output_layout
from torch_hca.compiler.plan_layouts import Layout
from torch_hca.spmd.shares import even, uneven_dims


@dataclass(frozen=True)
class ShardingSpec:
    """A module's resolved plan: the mesh, each parameter's layout, and I/O layouts."""

    mesh: DeviceMesh
    params: Mapping[str, Layout]
    inputs: Layout | tuple[Layout | None, ...]
    outputs: Layout
    per_argument: bool
    grad_roles: Mapping[str, str]
    mesh_index: int = 0  # the mesh's index for torch_hca.compiler.logical's marker ops
    grad_scale: float = 1.0  # times each result's cotangent: 1/n under loss_reduction="mean"
    # Times the cotangent of each result cut by shares, outside the graph (it differs by rank):
    # this rank's share of the rows under loss_reduction="mean" (torch_hca.spmd.shares.weight).
    share_weight: float = 1.0
    uneven: bool = False  # some argument is cut by shares (hca.Shard(d, shares=...))
    # hca.sharded(..., strategy=path): the strategy file a compile of this module loads when its
    # options name none (backends/entry.py, docs/strategy.md).
    strategy: str | None = None
    # hca.sharded(..., deployment=): each rank's capacity (a hca.Deployment), read by the report
    # (each rank's rows and predicted step under shares) and written into the strategy file.
    deployment: Any = None

    @functools.cached_property
    def stores_split(self) -> bool:
        """Whether some parameter is stored split (not replicated on every mesh dim): then an
        eager call communicates (`sharded_forward`'s check that every rank makes it)."""
        return not all(all(isinstance(p, Replicate) for p in layout) for layout in self.params.values())

    def input_layout(self, index: int | None) -> Layout | None:
        if not self.per_argument:
            return self.inputs
        if index is None or index >= len(self.inputs):
            return (Replicate(),) * self.mesh.ndim
        return self.inputs[index]

    def to_dtensor(self, x: Any, index: int | None) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        layout = self.input_layout(index)
        if layout is None:
            return x
        check_input_layout(x, layout, f"forward argument {index}", self.mesh)
        if isinstance(x, DTensor):
            return x
        return DTensor.from_local(x, self.mesh, even(layout), run_check=False)

    def to_local(self, y: Any) -> Any:
        if not isinstance(y, DTensor):
            return y
        layout, scale = output_layout(y, self.outputs, self.grad_scale)
        local = y.redistribute(self.mesh, even(layout)).to_local(grad_placements=even(layout))
        return self.weighted(local, layout, scale)

    def weighted(self, local: torch.Tensor, layout: Layout, scale: float = 1.0) -> torch.Tensor:
        """A result leaving in `layout`, its cotangent times `scale` and, if it is cut by shares,
        this rank's `share_weight`."""
        scale *= self.share_weight if uneven_dims(layout) else 1.0
        return local if scale == 1.0 else ScaleGrad.apply(local, scale)
