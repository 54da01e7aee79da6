"""`python -m torch_hca bench`: hca next to other ways of training the same model.

Every contestant trains an identical copy of the same model (same initial
weights) on the same batches for the same steps (forward, backward, SGD
step), on local gloo ranks, one contestant after another in one run:

- ``hca``: ``torch.compile(model, backend="hca")`` on the ``hca.sharded`` model;
- ``hca_noschedule``: the same with ``options={"schedule": False}`` (the
  traced order, no overlap or bucketing), on the data-parallel and FSDP models;
- the layouts hca could have chosen instead, each compiled by hca (`ALTERNATIVES`;
  ``regret`` is hca's step time over the fastest of them):
  ``hca_dtensor_layout`` (``options={"layout": "dtensor"}``: DTensor's per-op
  choices on the same storage) and ``hca_dp`` (the model replicated and the batch
  split, ``hca.sharded({}, inputs=Shard(0), outputs=Shard(0))``; not on the
  data-parallel model, whose hca contestant is exactly that);
- ``dtensor_eager``: the same ``hca.sharded`` DTensor model, not compiled;
- ``dtensor_inductor``: the same DTensor model under plain ``torch.compile`` (Inductor);
- ``expert`` (tensor-parallel models): ``parallelize_module`` with
  ColwiseParallel / RowwiseParallel, and SequenceParallel for the norms of the
  block and the LM, as production trainers write it;
- ``ddp`` (data-parallel model): ``DistributedDataParallel`` on the plain module;
- ``fsdp2`` (FSDP model): ``torch.distributed.fsdp.fully_shard`` per layer and at the root.

Bytes, collectives and peak memory come from one profiled step
(`torch_hca.step_profile`), counted the same way for every contestant.
Contestants are built and take their first step one after another, then
take their timed steps in ``rounds`` round-robin rounds (``--rounds``), so a
burst of load on a shared machine falls on all of them alike.
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
from torch.profiler import ProfilerActivity, profile, record_function

from . import zoo
from ._torch_private import ddp_bucket_bytes
from .calibrate import cached_calibrate
from .spmd.collective_kinds import Kind, bytes_per_rank
from .launch import launch
from .mesh import init_mesh
from .plan import sharded, trace_over_dtensor
from .progress import Progress
from .report import report
from .step_profile import StepProfile

CONTESTANTS = ("hca", "hca_noschedule", "hca_dtensor_layout", "hca_dp", "dtensor_eager", "dtensor_inductor",
               "expert", "ddp", "fsdp2")
MODELS = ("mlp", "block", "lm", "dp", "fsdp")
LR = 1e-3
# The other layouts hca could have chosen, each compiled by hca: `regret` is hca's step over the
# fastest. The expert plans' storage is hca's plan on every tensor-parallel model (a test checks),
# so "the expert storage under layout='dtensor'" is hca_dtensor_layout, not another contestant.
ALTERNATIVES = ("hca_dtensor_layout", "hca_dp")
# hca's contestants: (storage plan or None for the spec's, batch split, backend options).
_HCA = {
    "hca": (None, None, {}),
    "hca_noschedule": (None, None, {"schedule": False}),
    "hca_dtensor_layout": (None, None, {"layout": "dtensor"}),
    "hca_dp": ({}, True, {}),
}
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
    # The full batch's loss from the losses of its row shards: "sum" (their sum),
    # "mean" (their mean, equal shards), or None (a batch split is not the same training).
    split_loss: str | None = "sum"

    def rows(self) -> int:
        return self.batch(torch.Generator().manual_seed(0)).shape[0]


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
                      _randn(max(bs // 2, 2), seq, d)),  # at least 2 rows: hca_dp splits them
        "lm": Spec("lm", "tp", lambda: zoo.TinyLM(**lm), zoo.TP_LM,
                   lambda g: torch.randint(0, lm["vocab"], (bs, seq), generator=g), zoo.lm_loss, "mean"),
        # Enough rows that data parallelism beats gathering the batch and replicating the
        # work (with few rows the layout solver would rather gather: docs/layout.md).
        "dp": Spec("dp", "dp", lambda: zoo.DeepMLP(d, 12), {}, _randn(16 * b, d)),
        # A batch larger than a layer's weights, so gathering the weights (FSDP) is the
        # cheaper layout; with fewer rows the layout solver gathers activations instead.
        "fsdp": Spec("fsdp", "fsdp", lambda: zoo.DeepMLP(d, 12), zoo.FSDP_PLAN, _randn(16 * b, d)),
    }


def applies(spec: Spec, contestant: str, world_size: int = 2) -> bool:
    if contestant in _EXPERT.values():
        return _EXPERT[spec.kind] == contestant
    if contestant == "hca_dp":  # on the data-parallel model it is the hca contestant itself
        return spec.kind != "dp" and spec.split_loss is not None and spec.rows() % world_size == 0
    return contestant != "hca_noschedule" or spec.kind in _SCHEDULE_KINDS


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

@dataclass(frozen=True)
class Built:
    model: nn.Module  # whose parameters train
    run: Callable  # what runs the forward
    scale: float  # the loss scale that trains the same thing as one device on the full batch
    split: bool  # whether each rank gets its rows of the batch


def _build(spec: Spec, contestant: str, ref: nn.Module, mesh, costs: dict) -> Built:
    base, n = copy.deepcopy(ref), mesh.size()
    if contestant in _HCA or contestant in ("dtensor_eager", "dtensor_inductor"):
        plan, split, options = _HCA.get(contestant, (None, None, {}))
        split = spec.kind != "tp" if split is None else split
        io = Shard(0) if split else Replicate()
        model = sharded(spec.plan if plan is None else plan, mesh=mesh, inputs=io, outputs=io)(base)
        if contestant == "dtensor_inductor":
            run = torch.compile(trace_over_dtensor(model))
        elif contestant == "dtensor_eager":
            run = model
        else:
            run = torch.compile(model, backend="hca", options={**options, **({"cost_model": costs} if costs else {})})
        # Each rank's loss covers its rows; hca sums the ranks' gradients.
        return Built(model, run, 1.0 / n if split and spec.split_loss == "mean" else 1.0, split)
    if contestant == "expert":
        model = _expert(base, spec, mesh)
        return Built(model, model, 1.0, False)
    # DDP and FSDP2 average gradients over ranks; each rank's loss sums its rows.
    if contestant == "ddp":
        model = nn.parallel.DistributedDataParallel(base)
        return Built(model, model, float(n), True)
    if contestant == "fsdp2":
        model = _fsdp2(base, mesh)
        return Built(model, model, float(n), True)
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


class Contestant:
    """One contestant on one model: built, first step (compile, gradient check), timed
    steps in rounds, then the profiled step(s); `rec` collects what each part measures."""

    def __init__(self, spec: Spec, name: str, ref: nn.Module, mesh, costs: dict):
        n, rank = mesh.size(), dist.get_rank()
        self.spec, self.mesh = spec, mesh
        self.rec = {"model": spec.name, "contestant": name, "world_size": n, "notes": []}
        self.built = _build(spec, name, ref, mesh, costs)
        self.opt = torch.optim.SGD(self.built.model.parameters(), lr=LR)
        self.local = (lambda x: x.chunk(n)[rank]) if self.built.split else (lambda x: x)
        self.times: list[float] = []

    def step(self, x: torch.Tensor, ref_grads: dict | None = None) -> None:
        x = self.local(x)
        self.spec.loss(self.built.run(x), x).mul(self.built.scale).backward()
        if ref_grads is not None:
            self.rec["max_grad_rel_err"] = _grad_err(self.built.model, ref_grads)
        self.opt.step()
        self.opt.zero_grad()

    def first(self, x: torch.Tensor, ref_grads: dict) -> None:
        t0 = time.perf_counter()
        self.step(x, ref_grads)
        self.rec["first_step_s"] = time.perf_counter() - t0

    def timed(self, batches: list) -> None:
        """One round: each step starts after a barrier."""
        times = []
        for x in batches:
            dist.barrier()
            t0 = time.perf_counter()
            self.step(x)
            times.append(time.perf_counter() - t0)
        self.times += times
        self.rec.setdefault("round_step_times_s", []).append(statistics.median(times))

    def finish(self, x: torch.Tensor, trace_path: str | None) -> dict:
        rec = self.rec
        rec["step_time_s"], rec["step_times_s"] = statistics.median(self.times), self.times
        rec["compile_time_s"] = max(rec["first_step_s"] - rec["step_time_s"], 0.0)
        dist.barrier()
        cuda = self.mesh.device_type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with StepProfile(rec["world_size"]) as prof:
            self.step(x)
        peak = torch.cuda.max_memory_allocated() if cuda else _resident_bytes(self.built.model) + prof.peak_alloc_bytes
        rec.update(bytes_per_step=prof.wire_bytes, collectives=prof.collectives, collectives_by_kind=prof.by_kind,
                   peak_mem_bytes=peak)
        rec["notes"] += list(dict.fromkeys(prof.notes)) + [f"uncounted bytes of {k} x{v}" for k, v in prof.unknown.items()]
        if trace_path:
            dist.barrier()
            rec["profile"] = traced_step(lambda: self.step(x), trace_path)
        if rec["contestant"].startswith("hca"):
            rec.update(_hca_extras(self.built.run))
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


# ------------------------------------------------------------ where the step time goes (--profile)

STEP_MARKER = "torch_hca.bench.step"
BREAKDOWN = ("compute", "collectives", "bucket_copies", "other")
_COLLECTIVE_NS = ("c10d::", "_c10d_functional::", "c10d_functional::")
_OP_NS = ("aten::", "fsdp::", *_COLLECTIVE_NS)
# Copies that fill or empty a communication buffer when they sit next to a collective.
_COPY_OPS = frozenset({
    "aten::cat", "aten::_chunk_cat", "aten::split", "aten::split_with_sizes", "aten::split_with_sizes_copy",
    "aten::copy_", "aten::_foreach_copy_", "aten::chunk", "aten::unbind", "aten::clone",
    "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy",
})
_VIEW_OPS = frozenset({"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::flatten", "aten::as_strided",
                       "aten::narrow", "aten::slice", "aten::select", "aten::detach", "aten::alias", "aten::t"})
# Regions whose every op is bucket work: DDP's copies into and out of its buckets, FSDP2's copy-in/out.
_BUCKET_REGIONS = ("reducer::", "copy_in", "copy_out")


def traced_step(step: Callable[[], None], path: str) -> dict[str, float]:
    """Run `step` under torch.profiler, write its Chrome trace to `path`, return `step_breakdown`."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(STEP_MARKER):
            step()
    prof.export_chrome_trace(path)
    with open(path) as f:
        return step_breakdown(json.load(f))


