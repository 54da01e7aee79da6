"""`python -m torch_hca bench`: hca next to other ways of training the same model.

Every contestant trains an identical copy of the same model on the same data
for the same steps (forward, backward, SGD step), on local gloo ranks:

- ``hca``: ``torch.compile(model, backend="hca")`` on the ``hca.sharded`` model;
- ``dtensor_eager``: the same ``hca.sharded`` DTensor model, not compiled;
- ``dtensor_inductor``: the same DTensor model under plain ``torch.compile`` (Inductor);
- ``expert`` (tensor-parallel models): ``parallelize_module`` with
  ColwiseParallel / RowwiseParallel, as production trainers write it;
- ``ddp`` (data-parallel model): ``DistributedDataParallel`` on the plain module.

Bytes are the bytes one rank sends per step in a ring implementation
(`collective_kinds.bytes_per_rank`), counted at run time where possible.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import statistics
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from . import zoo
from .collective_kinds import CollectiveCounter, Kind, bytes_per_rank
from .launch import launch
from .mesh import init_mesh
from .plan import sharded
from .report import report

CONTESTANTS = ("hca", "dtensor_eager", "dtensor_inductor", "expert", "ddp")
MODELS = ("mlp", "block", "dp")
LR = 1e-3


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # "tp" or "dp"
    build: object
    plan: dict
    input_shape: tuple


SPECS = {
    "mlp": Spec("mlp", "tp", lambda: zoo.MLP(256, 1024), zoo.MEGATRON_MLP, (32, 256)),
    "block": Spec("block", "tp", lambda: zoo.TransformerBlock(256, 8, 1024), zoo.TP_BLOCK, (4, 64, 256)),
    "dp": Spec("dp", "dp", lambda: zoo.DeepMLP(256, 12), {}, (64, 256)),
}


def applies(model: str, contestant: str) -> bool:
    kind = SPECS[model].kind
    return not ((contestant == "expert" and kind == "dp") or (contestant == "ddp" and kind == "tp"))


# ------------------------------------------------------------ byte counting

class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------ contestants

def _expert_attention_forward(self, x):
    """zoo.Attention's forward as a tensor-parallel trainer writes it: local heads, -1 widths."""
    b, s, d = x.shape
    hd = d // self.global_heads
    split = lambda t: t.view(b, s, -1, hd).transpose(1, 2)
    q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.wo(y.transpose(1, 2).reshape(b, s, -1))


