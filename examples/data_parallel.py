"""Data parallel: replicated parameters, each rank a slice of the batch.

Each rank's loss is the sum over its own rows, so the gradient is that of the
whole batch's sum. DTensor leaves the replicated parameters' gradients
Partial; `full_tensor()` or the optimizer step reduces them.

    python examples/data_parallel.py
    torchrun --nproc-per-node 4 examples/data_parallel.py
"""

import os

import torch
import torch.nn as nn

import torch_hca as hca
from torch_hca import Shard


def main():
    mesh = hca.init_mesh()
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU())]
    model = hca.sharded({}, mesh=mesh, inputs=Shard(0), outputs=Shard(0))(nn.Sequential(*layers))
    compiled = torch.compile(model, backend="hca")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for step in range(3):
        batch = torch.randn(16 * world, 32)          # the global batch, same on every rank
        local = batch.chunk(world)[rank]             # this rank's rows
        compiled(local).square().sum().backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        grads = {n: str(p.grad) for n, p in model.named_parameters()}
        print(f"{len(grads)} parameters, replicated; collectives in the graphs: "
              f"{hca.report(compiled).collective_counts()}")


if __name__ == "__main__":
    main() if "RANK" in os.environ else hca.launch(main, 2)