def _tree(events: list) -> list:
    """Nest complete events by time: [(event, children)], the roots in time order."""
    roots: list = []
    stack: list = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
            stack.pop()
        node = (e, [])
        (stack[-1][1] if stack else roots).append(node)
        stack.append(node)
    return roots


def _bucket_copies(siblings: list) -> set:
    """Copy ops in a run (views allowed) that touches a collective among `siblings`."""
    names = [e["name"] for e, _ in siblings]
    found = set()
    for i, name in enumerate(names):
        if not name.startswith(_COLLECTIVE_NS):
            continue
        for way in (range(i - 1, -1, -1), range(i + 1, len(names))):
            for j in way:
                if names[j] not in _COPY_OPS and names[j] not in _VIEW_OPS:
                    break
                found.add(j)
    return found


def _claim(siblings: list, totals: dict) -> None:
    """Add each event's time to its kind; what no op claims is left for `other`."""
    copies = _bucket_copies(siblings)
    for i, (e, children) in enumerate(siblings):
        name = e["name"]
        if name.startswith(_COLLECTIVE_NS):
            totals["collectives"] += e["dur"]
        elif i in copies or any(r in name for r in _BUCKET_REGIONS):
            totals["bucket_copies"] += e["dur"]
        else:
            # An op dispatched to a tensor subclass in Python (DTensor) is not compute itself.
            op = name.startswith(_OP_NS) and not any(c["name"] == "PythonSubclass" for c, _ in children)
            if op:
                totals["compute"] += e["dur"] - sum(c["dur"] for c, _ in children)
            _claim(children, totals)


