"""A tensor-parallel transformer block (attention heads and MLP split over ranks),
with `F.scaled_dot_product_attention` and a causal mask, checked against one device.

    python examples/transformer_block.py
    torchrun --nproc-per-node 2 examples/transformer_block.py
"""

import copy
import os

import torch

import torch_hca as hca
from torch_hca.tools import zoo


def main():
    mesh = hca.init_mesh()
    torch.manual_seed(0)
    reference = zoo.TransformerBlock(dim=64, heads=4, hidden=256)
    model = hca.sharded(zoo.TP_BLOCK, mesh=mesh)(copy.deepcopy(reference))
    compiled = torch.compile(model, backend="hca")
    x = torch.randn(4, 16, 64)
    compiled(x).square().mean().backward()
    reference(x).square().mean().backward()
    worst = max(
        ((p.grad.full_tensor() - q.grad).norm() / q.grad.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters())
    )
    if int(os.environ["RANK"]) == 0:
        print(hca.report(compiled))
        print(f"max gradient relative error vs one device: {worst:.2e}")


if __name__ == "__main__":
    hca.run(main, 2)  # under torchrun: this rank; else 2 local gloo ranks
