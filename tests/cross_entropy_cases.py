"""Work run on every rank by tests/test_cross_entropy.py: a language model whose head is stored by
vocabulary rows (``Shard(0)``), its loss computed in the compiled graph, against one device.
Plain module, importable by the spawned ranks; no pytest here."""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_hca as hca


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.full_tensor() if isinstance(a, DTensor) else a
    return ((a.detach().double() - b.detach().double()).norm() / max(b.detach().double().norm().item(), 1e-30)).item()


class HeadLoss(nn.Module):
    """Embedding, one hidden layer, a head of `vocab` rows and the next-token loss in the forward."""

    def __init__(self, vocab: int, dim: int = 32, reduction: str = "mean"):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.reduction = reduction

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.hidden(self.emb(ids))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=self.reduction)


def compiled_head_loss(vocab: int, reduction: str) -> dict:
    """`HeadLoss` with head and embedding stored by vocabulary rows, compiled with the refinement
    check; some labels are ignored (-100). Gradients and loss against one device, collectives."""
    torch._dynamo.reset()
    hca.init_mesh()
    torch.manual_seed(0)
    ref = HeadLoss(vocab, reduction=reduction)
    plan = {"emb.weight": Shard(0), "head.weight": Shard(0)}
    model = hca.sharded(plan, inputs=Replicate(), outputs=Replicate())(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca", options={"check": True, "strict": True})
    ids = torch.randint(0, vocab, (4, 16))
    labels = torch.randint(0, vocab, (4, 16))
    labels[0, :5] = -100
    loss = compiled(ids, labels)
    want = ref(ids, labels)
    cotangent = torch.rand_like(want)
    (loss * cotangent).sum().backward()
    (want * cotangent).sum().backward()
    errs = {name: _rel(p.grad, q.grad) for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    report = hca.report(compiled)
    # The strategy file, checked by the independent verifier on every rank (verify/vocabulary.py).
    with tempfile.TemporaryDirectory() as tmp:
        strategy = report.save_strategy(f"{tmp}/strategy.json")
    verified = hca.verify(model, strategy, (ids, labels), raise_on_failure=False)
    return {
        "verified": (verified.ok, str(verified)),
        "loss_err": _rel(loss, want),
        "grad_errs": errs,
        "collectives": [(c.direction, c.kind, c.bytes) for c in report.collectives],
        "program": report.graphs[0].dtensor_program.code,
    }
