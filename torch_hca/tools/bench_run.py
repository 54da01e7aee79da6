"""Running the bench on each rank: every contestant's first step (checked against a single
device), its timed steps in round-robin rounds, its profiled step(s); then the ranks'
records merged, with hca's step-time ratios and its regret over the other layouts."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch_private import clear_dtensor_sharding_cache, ddp_bucket_bytes, group_backend
from torch_hca.api.calibrate import cached_calibrate
from ..errors import HCAError
from ..spmd.collective_kinds import Kind, bytes_per_rank
from ..spmd.cost_model import DEFAULTS, backend_for, scatter_runs_as_all_reduce
from torch_hca.runtime.mesh import init_mesh
from torch_hca.report.compile_report import report
from .bench_models import ALTERNATIVES, CONTESTANTS, LR, Spec, analytic_min, applies, build, specs
from .bench_profile import traced_step
from .progress import Progress
from .step_profile import StepProfile


# ------------------------------------------------------------ one contestant, measured


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

    def __init__(
        self, spec: Spec, name: str, ref: nn.Module, mesh, costs: dict, hca_options: dict | None = None, builder=None
    ):
        n, rank = mesh.size(), dist.get_rank()
        self.spec, self.mesh = spec, mesh
        self.rec = {"model": spec.name, "contestant": name, "world_size": n, "notes": []}
        self.built = (builder or build)(spec, name, ref, mesh, costs, hca_options)
        if hca_options and name.startswith("hca"):
            self.rec["hca_options"] = dict(hca_options)
        self.opt = torch.optim.SGD(self.built.model.parameters(), lr=LR)
        self.local = (lambda x: x.chunk(n)[rank]) if self.built.split else (lambda x: x)
        self.times: list[float] = []
        self.optimizer_times: list[float] = []

    def step(self, x: torch.Tensor, ref_grads: dict | None = None) -> float:
        """One training step; returns the seconds its optimizer step took (the part no compiler sees)."""
        x = self.local(x)
        out = self.built.run(x)
        (out if self.built.loss_inside else self.spec.loss(out, x)).mul(self.built.scale).backward()
        if ref_grads is not None:
            self.rec["max_grad_rel_err"] = _grad_err(self.built.model, ref_grads)
        t0 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0

    def first(self, x: torch.Tensor, ref_grads: dict) -> None:
        # DTensor's sharding cache keeps a sharded embedding's mask from the last contestant's
        # run (real or fake); a compile that meets another's mask fails (fake_dtensor_work).
        clear_dtensor_sharding_cache()
        t0 = time.perf_counter()
        self.step(x, ref_grads)
        self.rec["first_step_s"] = time.perf_counter() - t0

    def warm(self, x: torch.Tensor) -> float:
        """One untimed step after the first (compile); returns its seconds, the slowest rank's."""
        dist.barrier()
        t0 = time.perf_counter()
        self.step(x)
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return took.item()

    def timed(self, batches: list) -> None:
        """One round: each step starts after a barrier."""
        times = []
        for x in batches:
            dist.barrier()
            t0 = time.perf_counter()
            self.optimizer_times.append(self.step(x))
            times.append(time.perf_counter() - t0)
        self.times += times
        self.rec.setdefault("round_step_times_s", []).append(statistics.median(times))

    def finish(self, x: torch.Tensor, trace_path: str | None) -> dict:
        rec = self.rec
        rec["step_time_s"], rec["step_times_s"] = statistics.median(self.times), self.times
        rec["optimizer_time_s"] = statistics.median(self.optimizer_times)
        rec["compile_time_s"] = max(rec["first_step_s"] - rec["step_time_s"], 0.0)
        dist.barrier()
        cuda = self.mesh.device_type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with StepProfile(rec["world_size"]) as prof:
            self.step(x)
        peak = torch.cuda.max_memory_allocated() if cuda else _resident_bytes(self.built.model) + prof.peak_alloc_bytes
        rec.update(
            bytes_per_step=prof.wire_bytes,
            collectives=prof.collectives,
            collectives_by_kind=prof.by_kind,
            peak_mem_bytes=peak,
        )
        rec["notes"] += list(dict.fromkeys(prof.notes)) + [
            f"uncounted bytes of {k} x{v}" for k, v in prof.unknown.items()
        ]
        if trace_path:
            dist.barrier()
            rec["profile"] = traced_step(lambda: self.step(x), trace_path)
        if rec["contestant"].startswith("hca"):
            rec.update(_hca_extras(self.built.run))
        return rec


