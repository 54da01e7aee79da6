"""Megatron-style tensor-parallel MLP: fc1 column-parallel, fc2 row-parallel.

Run:

    python examples/tensor_parallel_mlp.py                      # 2 local gloo ranks
    torchrun --nproc-per-node 4 examples/tensor_parallel_mlp.py
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_hca as hca
from torch_hca import Shard


@hca.sharded({"fc1.*": Shard(0), "fc2.weight": Shard(1)})
class MLP(nn.Module):
    def __init__(self, dim=64, hidden=256):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def main():
    hca.init_mesh()  # the decorator uses the current mesh
    torch.manual_seed(0)  # same data on every rank (inputs are replicated)
    model = MLP()
    compiled = torch.compile(model, backend="hca")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = compiled(torch.randn(32, 64)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if int(os.environ["RANK"]) == 0:
        print(hca.report(compiled).table())
        print(f"loss after 3 steps: {loss.item():.6f}")


if __name__ == "__main__":
    hca.run(main, 2)  # under torchrun: this rank; else 2 local gloo ranks