def step_breakdown(trace: dict, marker: str = STEP_MARKER) -> dict[str, float]:
    """Seconds of the step marked `marker` in a Chrome trace, on the thread that ran it:

    compute        aten ops' own time (not their nested ops')
    collectives    c10d and functional-collective ops, waits included, with what they call
    bucket_copies  cat / split / copy_ next to a collective, DDP's and FSDP2's bucket regions
    other          the rest: Python, FX interpretation, Dynamo guards, autograd, and kernels
                   the profiler does not see as ops (Inductor's generated C++)
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    step = max((e for e in events if e["name"] == marker), key=lambda e: e["dur"])
    end = step["ts"] + step["dur"]
    inside = [e for e in events if e is not step and e["tid"] == step["tid"] and e["pid"] == step["pid"]
              and step["ts"] <= e["ts"] < end]
    totals = dict.fromkeys(BREAKDOWN, 0.0)
    _claim(_tree(inside), totals)
    totals["other"] = max(step["dur"] - sum(totals.values()), 0.0)
    return {"step_s": step["dur"] * 1e-6, **{f"{k}_s": v * 1e-6 for k, v in totals.items()}}


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


@dataclass(frozen=True)
class RunConfig:
    steps: int = 5  # timed steps per round
    tiny: bool = False
    calibrate: bool = False  # hca's cost model from hca.calibrate(cache=True): cached, else measured
    recalibrate: bool = False  # measure it even when cached (implies calibrate)
    rounds: int = 1  # round-robin rounds of `steps` timed steps per contestant
    profile_dir: str | None = None  # write a Chrome trace of one more step per contestant and rank


_FAILED_KEYS = ("bytes_per_step", "collectives", "step_time_s", "compile_time_s", "peak_mem_bytes", "max_grad_rel_err")


def _fail(rec: dict, e: BaseException, progress: Progress) -> None:
    """Make `rec` a failed row; the other ranks failed the same way (every rank runs the same program)."""
    msg = _failure(e)
    progress(f"{rec['model']}: {rec['contestant']} failed: {msg[:80]}")
    rec.update(failed=msg, **dict.fromkeys(_FAILED_KEYS))
    rec["notes"].append(f"failed: {msg}")
    dist.barrier()


def _reference(spec: Spec, batches_needed: int) -> tuple[nn.Module, dict, list]:
    """The model (seed 0), the batches (seed 1), and a single device's gradients on the first batch."""
    torch.manual_seed(0)
    ref = spec.build()
    gen = torch.Generator().manual_seed(1)
    batches = [spec.batch(gen) for _ in range(batches_needed)]
    ref_copy = copy.deepcopy(ref)
    spec.loss(ref_copy(batches[0]), batches[0]).backward()
    return ref, {k: p.grad.clone() for k, p in ref_copy.named_parameters()}, batches


