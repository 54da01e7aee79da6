"""Data parallelism with the batch cut 1:3: one rank holds a quarter of the rows.

Each rank takes the mean loss over its own rows, as under DDP; with the batch cut
by shares, ``loss_reduction="mean"`` weights each rank's gradient by its share of
the rows (1/4 and 3/4), not by 1/2, so the gradients are those of the mean over
the whole batch. The rows come from a hand-written deployment (rank 1 three times as
fast), which the report then reads: each rank's predicted step, and the even cut's. The
script checks the gradients against one device (docs/heterogeneous.md).

    python examples/heterogeneous.py
    torchrun --nproc-per-node 2 examples/heterogeneous.py
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_hca as hca

BATCH = 16
# Rank 1 does three times rank 0's rows a second; each pays 1 ms a step whatever its rows.
DEPLOYMENT = hca.Deployment(
    (hca.RankCapacity("cpu", 100.0, None, 0.001), hca.RankCapacity("cpu", 300.0, None, 0.001)), unit="rows/s"
)


def main():
    mesh = hca.init_mesh()
    rank = dist.get_rank()
    torch.manual_seed(0)
    one_device = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    rows = DEPLOYMENT.shares(BATCH)  # (4, 12): the split whose slower rank finishes first
    cut = hca.Shard(0, shares=rows)
    model = hca.sharded({}, mesh=mesh, inputs=cut, outputs=cut, loss_reduction="mean", deployment=DEPLOYMENT)(
        copy.deepcopy(one_device)
    )
    compiled = torch.compile(model, backend="hca")
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
