"""`hca.reduce_gradients`: sum deferred (partial) gradients over ranks, bucketed.

With ``grad_reduction="deferred"``, gradients of parameters replicated over a
split batch stay Partial through any number of backward passes (accumulation
adds them locally, no communication). This reduces them once: gradients of
the same mesh dimension and dtype are flattened into buckets of at most
``bucket_bytes``, each bucket is one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torch_hca.errors import HCAError
from torch_hca.spmd.collective_nodes import nbytes
from torch_hca.spmd.placements import partial_dims

DEFAULT_BUCKET_BYTES = 25 * 2**20  # as DistributedDataParallel's default


@dataclass
class Bucket:
    mesh_dim: int
    dtype: torch.dtype
    parameters: list[str] = field(default_factory=list)
    bytes: int = 0


def _buckets(named: list[tuple[str, nn.Parameter]], bucket_bytes: int) -> list[tuple[Bucket, list[nn.Parameter]]]:
    """Deterministic buckets (parameter order) of gradients partial on one mesh dimension."""
    buckets: list[tuple[Bucket, list[nn.Parameter]]] = []
    open_by_key: dict[tuple, tuple[Bucket, list[nn.Parameter]]] = {}
    for name, p in named:
        dims = partial_dims(p.grad)
        if not dims:
            continue
        key = (dims[0], p.grad.dtype, id(p.grad.device_mesh))
        size = nbytes(p.grad._local_tensor)
        current = open_by_key.get(key)
        if current is None or (current[0].bytes and current[0].bytes + size > bucket_bytes):
            current = (Bucket(dims[0], p.grad.dtype), [])
            open_by_key[key] = current
            buckets.append(current)
        current[0].parameters.append(name)
        current[0].bytes += size
        current[1].append(p)
    return buckets


def _reduce_bucket(bucket: Bucket, params: list[nn.Parameter]) -> None:
    mesh = params[0].grad.device_mesh
    flat = torch.cat([p.grad._local_tensor.reshape(-1) for p in params])
    flat = funcol.all_reduce(flat, "sum", (mesh, bucket.mesh_dim))
    flat = funcol.wait_tensor(flat) if isinstance(flat, funcol.AsyncCollectiveTensor) else flat
    offset = 0
    for p in params:
        local = p.grad._local_tensor
        piece = flat[offset : offset + local.numel()].view_as(local)
        offset += local.numel()
        placements = list(p.grad.placements)
        placements[bucket.mesh_dim] = Replicate()
        p.grad = DTensor.from_local(piece.clone(), mesh, placements, run_check=False)


def reduce_gradients(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Sum every partial gradient of `model` over the ranks that hold its pieces.

    Returns the buckets, in the order their all-reduces were issued (every rank
    issues the same order). Gradients partial over several mesh dimensions are
    reduced one dimension per round.
    """
    if not isinstance(model, nn.Module):
        raise HCAError(f"hca.reduce_gradients: expected the sharded nn.Module, got {type(model).__name__}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise HCAError(f"hca.reduce_gradients: bucket_bytes={bucket_bytes!r}; give a positive int (default 25 MiB)")
    done: list[Bucket] = []
    while True:
        named = [(n, p) for n, p in model.named_parameters() if isinstance(p.grad, DTensor) and partial_dims(p.grad)]
        if not named:
            return done
        for bucket, params in _buckets(named, bucket_bytes):
            _reduce_bucket(bucket, params)
            done.append(bucket)
