"""Work run on every rank by tests/test_uneven_shares.py: data parallelism with the batch cut by shares.

Each rank holds its share of one global batch (``hca.Shard(0, shares=...)``),
takes the mean loss over its own rows, as a DDP loop does, and steps an
optimizer; a single-device reference takes the mean over the whole batch.
Plain module, importable by the spawned ranks; no pytest here.
"""

from __future__ import annotations

import contextlib
import copy
import types
import unittest.mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import torch_hca as hca
from torch_hca.spmd.shares import rows_for

import model_zoo


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.full_tensor() if isinstance(a, DTensor) else a
    return ((a.detach().double() - b.detach().double()).norm() / max(b.detach().double().norm().item(), 1e-30)).item()


def deep_mlp() -> model_zoo.Built:
    from torch_hca.tools import zoo

    return zoo.DeepMLP(16, 4), model_zoo.vector_inputs, lambda out, inputs: (out * out).mean()


def zoo_gpt() -> model_zoo.Built:
    """One block, not 2: the (dp, tp) case's 4 ranks each compile it with a dynamic batch, on 2 cores."""
    from torch_hca.tools import zoo

    return (
        zoo.GPT(vocab=model_zoo.VOCAB, dim=32, heads=4, hidden=64, layers=1),
        model_zoo.token_inputs,
        model_zoo.lm_loss,
    )


def llama() -> model_zoo.Built:
    """The zoo's HF Llama (tests/model_zoo.py: GQA, RoPE, HF's masks) with 1 decoder layer, not 2."""
    return model_zoo.llama(layers=1)


def dp_by_shares(
    model_name: str,
    shares: tuple[int, ...],
    batch: int,
    weighted: bool = True,
    steps: int = 2,
    megatron: bool = False,
    deployment: dict | None = None,
) -> dict:
    """Two SGD steps (momentum 0.9) of `model_name` under data parallelism cut by `shares`.

    ``weighted=False`` is the classic bug of uneven data parallelism, the negative control:
    each rank's mean loss scaled by 1/n instead of by its share of the rows. ``megatron``: a
    (dp, tp) mesh of 2 tensor-parallel ranks per row of the mesh, the blocks stored Megatron's
    way over tp and the batch cut by `shares` over dp.
    Returns the worst relative error of this rank's outputs, of each gradient and of each
    parameter after the steps, against one device; the collectives of the compiled graphs;
    this rank's rows; and the report's description of the shares. ``deployment``: a
    `hca.Deployment`'s data, given to `hca.sharded`; the strategy file's copy is returned.
    """
    from torch_hca.tools import zoo

    torch._dynamo.reset()
    n = len(shares)
    mesh = hca.init_mesh((n, 2), ("dp", "tp")) if megatron else hca.init_mesh()
    rank = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    ref, make_inputs, loss_fn = {"deep_mlp": deep_mlp, "zoo_gpt": zoo_gpt, "llama": llama}.get(
        model_name, lambda: model_zoo.build(model_name)
    )()
    cut = (hca.Shard(0, shares=shares), hca.Replicate()) if megatron else hca.Shard(0, shares=shares)
    plan = zoo.two_d(zoo.TP_GPT) if megatron else {}
    dep = hca.Deployment.from_dict(deployment) if deployment is not None else None
    model = hca.sharded(
        plan, mesh=mesh, inputs=cut, outputs=cut, loss_reduction="mean" if weighted else "sum", deployment=dep
    )(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca", options={"check": True})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rows = rows_for(shares, batch)
    start = sum(rows[:rank])
    names = [name for name, _ in ref.named_parameters()]
    out_err, grad_errs = 0.0, dict.fromkeys(names, 0.0)
    for step in range(steps):
        torch.manual_seed(100 + step)  # one global batch, the same on every rank
        inputs = make_inputs(batch)
        local = tuple(t[start : start + rows[rank]] for t in inputs)
        out = compiled(*local)
        loss = loss_fn(out, local)
        (loss if weighted else loss / n).backward()
        ref_out = ref(*inputs)
        loss_fn(ref_out, inputs).backward()
        out_err = max(out_err, _rel(out, ref_out[start : start + rows[rank]]))
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            grad_errs[name] = max(grad_errs[name], _rel(p.grad, q.grad))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    report = hca.report(compiled)
    unique = {id(p): p for p in ref.parameters()}.values()
    collectives = [(c.direction, c.kind, c.bytes, c.group_size) for c in report.collectives]
    return {
        "rows": rows[rank],
        "out_err": out_err,
        "grad_errs": grad_errs,
        "param_errs": {name: _rel(p, q) for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())},
        "collectives": collectives,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in unique),
        "shares_line": report.parallelism(),
        "explain_head": report.explain().splitlines()[1] if dep is not None else None,
        "filed_deployment": _filed_deployment(report),
    }


