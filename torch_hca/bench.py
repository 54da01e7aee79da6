"""`python -m torch_hca bench`: hca next to other ways of training the same model.

Every contestant trains an identical copy of the same model (same initial
weights) on the same batches for the same steps (forward, backward, SGD
step), on local gloo ranks, one contestant after another in one run:

- ``hca``: ``torch.compile(model, backend="hca")`` on the ``hca.sharded`` model;
- ``hca_noschedule``: the same with ``options={"schedule": False}`` (the
  traced order, no overlap or bucketing), on the data-parallel and FSDP models;
- ``dtensor_eager``: the same ``hca.sharded`` DTensor model, not compiled;
- ``dtensor_inductor``: the same DTensor model under plain ``torch.compile`` (Inductor);
- ``expert`` (tensor-parallel models): ``parallelize_module`` with
  ColwiseParallel / RowwiseParallel, and SequenceParallel for the norms of the
  block and the LM, as production trainers write it;
- ``ddp`` (data-parallel model): ``DistributedDataParallel`` on the plain module;
- ``fsdp2`` (FSDP model): ``torch.distributed.fsdp.fully_shard`` per layer and at the root.

Bytes, collectives and peak memory come from one profiled step
(`torch_hca.step_profile`), counted the same way for every contestant.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import zoo
from ._torch_private import ddp_bucket_bytes
from .calibrate import calibrate as hca_calibrate
from .collective_kinds import Kind, bytes_per_rank
from .launch import launch
from .mesh import init_mesh
from .plan import sharded, trace_over_dtensor
from .report import report
from .step_profile import StepProfile

CONTESTANTS = ("hca", "hca_noschedule", "dtensor_eager", "dtensor_inductor", "expert", "ddp", "fsdp2")
MODELS = ("mlp", "block", "lm", "dp", "fsdp")
LR = 1e-3
# The contestant each kind of model is measured against by hand (besides DTensor).
_EXPERT = {"tp": "expert", "dp": "ddp", "fsdp": "fsdp2"}
_SCHEDULE_KINDS = ("dp", "fsdp")


def _square_loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # "tp", "dp" or "fsdp": the contestants that apply and the analytic minimum
    build: Callable[[], nn.Module]
    plan: dict
    batch: Callable[[torch.Generator], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _square_loss


def _randn(*shape):
    return lambda g: torch.randn(shape, generator=g)


def specs(tiny: bool = False) -> dict[str, Spec]:
    """The bench models: full size, or tiny ones for a smoke test."""
    d, h, b = (16, 32, 8) if tiny else (256, 1024, 32)
    lm = dict(vocab=64, dim=32, heads=4, hidden=64, layers=2) if tiny else \
        dict(vocab=512, dim=128, heads=4, hidden=512, layers=4)
    bs, seq = (2, 8) if tiny else (8, 64)
    return {
        "mlp": Spec("mlp", "tp", lambda: zoo.MLP(d, h), zoo.MEGATRON_MLP, _randn(b, d)),
        "block": Spec("block", "tp", lambda: zoo.TransformerBlock(d, 4 if tiny else 8, h), zoo.TP_BLOCK,
                      _randn(bs // 2, seq, d)),
        "lm": Spec("lm", "tp", lambda: zoo.TinyLM(**lm), zoo.TP_LM,
                   lambda g: torch.randint(0, lm["vocab"], (bs, seq), generator=g), zoo.lm_loss),
        # Enough rows that data parallelism beats gathering the batch and replicating the
        # work (with few rows the layout solver would rather gather: docs/layout.md).
        "dp": Spec("dp", "dp", lambda: zoo.DeepMLP(d, 12), {}, _randn(16 * b, d)),
        # A batch larger than a layer's weights, so gathering the weights (FSDP) is the
        # cheaper layout; with fewer rows the layout solver gathers activations instead.
        "fsdp": Spec("fsdp", "fsdp", lambda: zoo.DeepMLP(d, 12), zoo.FSDP_PLAN, _randn(16 * b, d)),
    }


def applies(kind: str, contestant: str) -> bool:
    if contestant in _EXPERT.values():
        return _EXPERT[kind] == contestant
    return contestant != "hca_noschedule" or kind in _SCHEDULE_KINDS


# ------------------------------------------------------------ expert plans

def _local_heads_forward(self, x):
    """zoo.Attention's forward as a tensor-parallel trainer writes it: local heads, -1 widths."""
    b, s, d = x.shape
    hd = d // self.global_heads
    split = lambda t: t.view(b, s, -1, hd).transpose(1, 2)
    q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.wo(y.transpose(1, 2).reshape(b, s, -1))


