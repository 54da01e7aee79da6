"""Data parallelism with the batch cut 1:3: one rank holds a quarter of the rows.

Each rank takes the mean loss over its own rows, as under DDP; with the batch cut
by shares, ``loss_reduction="mean"`` weights each rank's gradient by its share of
the rows (1/4 and 3/4), not by 1/2, so the gradients are those of the mean over
the whole batch. The script checks them against one device (docs/heterogeneous.md).

    python examples/heterogeneous.py
    torchrun --nproc-per-node 2 examples/heterogeneous.py
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_hca as hca

SHARES = (1, 3)
BATCH = 16  # a multiple of sum(SHARES)


def main():
    mesh = hca.init_mesh()
    rank = dist.get_rank()
    torch.manual_seed(0)
    one_device = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    cut = hca.Shard(0, shares=SHARES)
    model = hca.sharded({}, mesh=mesh, inputs=cut, outputs=cut, loss_reduction="mean")(copy.deepcopy(one_device))
    compiled = torch.compile(model, backend="hca")
    rows = [BATCH * s // sum(SHARES) for s in SHARES]
    start = sum(rows[:rank])
    x, target = torch.randn(BATCH, 32), torch.randn(BATCH, 32)  # the global batch, the same on every rank
    F.mse_loss(compiled(x[start : start + rows[rank]]), target[start : start + rows[rank]]).backward()
    F.mse_loss(one_device(x), target).backward()
    worst = max(
        ((p.grad.full_tensor() - q.grad).norm() / q.grad.norm()).item()
        for p, q in zip(model.parameters(), one_device.parameters())
    )
    if rank == 0:
        print(hca.report(compiled).parallelism())
        print(f"rows per rank: {rows}; max gradient relative error against one device: {worst:.1e}")
        print("PASS" if worst < 1e-5 else "FAIL")


if __name__ == "__main__":
    hca.run(main, 2)  # under torchrun: this rank; else 2 local gloo ranks
