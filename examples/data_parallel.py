"""Data parallel with gradient accumulation, written as a DDP loop: replicated
parameters, each rank a slice of the batch and its own loss on its own rows.

Under DDP each rank's loss is the mean over its rows and DDP averages the
ranks' gradients. ``loss_reduction="mean"`` says the same here: the gradients
are those of the mean of the ranks' losses, equal to DDP's (the default,
``"sum"``, gives those of their sum, world-size times larger; right when each
rank's loss is a sum over its rows). With ``grad_reduction="deferred"`` the gradients stay
Partial through the 4 microbatches (no communication) and
`hca.reduce_gradients` sums them in one bucketed all-reduce. The default,
``"eager"``, sums them inside every backward instead.

    python examples/data_parallel.py
    torchrun --nproc-per-node 4 examples/data_parallel.py
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_hca as hca
from torch_hca import Shard

MICROBATCHES = 4


def main():
    mesh = hca.init_mesh()
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())]
    model = hca.sharded(
        {}, mesh=mesh, inputs=Shard(0), outputs=Shard(0), grad_reduction="deferred", loss_reduction="mean"
    )(nn.Sequential(*layers))
    compiled = torch.compile(model, backend="hca")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for step in range(3):
        for _ in range(MICROBATCHES):
            batch = torch.randn(16 * world, 32)  # the global batch, same on every rank
            target = torch.randn(16 * world, 32)
            local, local_target = batch.chunk(world)[rank], target.chunk(world)[rank]  # this rank's rows
            F.mse_loss(compiled(local), local_target).backward()  # this rank's loss, as under DDP
        buckets = hca.reduce_gradients(model)  # one all-reduce per bucket
        opt.step()
        opt.zero_grad()
    if rank == 0:
        print(f"collectives in the graphs: {hca.report(compiled).collective_counts()}")
        print(
            f"reduce_gradients: {len(buckets)} bucket(s), {sum(b.bytes for b in buckets)} bytes, "
            f"{sum(len(b.parameters) for b in buckets)} parameters"
        )


if __name__ == "__main__":
    hca.run(main, 2)  # under torchrun: this rank; else 2 local gloo ranks