def _hca_extras(compiled) -> dict:
    """What hca's own report says: its graphs' collective bytes as they run and, when the
    report has a timeline, the estimated exposed communication before and after scheduling."""
    rep = report(compiled)
    out = {
        "report_bytes_per_step": sum(_wire_bytes_as_run(c) for c in rep.collectives),
        "program_sha1": rep.program_digest(),
        # layout="tune": each candidate's first-call time and the one kept (backends/tune.py)
        "tuning": [g.tuning for g in rep.graphs if g.tuning is not None] or None,
        "exposed_comm_est_s": None,
        "exposed_comm_est_unscheduled_s": None,
        "est_step_s": None,
        "est_compute_s": None,
        "est_comm_s": None,
        "est_step_no_contention_s": None,
    }
    try:
        m = rep.measured()
        out["graphs_measured"] = {
            "predicted_s": m.predicted_s,
            "measured_s": m.measured_s,
            "error": m.error,
            "calls": m.calls,
        }
    except HCAError:  # no timed call (inner="dtensor"), or a CUDA mesh
        out["graphs_measured"] = None
    if hasattr(rep, "timeline"):
        tl = rep.timeline()
        out.update(
            exposed_comm_est_s=tl.after.exposed_comm_s,
            exposed_comm_est_unscheduled_s=tl.before.exposed_comm_s,
            est_step_s=tl.after.total_s,
            est_compute_s=tl.after.compute_s,
            est_comm_s=tl.after.comm_s,
        )
        # The same step as if collectives took nothing from compute: what the calibrated contention adds.
        free = dataclasses.replace(rep.cost_model(), contention=0.0)
        out["est_step_no_contention_s"] = rep.timeline(free).after.total_s
    return out


def _wire_bytes_as_run(c) -> float:
    """A report collective's ring bytes per rank as the emitter runs it: a reduce_scatter on
    gloo runs as an all_reduce of the same buffer (every bench rank is CPU)."""
    if c.kind == Kind.REDUCE_SCATTER.value and scatter_runs_as_all_reduce(group_backend(c.group), "cpu"):
        return bytes_per_rank(Kind.ALL_REDUCE, c.bytes, c.group_size)
    return c.wire_bytes


# ------------------------------------------------------------ one model, then every model on this rank


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
    default_costs: bool = False  # hca's cost model: the documented defaults, not this machine's calibration
    recalibrate: bool = False  # measure the calibration even when cached
    rounds: int = 1  # round-robin rounds of `steps` timed steps per contestant
    profile_dir: str | None = None  # write a Chrome trace of one more step per contestant and rank
    # A model whose steps are short takes more timed steps per round: enough that the median
    # contestant's fill about this many seconds (its steps are a few ms, and this VM's noise is not).
    round_s: float = 0.25
    hca_options: dict = dataclasses.field(default_factory=dict)  # added to every hca contestant's (--hca-options)


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


def _run_model(
    spec: Spec,
    contestants: list,
    cfg: RunConfig,
    mesh,
    costs: dict,
    progress: Progress,
    *,
    applies_to=None,
    builder=None,
) -> list:
    """`applies_to` and `builder`: which contestants run on `spec` and how each is built (default
    `bench_models.applies` and `build`; `bench --real` brings its own, `bench_real`)."""
    applies_to = applies_to or applies
    n, rank = dist.get_world_size(), dist.get_rank()
    progress(f"{spec.name}: single-device reference ...")
    ref, ref_grads, batches = _reference(spec, cfg.steps + 2)  # first step, timed steps, profiled step
    amin, why = analytic_min(spec, ref, batches[0], n)
    records, live = [], []
    torch._dynamo.reset()
    for c in (c for c in contestants if applies_to(spec, c, n)):
        progress(f"{spec.name}: {c} ...")
        rec = {"model": spec.name, "contestant": c, "world_size": n, "notes": []}
        try:
            entry = Contestant(spec, c, ref, mesh, costs, cfg.hca_options, builder)
            rec = entry.rec
            entry.first(batches[0], ref_grads)
            live.append(entry)
        except Exception as e:  # noqa: BLE001 - a contestant that fails is reported, not fatal
            _fail(rec, e, progress)
        rec["analytic_min_bytes"], rec["analytic_min_why"] = amin, why
        records.append(rec)
    timed_batches = batches[1:-1]
    if cfg.round_s > 0 and live:
        warm = []
        for entry in list(live):
            try:
                warm.append(entry.warm(batches[1]))
            except Exception as e:  # noqa: BLE001
                live.remove(entry)
                _fail(entry.rec, e, progress)
        if warm:  # every rank computes the same count from the same (all-reduced) times
            steps = max(cfg.steps, math.ceil(cfg.round_s / max(statistics.median(warm), 1e-6)))
            timed_batches = [timed_batches[i % len(timed_batches)] for i in range(steps)]
    for r in range(cfg.rounds):
        if cfg.rounds > 1:
            progress(f"{spec.name}: timed round {r + 1}/{cfg.rounds} ({len(timed_batches)} steps each)")
        for entry in list(live):
            if cfg.rounds == 1:  # a rank that crashes here is named by the last line
                progress(f"{spec.name}: {entry.rec['contestant']} timed ...")
            try:
                entry.timed(timed_batches)
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