def _run_model(spec: Spec, contestants: list, cfg: RunConfig, mesh, costs: dict, progress: Progress) -> list:
    n, rank = dist.get_world_size(), dist.get_rank()
    progress(f"{spec.name}: single-device reference ...")
    ref, ref_grads, batches = _reference(spec, cfg.steps + 2)  # first step, timed steps, profiled step
    amin, why = _analytic_min(spec, ref, batches[0], n)
    records, live = [], []
    torch._dynamo.reset()
    for c in (c for c in contestants if applies(spec, c, n)):
        progress(f"{spec.name}: {c} ...")
        rec = {"model": spec.name, "contestant": c, "world_size": n, "notes": []}
        try:
            entry = Contestant(spec, c, ref, mesh, costs)
            rec = entry.rec
            entry.first(batches[0], ref_grads)
            live.append(entry)
        except Exception as e:  # noqa: BLE001 - a contestant that fails is reported, not fatal
            _fail(rec, e, progress)
        rec["analytic_min_bytes"], rec["analytic_min_why"] = amin, why
        records.append(rec)
    for r in range(cfg.rounds):
        if cfg.rounds > 1:
            progress(f"{spec.name}: timed round {r + 1}/{cfg.rounds}")
        for entry in list(live):
            try:
                entry.timed(batches[1:-1])
            except Exception as e:  # noqa: BLE001
                live.remove(entry)
                _fail(entry.rec, e, progress)
    for entry in live:
        c = entry.rec["contestant"]
        path = os.path.join(cfg.profile_dir, f"{spec.name}_{c}_rank{rank}.json") if cfg.profile_dir else None
        try:
            entry.finish(batches[-1], path)
        except Exception as e:  # noqa: BLE001
            _fail(entry.rec, e, progress)
    return records


def run_rank(models: list, contestants: list, cfg: RunConfig, since: float | None = None) -> list:
    mesh = init_mesh()
    progress = Progress("bench", since, enabled=dist.get_rank() == 0)
    # hca's cost model in this run: rank 0's calibrated figures (cached or measured), or {} for the defaults.
    costs, source = {}, "defaults"
    if cfg.calibrate or cfg.recalibrate:
        progress("calibrating the cost model on the ranks ..." if cfg.recalibrate else
                 "cost model: the cached calibration, else calibrating on the ranks ...")
        costs, cached = cached_calibrate(refresh=cfg.recalibrate)
        source = "cached" if cached else "measured"
    records = []
    # Contestants of one model live side by side: each compiles into its own cache entry
    # (the backend is part of the guard). Shapes stay static as in a fresh process: hca_dp's
    # half batch must not make Dynamo recompile the other contestants with dynamic shapes.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=4 * len(CONTESTANTS)):
        for name in models:
            for rec in _run_model(specs(cfg.tiny)[name], contestants, cfg, mesh, costs, progress):
                if rec["contestant"].startswith("hca"):
                    rec["cost_model"], rec["cost_model_source"] = dict(costs) or "defaults", source
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
                r.update(_regret(r, rows))
    return merged