def _expert(model: nn.Module, spec: Spec, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if spec.name == "mlp":
        return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    attn = model.attn
    attn.global_heads = attn.heads
    attn.forward = types.MethodType(_expert_attention_forward, attn)
    return parallelize_module(model, mesh, {
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
    })


class _DDPCounter:
    def __init__(self, n: int):
        self.n, self.bytes, self.count = n, 0.0, 0

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buf = bucket.buffer()
        self.bytes += bytes_per_rank(Kind.ALL_REDUCE, buf.numel() * buf.element_size(), self.n)
        self.count += 1
        return allreduce_hook(None, bucket)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run_one(spec: Spec, contestant: str, ref: nn.Module, ref_grads: dict, batches: list, mesh) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    rec = {"model": spec.name, "contestant": contestant, "world_size": n, "notes": []}
    torch._dynamo.reset()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base = copy.deepcopy(ref)
    ddp_counter = None
    loss_scale = 1.0
    if contestant in ("hca", "dtensor_eager", "dtensor_inductor"):
        io = Shard(0) if spec.kind == "dp" else None
        kw = {"inputs": io, "outputs": io} if io is not None else {}
        model = sharded(spec.plan, mesh=mesh, **kw)(base)
        run = model
        if contestant == "hca":
            run = torch.compile(model, backend="hca")
        elif contestant == "dtensor_inductor":
            run = torch.compile(model)
    elif contestant == "expert":
        model = run = _expert(base, spec, mesh)
    elif contestant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = run = DistributedDataParallel(base)
        ddp_counter = _DDPCounter(n)
        model.register_comm_hook(None, ddp_counter.hook)
        loss_scale = float(n)  # DDP averages over ranks; each rank's loss is a sum over its rows
    else:
        raise ValueError(f"unknown contestant {contestant!r}; choose from {', '.join(CONTESTANTS)}")
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def local(x):
        return x.chunk(n)[rank] if spec.kind == "dp" else x

    # The dispatch mode makes Dynamo run compiled frames eagerly, so for compiled
    # contestants it only watches the optimizer step (outside the graphs).
    compiled = contestant in ("hca", "dtensor_inductor")
    times, counted = [], []
    for step, x in enumerate(batches):
        counter = CollectiveCounter()
        around_graph = _Nothing() if compiled else counter
        t0 = time.perf_counter()
        with around_graph:
            out = run(local(x))
            loss = out.square().sum() * loss_scale
            loss.backward()
        if step == 0:
            names = dict(ref.named_parameters())
            rec["max_grad_rel_err"] = max(
                _rel(_full(p.grad), ref_grads[name]) for name, p in
                ((nm.removeprefix("module."), p) for nm, p in model.named_parameters()) if name in names
            )
        with counter:
            opt.step()
            opt.zero_grad()
        dt = time.perf_counter() - t0
        if step == 0:
            rec["compile_time_s"] = dt
        else:
            times.append(dt)
        counted.append((counter.wire_bytes, sum(counter.counts.values())))
    rec["step_time_s"] = statistics.median(times) if times else None
    rec["peak_mem_bytes"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    # Bytes per step: from a steady step (the last one), not the first.
    b, c = counted[-1]
    if contestant == "hca":
        cols = report(run).collectives
        b += sum(col.wire_bytes for col in cols)
        c += len(cols)
        rec["notes"].append("bytes: hca.report collectives (forward+backward graphs) + dispatch-mode count of the optimizer step")
    elif contestant == "dtensor_inductor":
        b, c = None, None
        rec["notes"].append("bytes: n/a, collectives run inside Inductor's graph where the dispatch mode cannot see them")
    elif contestant == "ddp":
        b, c = ddp_counter.bytes / len(batches), ddp_counter.count / len(batches)
        rec["notes"].append("bytes: DDP comm hook, bucket buffer sizes as ring all-reduce, averaged over all steps "
                            "(DDP rebuilds its buckets after the first step, hence fractional collectives)")
    elif contestant == "dtensor_eager":
        rec["notes"].append("bytes: dispatch-mode count, a LOWER BOUND: the mode misses collectives DTensor issues "
                            "inside its own dispatch (here the backward reductions; gradients match, so they ran)")
    rec["bytes_per_step"], rec["collectives"] = b, c
    return rec


def _analytic_min(spec: Spec, ref: nn.Module, n: int) -> tuple[float, str]:
    if spec.kind == "dp":
        payload = sum(p.numel() * p.element_size() for p in ref.parameters())
        return bytes_per_rank(Kind.ALL_REDUCE, payload, n), "one all-reduce of all gradients"
    out = torch.Size(spec.input_shape).numel() * 4
    if spec.name == "mlp":
        # The input takes no gradient and nothing upstream has parameters:
        # backward needs no collective (the brief's 'one in backward' would be 2 x).
        return bytes_per_rank(Kind.ALL_REDUCE, out, n), "1 all-reduce of the output (fwd); bwd needs none: input has no grad"
    # attention and MLP sub-blocks: one all-reduce each in forward, one each in backward
    # (the layer-norm weights upstream need the input gradient).
    return 4 * bytes_per_rank(Kind.ALL_REDUCE, out, n), "2 sub-blocks x (1 fwd + 1 bwd) all-reduce of [b,s,d]"


def run_rank(models: list, contestants: list, steps: int) -> list:
    mesh = init_mesh()
    n = dist.get_world_size()
    records = []
    for name in models:
        spec = SPECS[name]
        torch.manual_seed(0)
        ref = spec.build()
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randn(spec.input_shape, generator=gen) for _ in range(steps + 1)]
        ref_copy = copy.deepcopy(ref)
        ref_copy(batches[0]).square().sum().backward()
        ref_grads = {k: p.grad.clone() for k, p in ref_copy.named_parameters()}
        amin, why = _analytic_min(spec, ref, n)
        for c in contestants:
            if not applies(name, c):
                continue
            try:
                rec = _run_one(spec, c, ref, ref_grads, batches, mesh)
            except Exception as e:  # noqa: BLE001 - a contestant that fails is reported, not fatal
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                rec = {"model": name, "contestant": c, "world_size": n, "failed": msg,
                       "bytes_per_step": None, "collectives": None, "step_time_s": None,
                       "compile_time_s": None, "peak_mem_bytes": None, "max_grad_rel_err": None,
                       "notes": [f"skipped: {msg}"]}
                dist.barrier()
            rec["analytic_min_bytes"], rec["analytic_min_why"] = amin, why
            records.append(rec)
    return records


# ------------------------------------------------------------ tables

def _merge(per_rank: list) -> list:
    """Rank 0's records, with the worst error, memory and time over the ranks."""
    merged = []
    for i, rec in enumerate(per_rank[0]):
        rec = dict(rec)
        for key, agg in (("max_grad_rel_err", max), ("peak_mem_bytes", max), ("step_time_s", max), ("compile_time_s", max)):
            vals = [r[i][key] for r in per_rank if r[i].get(key) is not None]
            rec[key] = agg(vals) if vals else None
        merged.append(rec)
    return merged


def _fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def tables(records: list) -> str:
    lines = []
    foot: list[str] = []

    def mark(text: str) -> str:
        if text not in foot:
            foot.append(text)
        return f"[{foot.index(text) + 1}]"

    head = ("contestant", "bytes/step", "x min", "coll/step", "step ms", "hca/this", "compile s", "peak mem", "grad rel err")
    for model in dict.fromkeys(r["model"] for r in records):
        rows = [r for r in records if r["model"] == model]
        hca_t = next((r["step_time_s"] for r in rows if r["contestant"] == "hca"), None)
        amin = rows[0]["analytic_min_bytes"]
        lines.append(f"== {model} (world size {rows[0]['world_size']}; analytic minimum {_fmt_bytes(amin)}/step/rank: "
                     f"{rows[0]['analytic_min_why']}) ==")
        table = [head]
        for r in rows:
            if r.get("failed"):
                na = "n/a " + mark(f"{model}/{r['contestant']} failed: {r['failed']}")
                table.append((r["contestant"],) + (na,) * (len(head) - 1))
                continue
            b, c, t = r["bytes_per_step"], r["collectives"], r["step_time_s"]
            bm = "" if b is not None else " " + mark("bytes n/a: " + "; ".join(n for n in r["notes"] if "bytes" in n))
            note = [n for n in r["notes"] if n.startswith("bytes:") and b is not None]
            btxt = _fmt_bytes(b) + (" " + mark(note[0]) if note and r["contestant"] in ("hca", "ddp", "dtensor_eager") else "") + bm
            table.append((
                r["contestant"], btxt,
                f"{b / amin:.2f}" if b is not None and amin else "n/a",
                f"{c:g}" if c is not None else "n/a",
                f"{1e3 * t:.2f}" if t is not None else "n/a",
                f"{hca_t / t:.2f}" if t and hca_t else "n/a",
                f"{r['compile_time_s']:.2f}",
                _fmt_bytes(r["peak_mem_bytes"]) + " " + mark(
                    "peak mem: growth of the process's ru_maxrss (peak RSS) during this contestant, max over ranks; "
                    "contestants run one after another in one process, so a later one that stays under an "
                    "earlier peak shows 0: a lower bound, not its footprint"),
                f"{r['max_grad_rel_err']:.1e}" if r["max_grad_rel_err"] is not None else "n/a",
            ))
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines += ["  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(row, widths))) for row in table]
        lines.append("")
    lines.append("step ms: median of the timed steps (after 1 warm-up step), forward + backward + SGD step, slowest rank; "
                 "hca/this: hca's step time over this contestant's (< 1: hca is faster); compile s: the first step; "
                 "grad rel err: max over parameters of |g - g_ref| / |g_ref| at the first step vs a single-device run.")
    lines += [f"[{i + 1}] {t}" for i, t in enumerate(foot)]
    return "\n".join(lines)


def main(world_size: int = 2, steps: int = 5, models=MODELS, contestants=CONTESTANTS, json_path=None) -> int:
    models, contestants = list(models), list(contestants)
    for m in models:
        if m not in SPECS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for c in contestants:
        if c not in CONTESTANTS:
            raise SystemExit(f"unknown contestant {c!r}; choose from {', '.join(CONTESTANTS)}")
    if steps < 1:
        raise SystemExit("--steps must be >= 1")
    print(f"torch_hca bench: {', '.join(models)} x {', '.join(contestants)} on {world_size} local gloo ranks, "
          f"{steps} timed steps after 1 warm-up\n", flush=True)
    records = _merge(launch(run_rank, world_size, models, contestants, steps, timeout_s=1800.0))
    print(tables(records))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=2)
        print(f"\nwrote {len(records)} records to {os.path.abspath(json_path)}")
    return 0