def _filed_deployment(report) -> dict | None:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return report.save_strategy(os.path.join(d, "s.json"))["deployment"]


def weighted_and_not(model_name: str, shares: tuple[int, ...], batch: int) -> tuple[dict, dict]:
    """`dp_by_shares` weighted by the shares, then the negative control: the same run unweighted."""
    return dp_by_shares(model_name, shares, batch), dp_by_shares(model_name, shares, batch, weighted=False, steps=1)


class MeanInside(nn.Module):
    """Means over the rows inside ``forward``: a loss (``"loss"``), or the rows centred on
    their mean first, as a batch norm does (``"centred"``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.kind = kind

    def forward(self, x):
        y = torch.tanh(self.fc(x))
        if self.kind == "centred":
            y = y - y.mean(0, keepdim=True)
        return y.square().mean()


def mean_inside(shares: tuple[int, ...], batch: int, kind: str = "loss") -> dict:
    """A mean over the uneven batch inside ``forward`` against one device: the loss every rank
    gets and each gradient (relative errors), and the forward's collectives."""
    torch._dynamo.reset()
    mesh = hca.init_mesh()
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = MeanInside(kind)
    cut = hca.Shard(0, shares=shares)
    model = hca.sharded({}, mesh=mesh, inputs=cut, outputs=hca.Replicate())(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca")
    rows = rows_for(shares, batch)
    x = torch.randn(batch, 8)
    loss = compiled(x[sum(rows[:rank]) : sum(rows[: rank + 1])])
    loss.backward()
    ref_loss = ref(x)
    ref_loss.backward()
    report = hca.report(compiled)
    return {
        "loss_err": _rel(loss, ref_loss),
        "grad_errs": {
            n: _rel(p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
        },
        "forward": [(c.kind, c.bytes) for c in report.collectives if c.direction == "forward"],
        "weighted": report.graph.weighted_means,
    }


def eager_by_shares(shares: tuple[int, ...], batch: int) -> float:
    """The sharded module called without torch.compile (DTensor eagerly): the worst relative
    error of a gradient against one device, each rank's mean loss weighted by the shares."""
    hca.init_mesh()
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    cut = hca.Shard(0, shares=shares)
    model = hca.sharded({}, inputs=cut, outputs=cut, loss_reduction="mean")(copy.deepcopy(ref))
    x = torch.randn(batch, 8)
    rows = rows_for(shares, batch)
    start = sum(rows[:rank])
    model(x[start : start + rows[rank]]).square().mean().backward()
    ref(x).square().mean().backward()
    return max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


def bad_rows(shares: tuple[int, ...], rows: tuple[int, ...], first_good: bool = False) -> str:
    """The error of a call whose pieces do not follow `shares` (each rank passes rows[rank] rows);
    ``first_good``: after a call that follows them, under input_check="first"."""
    torch._dynamo.reset()
    hca.init_mesh()
    torch.manual_seed(0)
    cut = hca.Shard(0, shares=shares)
    model = hca.sharded({}, inputs=cut, outputs=cut)(nn.Linear(4, 4))
    compiled = torch.compile(model, backend="hca", options={"input_check": "first"} if first_good else None)
    try:
        if first_good:
            compiled(torch.randn(rows_for(shares, 4 * sum(shares))[dist.get_rank()], 4))
        compiled(torch.randn(rows[dist.get_rank()], 4))
    except Exception as e:
        return _named(e)
    return "no error"


def refused(kind: str) -> str:
    """The error of a forward that reads the uneven batch's size as a number (``"divide"``), or
    centres the rows on their mean, which DTensor gathers the batch for (``"centred"``)."""

    class ByBatchSize(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).sum() / x.shape[0]

    torch._dynamo.reset()
    hca.init_mesh()
    cut = hca.Shard(0, shares=(1, 3))
    module = ByBatchSize() if kind == "divide" else MeanInside("centred")
    compiled = torch.compile(hca.sharded({}, inputs=cut, outputs=hca.Replicate())(module), backend="hca")
    try:
        compiled(torch.randn(2 if dist.get_rank() == 0 else 6, 8)).backward()
    except Exception as e:
        return _named(e)
    return "no error"


def _named(e: Exception) -> str:
    """The error as "Type: message", the backend's own error out of torch.compile's wrapper."""
    e = getattr(e, "inner_exception", None) or e
    return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def _clock_of_steps():
    """`Deployment.measure`'s clock made a counter that the timed step moves on: the timings are
    exactly the step's, whatever else runs on the machine (a sleeping step overshoots its sleep on
    a busy one, which made this test flaky). Yields the step's way to spend `s` seconds."""
    from torch_hca.api import deployment

    now = [0.0]
    with unittest.mock.patch.object(deployment, "time", types.SimpleNamespace(perf_counter=lambda: now[0])):
        yield lambda s: now.__setitem__(0, now[0] + s)


def measured_deployment(delay_s: float) -> dict:
    """`hca.Deployment.measure` with a step that takes (1 + rank) x `delay_s`: rank 1 half rank 0's speed."""
    with _clock_of_steps() as spend:
        dep = hca.Deployment.measure(step=lambda: spend((1 + dist.get_rank()) * delay_s), rounds=3)
    return dep.to_dict()


def measured_line(delay_s: float) -> dict:
    """`hca.Deployment.measure(step, rows=(4, 12))` with a step on n rows that takes (1 + rank) x
    (`delay_s` + n x `delay_s` / 10): rank r's fixed part (1 + r) x `delay_s`, its rows per second
    10 / ((1 + r) x `delay_s`)."""
    slow = 1 + dist.get_rank()
    with _clock_of_steps() as spend:
        dep = hca.Deployment.measure(step=lambda n: spend(slow * delay_s * (1 + n / 10)), rounds=3, rows=(4, 12))
    return dep.to_dict()


def strategy_by_shares(shares: tuple[int, ...], batch: int, other: tuple[int, ...]) -> dict:
    """`MeanInside` cut by `shares`: its strategy file saved on this rank, then loaded by a fresh
    compile of the same model (loss and gradients against one device); and the file given to a
    compile cut by `other` shares and to one cut evenly (the refusals, as text)."""
    import json
    import os
    import tempfile

    torch._dynamo.reset()
    mesh = hca.init_mesh()
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MeanInside("loss")
    fresh = copy.deepcopy(ref)
    x = torch.randn(batch, 8)

    def piece(cut_rows):
        return x[sum(cut_rows[:rank]) : sum(cut_rows[: rank + 1])]

    def compiled(cut, strategy=None):
        model = hca.sharded({}, mesh=mesh, inputs=cut, outputs=hca.Replicate())(copy.deepcopy(fresh))
        return model, torch.compile(model, backend="hca", options={"strategy": strategy} if strategy else {})

    rows = rows_for(shares, batch)
    _, first = compiled(hca.Shard(0, shares=shares))
    first(piece(rows)).backward()
    path = os.path.join(tempfile.mkdtemp(prefix="hca_shares_"), "strategy.json")
    hca.report(first).save_strategy(path)
    torch._dynamo.reset()
    model, loaded = compiled(hca.Shard(0, shares=shares), path)
    loss = loaded(piece(rows))
    loss.backward()
    ref_loss = ref(x)
    ref_loss.backward()
    refused = {}
    for name, cut, cut_rows in (
        ("other shares", hca.Shard(0, shares=other), rows_for(other, batch)),
        ("even", hca.Shard(0), (batch // n,) * n),
    ):
        torch._dynamo.reset()
        try:
            compiled(cut, path)[1](piece(cut_rows))
            refused[name] = "no error"
        except Exception as e:  # Dynamo wraps the backend's error
            cause = e.__cause__ or e
            refused[name] = f"{type(cause).__name__}: {cause}"
    with open(path) as f:
        text = f.read()
    return {
        "file": json.loads(text),
        "text": text,
        "layout": hca.report(loaded).graph.layout.solver,
        "loss_err": _rel(loss, ref_loss),
        "grad_errs": {
            n: _rel(p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
        },
        "refused": refused,
    }