def hca_costs(cfg: RunConfig, mesh, progress: Progress) -> tuple[dict, str]:
    """hca's cost model in this run, passed to every hca contestant: rank 0's quiet cached
    calibration (what the compiler uses by default), else figures measured now; or the
    defaults; and where they came from ("cached <when>", "measured <when>, not cached",
    ", noisy" where flagged, or "defaults").

    The bench never writes the user's cache: a calibration measured under the bench's own
    load (its contestants, its rounds) would decide every later compile on this machine."""
    from torch_hca.spmd.calibration_cache import when

    if cfg.default_costs:
        return DEFAULTS[backend_for(mesh.device_type)].as_dict(), "defaults"
    progress(
        "calibrating the cost model on the ranks (not cached) ..."
        if cfg.recalibrate
        else "cost model: the cached calibration, else calibrating on the ranks (not cached) ..."
    )
    costs, cached = cached_calibrate(refresh=cfg.recalibrate, store=False)
    source = f"cached {when(costs.measured_at)}" if cached else f"measured {when(costs.measured_at)}, not cached"
    return dict(costs), source + (", noisy" if costs.noisy else "")


def run_rank(models: list, contestants: list, cfg: RunConfig, since: float | None = None) -> list:
    mesh = init_mesh()
    progress = Progress("bench", since, enabled=dist.get_rank() == 0)
    costs, source = hca_costs(cfg, mesh, progress)
    records = []
    # Contestants of one model live side by side: each compiles into its own cache entry
    # (the backend is part of the guard). Shapes stay static as in a fresh process: hca_dp's
    # half batch must not make Dynamo recompile the other contestants with dynamic shapes.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=4 * len(CONTESTANTS)):
        for name in models:
            for rec in _run_model(specs(cfg.tiny)[name], contestants, cfg, mesh, costs, progress):
                if rec["contestant"].startswith("hca"):
                    rec["cost_model"], rec["cost_model_source"] = dict(costs), source
                records.append(rec)
    return records


# ------------------------------------------------------------ merging the ranks' records


def merge(per_rank: list) -> list:
    """Rank 0's records, with the worst error, memory and times over the ranks, and hca's step-time ratios."""
    merged = []
    for i, rec in enumerate(per_rank[0]):
        rec = dict(rec)
        for key in (
            "max_grad_rel_err",
            "peak_mem_bytes",
            "step_time_s",
            "compile_time_s",
            "first_step_s",
            "optimizer_time_s",
        ):
            vals = [r[i][key] for r in per_rank if r[i].get(key) is not None]
            rec[key] = max(vals) if vals else None
        # Each round's median, slowest rank: what the targets read round by round.
        rounds = [r[i].get("round_step_times_s") or [] for r in per_rank]
        if rounds[0]:
            rec["round_step_times_s"] = [max(ts) for ts in zip(*rounds)]
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
            if r["contestant"] in REGRET_OF:
                r.update(_regret(r, rows))
    return merged


# Whose regret the bench measures: hca's default, and hca choosing by the clock (layout="tune").
REGRET_OF = ("hca", "hca_tune")


def _regret(hca: dict, rows: list) -> dict:
    """hca's step time over the fastest of the other layouts it could have chosen (> 1: one was faster).

    An alternative whose layouts came out the same as hca's (the same emitted program) is not
    another choice: its time is hca's program timed again, so the two differ by the machine's
    noise alone, and it counts at hca's own time."""
    alts = {r["contestant"]: r["step_time_s"] for r in rows if r["contestant"] in ALTERNATIVES and r["step_time_s"]}
    same = [
        r["contestant"]
        for r in rows
        if r["contestant"] in alts and r.get("program_sha1") and r.get("program_sha1") == hca.get("program_sha1")
    ]
    out = {"regret": None, "regret_vs": None, "regret_alternatives_s": alts, "regret_same_program": same}
    if not hca["step_time_s"] or not alts:
        return out
    counted = {c: hca["step_time_s"] if c in same else t for c, t in alts.items()}
    best = min(counted, key=counted.get)
    return {**out, "regret": hca["step_time_s"] / counted[best], "regret_vs": best}
