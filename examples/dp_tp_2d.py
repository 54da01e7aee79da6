"""Data and tensor parallel together on a (dp, tp) mesh.

Run:

    torchrun --nproc-per-node 4 examples/dp_tp_2d.py    # dp=2 x tp=2
    python examples/dp_tp_2d.py                          # 4 local gloo ranks
"""

import os

import torch

import torch_hca as hca
from torch_hca import Replicate, Shard
from torch_hca.tools import zoo


def main():
    world = int(os.environ["WORLD_SIZE"])
    mesh = hca.init_mesh((world // 2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    plan = {"fc1.*": (Replicate(), Shard(0)), "fc2.weight": (Replicate(), Shard(1))}
    io = (Shard(0), Replicate())  # batch split over dp, whole over tp
    model = hca.sharded(plan, mesh=mesh, inputs=io, outputs=io)(zoo.MLP(64, 256))
    compiled = torch.compile(model, backend="hca")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(32, 64)
    local = batch.chunk(mesh.size(0))[mesh.get_local_rank("dp")]
    for step in range(3):
        compiled(local).square().sum().backward()
        opt.step()
        opt.zero_grad()
    if int(os.environ["RANK"]) == 0:
        print(hca.report(compiled).table())


if __name__ == "__main__":
    hca.run(main, 4)  # under torchrun: this rank; else 4 local gloo ranks
