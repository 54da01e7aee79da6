"""Work run on every rank by tests/test_embedding.py: a vocabulary-parallel embedding (the table cut
by rows, ``Shard(0)``) read by replicated ids, eagerly and compiled, against one device.
Plain module, importable by the spawned ranks; no pytest here."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import torch_hca as hca
from torch_hca.compiler.embedding import embedding


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.full_tensor() if isinstance(a, DTensor) else a
    return ((a.detach().double() - b.detach().double()).norm() / max(b.detach().double().norm().item(), 1e-30)).item()


def eager_lookup(rows: int, padding_idx: int | None) -> dict:
    """The op on DTensors: `rows` need not divide by the world (torch.chunk's cut), the padding
    row's gradient stays zero. Returns the result's placements and the errors against F.embedding."""
    mesh = hca.init_mesh()
    torch.manual_seed(0)
    table = torch.randn(rows, 6, requires_grad=True)
    ids = torch.randint(0, rows, (3, 5))
    ids[0, 0] = padding_idx if padding_idx is not None else 0
    weight = distribute_tensor(table.detach(), mesh, [Shard(0)]).requires_grad_()
    out = embedding(DTensor.from_local(ids, mesh, [Replicate()]), weight, padding_idx)
    cotangent = torch.randn(3, 5, 6)
    out.full_tensor().backward(cotangent)
    ref = F.embedding(ids, table, padding_idx)
    ref.backward(cotangent)
    return {
        "placements": tuple(str(p) for p in out.placements),
        "out_err": _rel(out, ref),
        "grad_err": _rel(weight.grad, table.grad),
        "grad_placements": tuple(str(p) for p in weight.grad.placements),
    }


class Lookup(nn.Module):
    """A large table, a few ids: reading the table where it lies beats gathering it."""

    def __init__(self, rows: int = 4096, dim: int = 64, padding_idx: int | None = 7):
        super().__init__()
        self.emb = nn.Embedding(rows, dim, padding_idx=padding_idx)
        self.proj = nn.Linear(dim, dim)

    def forward(self, ids):
        return self.proj(torch.tanh(self.emb(ids)))


def compiled_lookup() -> dict:
    """`Lookup` stored vocabulary-parallel and compiled: gradients against one device, collectives."""
    torch._dynamo.reset()
    hca.init_mesh()
    torch.manual_seed(0)
    ref = Lookup()
    model = hca.sharded({"emb.weight": Shard(0)}, inputs=Replicate(), outputs=Replicate())(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca", options={"check": True, "strict": True})
    ids = torch.randint(0, 4096, (2, 8))
    ids[0, :3] = 7  # the padding row
    compiled(ids).pow(2).sum().backward()
    ref(ids).pow(2).sum().backward()
    errs = {name: _rel(p.grad, q.grad) for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    report = hca.report(compiled)
    return {
        "grad_errs": errs,
        "collectives": [(c.direction, c.kind, c.bytes) for c in report.collectives],
        "line": report.parallelism(),
    }