def _regret(hca: dict, rows: list) -> dict:
    """hca's step time over the fastest of the other layouts it could have chosen (> 1: one was faster)."""
    alts = {r["contestant"]: r["step_time_s"] for r in rows if r["contestant"] in ALTERNATIVES and r["step_time_s"]}
    if not hca["step_time_s"] or not alts:
        return {"regret": None, "regret_vs": None, "regret_alternatives_s": alts}
    best = min(alts, key=alts.get)
    return {"regret": hca["step_time_s"] / alts[best], "regret_vs": best, "regret_alternatives_s": alts}


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


def _regret_line(rows: list) -> list[str]:
    hca = next((r for r in rows if r["contestant"] == "hca"), None)
    if hca is None or hca.get("regret") is None:
        return []
    alts = ", ".join(f"{c} {1e3 * t:.2f}" for c, t in hca["regret_alternatives_s"].items())
    return [f"regret {hca['regret']:.2f}: hca {1e3 * hca['step_time_s']:.2f} ms / {hca['regret_vs']} "
            f"{1e3 * hca['regret_alternatives_s'][hca['regret_vs']]:.2f} ms, the fastest other layout "
            f"(ms: {alts}); above 1, a layout hca could have chosen was faster"]


def _profile_table(records: list) -> list[str]:
    """Where each contestant's profiled step went (rank 0's trace)."""
    rows = [r for r in records if r.get("profile")]
    if not rows:
        return []
    table = [("model", "contestant", "step ms", "compute", "collectives", "bucket copies", "other")]
    for r in rows:
        p = r["profile"]
        share = lambda k: f"{1e3 * p[k + '_s']:.2f} ({100 * p[k + '_s'] / p['step_s']:.0f}%)" if p["step_s"] else "n/a"
        table.append((r["model"], r["contestant"], f"{1e3 * p['step_s']:.2f}", *(share(k) for k in BREAKDOWN)))
    return ["== where the step time goes: one more profiled step, rank 0 (ms, share of the step); "
            "other = Python, FX, Dynamo, autograd, Inductor's C++ kernels ==", *_aligned(table), ""]


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
    "step ms: median of the timed steps of every round (after 1 warm-up step), forward + backward + SGD step, "
    "each step started after a barrier, slowest rank's median; with --rounds K the contestants take turns, "
    "--steps steps each, K times; hca/this: hca's step time over this contestant's "
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
    "regret: hca's step ms over the fastest of the other layouts hca could have chosen, each compiled by hca "
    "(hca_dtensor_layout: DTensor's per-op choices on the same storage; hca_dp: replicated, batch split); "
    "the expert plans' storage is hca's plan here, so it adds no contestant.",
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
        lines += _aligned([_HEAD] + [_row(r, amin, mark) for r in rows]) + _fewest_bytes(rows) + _regret_line(rows)
        lines.append("")
    lines += _schedule_table(records) + _profile_table(records)
    lines += [f"[{i + 1}] {t}" for i, t in enumerate(FOOTNOTES + foot)]
    return "\n".join(lines)


def main(world_size: int = 2, steps: int = 5, models=MODELS, contestants=CONTESTANTS, json_path=None,
         tiny: bool = False, calibrate: bool = False, *, recalibrate: bool = False, rounds: int = 1,
         profile_dir: str | None = None) -> int:
    models, contestants = list(models), list(contestants)
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for c in contestants:
        if c not in CONTESTANTS:
            raise SystemExit(f"unknown contestant {c!r}; choose from {', '.join(CONTESTANTS)}")
    if steps < 1:
        raise SystemExit("--steps must be >= 1")
    if rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
    timed = f"{steps} timed" + (f" x {rounds} rounds" if rounds > 1 else "")
    print(f"torch_hca bench: {', '.join(models)} x {', '.join(contestants)} on {world_size} local gloo ranks, "
          f"{'tiny models, ' if tiny else ''}1 warm-up + {timed} + {2 if profile_dir else 1} profiled step(s)\n",
          flush=True)
    cfg = RunConfig(steps, tiny, calibrate, recalibrate, rounds, os.path.abspath(profile_dir) if profile_dir else None)
    progress = Progress("bench")  # one line per model and contestant, on stderr
    progress(f"starting {world_size} local gloo ranks")
    records = _merge(launch(run_rank, world_size, models, contestants, cfg, progress.since, timeout_s=1800.0))
    progress(f"done: {len(records)} records")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=2)
    print(tables(records))
    if json_path:
        print(f"\nwrote {len(records)} records to {os.path.abspath(json_path)}")
    if profile_dir:
        print(f"wrote Chrome traces ({{model}}_{{contestant}}_rank{{r}}.json) to {os.path.abspath(profile_dir)}")
    return 0
