"""Rank functions for tests/test_step.py: `hca.step` with a non-finite gradient on one rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

import torch_hca as hca


def one_step(nan_on: int | None, nonfinite: str) -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = hca.init_mesh()
    model = hca.sharded({"0.weight": Shard(0)}, mesh=mesh, inputs=Shard(0))(
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).square().sum().backward()
    if dist.get_rank() == nan_on:
        model[0].weight.grad.to_local()[0, 0] = float("nan")  # this rank's piece only
    before = [p.full_tensor().clone() for p in model.parameters()]
    try:
        stepped = hca.step(opt, nonfinite=nonfinite)
        error = None
    except hca.CheckError as e:
        stepped, error = None, str(e)
    moved = [not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters())]
    grads_left = [p.grad is not None for p in model.parameters()]
    return {"stepped": stepped, "error": error, "moved": moved, "grads_left": grads_left}