def _sequence_parallel_block(prefix: str) -> dict:
    """Megatron sequence parallel: norms on sequence shards, all-gather in, reduce-scatter out."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    # DTensors in (use_local_output=False, as torchtitan writes it): the q, k and v input
    # gradients then sum as one Partial and are reduce-scattered once.
    gather = lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        f"{prefix}norm1": SequenceParallel(), f"{prefix}attn": gather(),
        f"{prefix}attn.wq": ColwiseParallel(), f"{prefix}attn.wk": ColwiseParallel(),
        f"{prefix}attn.wv": ColwiseParallel(), f"{prefix}attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        f"{prefix}norm2": SequenceParallel(), f"{prefix}mlp": gather(),
        f"{prefix}mlp.fc1": ColwiseParallel(), f"{prefix}mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _expert(model: nn.Module, spec: Spec, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
        SequenceParallel, parallelize_module,
    )

    if spec.name == "mlp":
        return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    for m in model.modules():
        if isinstance(m, zoo.Attention):
            m.global_heads = m.heads
            m.forward = types.MethodType(_local_heads_forward, m)
    if spec.name == "block":  # replicated [b, s, d] in and out, sequence shards inside
        parallelize_module(model, mesh, PrepareModuleInputOutput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)))
        return parallelize_module(model, mesh, _sequence_parallel_block(""))
    return parallelize_module(model, mesh, {  # lm: embedding and head replicated, as TP_LM
        "embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        **_sequence_parallel_block("blocks.*."),
        "norm": SequenceParallel(),
        "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
    })


def _fsdp2(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# ------------------------------------------------------------ one contestant

def _build(spec: Spec, contestant: str, ref: nn.Module, mesh, costs: dict) -> tuple[nn.Module, Callable, float]:
    """(the module whose parameters train, what runs the forward, the loss scale)."""
    base = copy.deepcopy(ref)
    if contestant in ("hca", "hca_noschedule", "dtensor_eager", "dtensor_inductor"):
        io = Replicate() if spec.kind == "tp" else Shard(0)
        model = sharded(spec.plan, mesh=mesh, inputs=io, outputs=io)(base)
        options = {"cost_model": costs} if costs else {}
        compiled = {
            "hca": lambda: torch.compile(model, backend="hca", options=options),
            "hca_noschedule": lambda: torch.compile(model, backend="hca", options={"schedule": False, **options}),
            "dtensor_inductor": lambda: torch.compile(trace_over_dtensor(model)),
        }
        return model, compiled.get(contestant, lambda: model)(), 1.0
    if contestant == "expert":
        model = _expert(base, spec, mesh)
        return model, model, 1.0
    # DDP and FSDP2 average gradients over ranks; each rank's loss sums its rows.
    if contestant == "ddp":
        model = nn.parallel.DistributedDataParallel(base)
        return model, model, float(mesh.size())
    if contestant == "fsdp2":
        model = _fsdp2(base, mesh)
        return model, model, float(mesh.size())
    raise ValueError(f"unknown contestant {contestant!r}; choose from {', '.join(CONTESTANTS)}")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grad_err(model: nn.Module, ref_grads: dict) -> float:
    errs = [_rel(_full(p.grad), ref_grads[name.removeprefix("module.")]) for name, p in model.named_parameters()]
    return max(errs)


def _resident_bytes(model: nn.Module) -> int:
    """Bytes kept across steps: this rank's parameters (shards) and DDP's gradient buckets."""
    local = lambda p: p.to_local() if isinstance(p, DTensor) else p
    total = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    if isinstance(model, nn.parallel.DistributedDataParallel):
        total += ddp_bucket_bytes(model)
    return total


def _run_one(spec: Spec, contestant: str, ref: nn.Module, ref_grads: dict, batches: list, mesh, costs: dict) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    rec = {"model": spec.name, "contestant": contestant, "world_size": n, "notes": []}
    torch._dynamo.reset()
    model, run, scale = _build(spec, contestant, ref, mesh, costs)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    local = (lambda x: x) if spec.kind == "tp" else (lambda x: x.chunk(n)[rank])

    def step(x, check=False):
        spec.loss(run(local(x)), local(x)).mul(scale).backward()
        if check:
            rec["max_grad_rel_err"] = _grad_err(model, ref_grads)
        opt.step()
        opt.zero_grad()

    t0 = time.perf_counter()
    step(batches[0], check=True)
    first = time.perf_counter() - t0
    times = []
    for x in batches[1:-1]:
        dist.barrier()
        t0 = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - t0)
    rec["step_time_s"], rec["step_times_s"] = statistics.median(times), times
    rec["first_step_s"], rec["compile_time_s"] = first, max(first - rec["step_time_s"], 0.0)
    dist.barrier()
    cuda = mesh.device_type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with StepProfile(n) as prof:
        step(batches[-1])
    peak = torch.cuda.max_memory_allocated() if cuda else _resident_bytes(model) + prof.peak_alloc_bytes
    rec.update(bytes_per_step=prof.wire_bytes, collectives=prof.collectives, collectives_by_kind=prof.by_kind,
               peak_mem_bytes=peak)
    rec["notes"] += list(dict.fromkeys(prof.notes)) + [f"uncounted bytes of {k} x{v}" for k, v in prof.unknown.items()]
    if contestant.startswith("hca"):
        rec.update(_hca_extras(run))
    return rec


def _hca_extras(compiled) -> dict:
    """What hca's own report says: its graphs' collective bytes and, when the report
    has a timeline, the estimated exposed communication before and after scheduling."""
    rep = report(compiled)
    out = {"report_bytes_per_step": sum(c.wire_bytes for c in rep.collectives),
           "exposed_comm_est_s": None, "exposed_comm_est_unscheduled_s": None, "est_step_s": None}
    if hasattr(rep, "timeline"):
        tl = rep.timeline()
        out.update(exposed_comm_est_s=tl.after.exposed_comm_s, exposed_comm_est_unscheduled_s=tl.before.exposed_comm_s,
                   est_step_s=tl.after.total_s)
    return out


# ------------------------------------------------------------ analytic minimum

def _analytic_min(spec: Spec, ref: nn.Module, x: torch.Tensor, n: int) -> tuple[float, str]:
    params = sum(p.numel() * p.element_size() for p in ref.parameters())
    if spec.kind == "dp":
        return bytes_per_rank(Kind.ALL_REDUCE, params, n), "one all-reduce of all gradients"
    if spec.kind == "fsdp":
        return (bytes_per_rank(Kind.ALL_GATHER, params, n) + bytes_per_rank(Kind.REDUCE_SCATTER, params, n),
                "all-gather every parameter once + reduce-scatter every gradient")
    if spec.name == "mlp":
        # The input takes no gradient and nothing upstream has parameters: backward needs no collective.
        out = x.numel() * x.element_size()
        return (bytes_per_rank(Kind.ALL_REDUCE, out, n),
                "1 all-reduce of the output (fwd); bwd needs none: input has no grad")
    blocks = len(ref.blocks) if spec.name == "lm" else 1
    act = x.numel() * 4 * (ref.embed.embedding_dim if spec.name == "lm" else 1)
    # Per block: attention and MLP each one all-reduce of [b,s,d] forward and one backward
    # (the norms, and the embedding in the LM, upstream need the input gradient).
    return (4 * blocks * bytes_per_rank(Kind.ALL_REDUCE, act, n),
            f"{blocks} block(s) x 2 sub-blocks x (1 fwd + 1 bwd) all-reduce of [b,s,d] "
            "(or reduce-scatter + all-gather)")


def _failure(e: BaseException) -> str:
    """The exception and what it wraps (Dynamo's BackendCompilerFailed wraps the backend's error)."""
    chain = [e]
    while (inner := getattr(chain[-1], "inner_exception", None) or chain[-1].__cause__) is not None:
        chain.append(inner)
    told = next((x for x in chain[1:] if str(x).strip()), e)  # the first wrapped one with a message
    first = next(line.strip() for line in str(told).splitlines() if line.strip()) if str(told).strip() else ""
    names = " <- ".join(type(x).__name__ for x in chain)
    return f"{names}: {first}"[:400]


def run_rank(models: list, contestants: list, steps: int, tiny: bool, calibrate: bool = False) -> list:
    mesh = init_mesh()
    n = dist.get_world_size()
    # hca's cost model in this run: measured on these ranks (rank 0's figures), or {} for the defaults.
    costs = hca_calibrate() if calibrate else {}
    records = []
    for name in models:
        spec = specs(tiny)[name]
        torch.manual_seed(0)
        ref = spec.build()
        gen = torch.Generator().manual_seed(1)
        batches = [spec.batch(gen) for _ in range(steps + 2)]  # warm-up, timed steps, profiled step
        ref_copy = copy.deepcopy(ref)
        spec.loss(ref_copy(batches[0]), batches[0]).backward()
        ref_grads = {k: p.grad.clone() for k, p in ref_copy.named_parameters()}
        amin, why = _analytic_min(spec, ref, batches[0], n)
        for c in contestants:
            if not applies(spec.kind, c):
                continue
            try:
                rec = _run_one(spec, c, ref, ref_grads, batches, mesh, costs)
            except Exception as e:  # noqa: BLE001 - a contestant that fails is reported, not fatal
                msg = _failure(e)
                rec = {"model": name, "contestant": c, "world_size": n, "failed": msg, "notes": [f"failed: {msg}"],
                       **dict.fromkeys(("bytes_per_step", "collectives", "step_time_s", "compile_time_s",
                                        "peak_mem_bytes", "max_grad_rel_err"))}
                dist.barrier()
            rec["analytic_min_bytes"], rec["analytic_min_why"] = amin, why
            if c.startswith("hca"):
                rec["cost_model"] = dict(costs) or "defaults"
            records.append(rec)
    return records


# ------------------------------------------------------------ merging and tables

def _merge(per_rank: list) -> list:
    """Rank 0's records, with the worst error, memory and times over the ranks, and hca's step-time ratios."""
    merged = []
    for i, rec in enumerate(per_rank[0]):
        rec = dict(rec)
        for key in ("max_grad_rel_err", "peak_mem_bytes", "step_time_s", "compile_time_s", "first_step_s"):
            vals = [r[i][key] for r in per_rank if r[i].get(key) is not None]
            rec[key] = max(vals) if vals else None
        merged.append(rec)
    for model in dict.fromkeys(r["model"] for r in merged):
        rows = [r for r in merged if r["model"] == model]
        hca_t = next((r["step_time_s"] for r in rows if r["contestant"] == "hca"), None)
        for r in rows:
            t = r["step_time_s"]
            r["hca_step_time_ratio"] = hca_t / t if hca_t and t else None
        for r in rows:
            if r["contestant"] == "hca":
                r["step_time_ratio_vs"] = {o["contestant"]: o["hca_step_time_ratio"] for o in rows if o is not r}
    return merged


def _fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


_HEAD = ("contestant", "bytes/step", "x min", "coll/step", "step ms", "hca/this", "compile s", "peak mem",
         "grad rel err")


def _row(r: dict, amin: float, mark) -> tuple:
    if r.get("failed"):
        return (r["contestant"],) + ("n/a " + mark(f"{r['model']}/{r['contestant']} failed: {r['failed']}"),) * 8
    b = r["bytes_per_step"]
    extra = "".join(" " + mark(f"{r['model']}/{r['contestant']}: {note}") for note in r["notes"])
    return (
        r["contestant"], _fmt_bytes(b) + extra, _fmt(b / amin if amin else None, ".2f"), _fmt(r["collectives"], ".0f"),
        _fmt(r["step_time_s"], ".2f", 1e3), _fmt(r["hca_step_time_ratio"], ".2f"), _fmt(r["compile_time_s"], ".2f"),
        _fmt_bytes(r["peak_mem_bytes"]), _fmt(r["max_grad_rel_err"], ".1e"),
    )


def _aligned(table: list) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(row, widths))) for row in table]


def _fewest_bytes(rows: list) -> list[str]:
    """One line: are hca's bytes the fewest of the model's contestants?"""
    counted = [r for r in rows if r.get("bytes_per_step") is not None]
    hca = next((r for r in counted if r["contestant"] == "hca"), None)
    others = [r for r in counted if not r["contestant"].startswith("hca")]
    if hca is None or not others:
        return []
    best = min(others, key=lambda r: r["bytes_per_step"])
    verdict = "fewest" if hca["bytes_per_step"] <= best["bytes_per_step"] else "NOT the fewest"
    return [f"hca bytes/step {_fmt_bytes(hca['bytes_per_step'])}: {verdict} (best other: {best['contestant']}, "
            f"{_fmt_bytes(best['bytes_per_step'])})"]


def _schedule_table(records: list) -> list[str]:
    table = [("model", "exposed comm est. off -> on (ms)", "step ms off", "step ms on", "on/off")]
    for model in dict.fromkeys(r["model"] for r in records):
        on = next((r for r in records if r["model"] == model and r["contestant"] == "hca"), None)
        off = next((r for r in records if r["model"] == model and r["contestant"] == "hca_noschedule"), None)
        if on is None or off is None or on.get("failed") or off.get("failed"):
            continue
        est = off.get("exposed_comm_est_s"), on.get("exposed_comm_est_s")
        est_txt = "n/a (no timeline in this build)" if None in est else f"{1e3 * est[0]:.3f} -> {1e3 * est[1]:.3f}"
        ratio = on["step_time_s"] / off["step_time_s"] if on["step_time_s"] and off["step_time_s"] else None
        table.append((model, est_txt, _fmt(off["step_time_s"], ".2f", 1e3), _fmt(on["step_time_s"], ".2f", 1e3),
                      _fmt(ratio, ".2f")))
    if len(table) == 1:
        return []
    return ["== schedule on/off: hca (schedule=True) vs hca_noschedule (schedule=False) ==", *_aligned(table), ""]


FOOTNOTES = [
    "bytes/step: bytes one rank sends per training step (forward + backward + optimizer step) in a ring "
    "implementation of each logical collective (all-reduce 2(n-1)/n S, all-gather and reduce-scatter (n-1)/n S), "
    "read from the c10d ops (c10d::allreduce_, c10d::_allgather_base_, ...) of one profiled step after the timed "
    "ones: every contestant is counted the same way, compiled graphs, DDP buckets and FSDP2 included. gloo itself "
    "runs a reduce-scatter as a full all-reduce; that is not counted. All groups are taken to span the world.",
    "x min: bytes/step over the analytic minimum of the model's textbook strategy (in its header: Megatron "
    "activations for tensor parallel, gradients for data parallel, weights and gradients for FSDP). A contestant "
    "may run the same storage differently (hca's layout solver may gather small weights instead of reducing "
    "activations, or move activations instead of FSDP weights), so it can land above or below 1. "
    "coll/step: c10d collectives issued in that step, a coalesced one counted once.",
    "step ms: median of the timed steps (after 1 warm-up step), forward + backward + SGD step, each step "
    "started after a barrier, slowest rank's median; hca/this: hca's step time over this contestant's "
    "(< 1: hca is faster). compile s: first step minus the median step (for eager contestants, first-call "
    "set-up such as DDP's buckets or FSDP2's lazy init).",
    "peak mem: what lives across steps (this rank's parameters or parameter shards, and DDP's gradient buckets; "
    "SGD keeps no state) plus the highest running total of CPU allocator allocations minus frees during the "
    "profiled step (activations, gradients, communication buffers, Inductor's buffers: all go through the CPU "
    "allocator), max over ranks. Not counted: gloo's internal transport buffers and Python objects; frees of "
    "memory allocated before the step are not subtracted (so this errs high). A CUDA mesh would read "
    "torch.cuda.max_memory_allocated instead (not exercised: the bench runs on CPU gloo ranks).",
    "grad rel err: max over parameters of |g - g_ref| / |g_ref| after the first step vs a single-device run "
    "on the full batch.",
]


def tables(records: list) -> str:
    lines: list[str] = []
    foot: list[str] = []

    def mark(text: str) -> str:
        if text not in foot:
            foot.append(text)
        return f"[{len(FOOTNOTES) + foot.index(text) + 1}]"

    for model in dict.fromkeys(r["model"] for r in records):
        rows = [r for r in records if r["model"] == model]
        amin = rows[0]["analytic_min_bytes"]
        lines.append(f"== {model} (world size {rows[0]['world_size']}; analytic minimum {_fmt_bytes(amin)}/step/rank: "
                     f"{rows[0]['analytic_min_why']}) ==")
        lines += _aligned([_HEAD] + [_row(r, amin, mark) for r in rows]) + _fewest_bytes(rows) + [""]
    lines += _schedule_table(records)
    lines += [f"[{i + 1}] {t}" for i, t in enumerate(FOOTNOTES + foot)]
    return "\n".join(lines)


def main(world_size: int = 2, steps: int = 5, models=MODELS, contestants=CONTESTANTS, json_path=None,
         tiny: bool = False, calibrate: bool = False) -> int:
    models, contestants = list(models), list(contestants)
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for c in contestants:
        if c not in CONTESTANTS:
            raise SystemExit(f"unknown contestant {c!r}; choose from {', '.join(CONTESTANTS)}")
    if steps < 1:
        raise SystemExit("--steps must be >= 1")
    print(f"torch_hca bench: {', '.join(models)} x {', '.join(contestants)} on {world_size} local gloo ranks, "
          f"{'tiny models, ' if tiny else ''}1 warm-up + {steps} timed + 1 profiled step(s)\n", flush=True)
    records = _merge(launch(run_rank, world_size, models, contestants, steps, tiny, calibrate, timeout_s=1800.0))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=2)
    print(tables(records))
    if json_path:
        print(f"\nwrote {len(records)} records to {os.path.abspath(json_path)}")
    return 0
