"""`python -m torch_hca bench --real`: real-size Hugging Face models, every way of training them side by side.

Two models at full size (``--tiny``: the same families at 2 layers and 64 wide, a smoke test):

- ``gpt2_small``: ``GPT2LMHeadModel(GPT2Config())``, GPT-2 small as released (12 layers, 768 wide,
  12 heads, tied 50,257-token vocabulary, 124M parameters), every dropout at 0;
- ``llama_100m``: ``LlamaForCausalLM`` at hidden 768, 12 layers, 12 query heads over 4 key/value
  heads (GQA), RMSNorm, SwiGLU 2048 wide, a 32,000-token vocabulary, untied head (125M parameters).

Each is trained on ``rows`` rows per rank of ``seq`` tokens (the global batch: ``rows x world
size`` rows), next-token cross-entropy (`zoo.lm_loss`, as the bench's own LMs), one SGD step,
by each contestant (`REAL_CONTESTANTS`); contestants that need a batch split take their ranks'
rows of the same global batch, the others (one device, tensor parallel) the whole of it:

- ``single`` / ``single_inductor``: one device's model on the global batch, eager / ``torch.compile``;
- ``ddp`` / ``ddp_inductor``: ``DistributedDataParallel``, eager / under ``torch.compile``;
- ``fsdp2``: ``fully_shard`` on every block, then on the root;
- ``expert`` / ``expert_inductor``: ``parallelize_module`` with the Megatron plan
  (``ColwiseParallel`` q, k, v, gate, up; ``RowwiseParallel`` o, down), eager / Inductor.
  GPT-2's projections are HF ``Conv1D`` modules, which those styles do not take: there it fails,
  and the table says so;
- ``hca`` / ``hca_inductor``: ``backend="hca"`` (inner eager / ``inner="inductor"``) on data-parallel
  storage: every parameter replicated, ``inputs=Shard(0)``;
- ``hca_megatron`` / ``hca_megatron_inductor``: hca on Megatron storage (`MEGATRON`), inputs and
  outputs replicated, inner eager / ``inner="inductor"``;
- ``hca_plan``: hca on the storage ``hca.plan`` chooses for this batch, ``inputs=Shard(0)``.

The machinery is the bench's (`bench_run`): the same first step checked against one device
(relative gradient error at most 1e-5, else the command exits 1), timed steps in ``--rounds``
round-robin rounds, one profiled step for bytes, collectives and peak memory; a contestant
that fails is a failed row, not a failed run. Only the builder, the models and the table are here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from torch_hca.runtime.launch import launch
from torch_hca.runtime.mesh import init_mesh
from . import zoo
from .bench_models import Built, Spec, build as bench_build
from .bench_run import RunConfig, _run_model, hca_costs, merge
from .bench_tables import GRAD_TOL, _aligned, _fmt, _fmt_bytes, _profile_table, wrong_gradients
from .progress import Progress
from .real_models import BUILD, EXPERT_BLOCK, MEGATRON, SEQ, LogitsOf, LossOf

REAL_MODELS = ("gpt2_small", "llama_100m")
REAL_CONTESTANTS = (
    "single",
    "single_inductor",
    "ddp",
    "ddp_inductor",
    "fsdp2",
    "expert",
    "expert_inductor",
    "hca",
    "hca_inductor",
    "hca_megatron",
    "hca_megatron_inductor",
    "hca_plan",
)
ROWS, TINY_SEQ = (4,), 16


def _blocks(model: LogitsOf) -> nn.ModuleList:
    hf = model.hf
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def parameter_count(model: str, tiny: bool = False, seq: int = SEQ) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in BUILD[model](tiny, seq).parameters())


def real_spec(model: str, rows: int, seq: int, world_size: int, tiny: bool = False) -> Spec:
    """`model` at `rows` rows per rank of `seq` tokens: a bench `Spec` of kind "dp" (its ``plan``
    {} is the ``hca`` contestants' data-parallel storage), named ``{model}_rows{rows}``."""
    vocab = 128 if tiny else {"gpt2_small": 50257, "llama_100m": 32000}[model]
    return Spec(
        f"{model}_rows{rows}",
        "dp",
        lambda: BUILD[model](tiny, seq),
        {},
        lambda g: torch.randint(0, vocab, (rows * world_size, seq), generator=g),
        zoo.lm_loss,
        "mean",
    )


def _family(spec: Spec) -> str:
    return spec.name.rsplit("_rows", 1)[0]


def _applies(spec: Spec, contestant: str, world_size: int) -> bool:
    return contestant in REAL_CONTESTANTS


def _expert(model: LogitsOf, family: str, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    style = {"col": ColwiseParallel, "row": RowwiseParallel}
    for block in _blocks(model):
        parallelize_module(block, mesh, {name: style[s]() for name, s in EXPERT_BLOCK[family].items()})
    return model


def _fsdp2(model: LogitsOf, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def builder(plans: dict) -> Callable:
    """`bench_run.Contestant`'s builder for `REAL_CONTESTANTS`; `plans`: ``hca.plan``'s storage plan
    per spec name (or the exception it raised), computed before the contestants (it resets Dynamo)."""

    def build(spec: Spec, contestant: str, ref: nn.Module, mesh, costs: dict, hca_options: dict | None = None) -> Built:
        import copy

        n = mesh.size()
        if contestant in ("single_inductor", "hca", "hca_inductor"):  # the bench's own, on data-parallel storage
            return bench_build(spec, contestant, ref, mesh, costs, hca_options)
        if contestant in ("hca_megatron", "hca_megatron_inductor"):  # the whole batch on every rank, the loss inside
            tp = dataclasses.replace(spec, plan=MEGATRON[_family(spec)], kind="tp")
            inner = "hca_inductor" if contestant.endswith("_inductor") else "hca"
            built = bench_build(tp, inner, LossOf(ref.hf), mesh, costs, hca_options)
            return dataclasses.replace(built, loss_inside=True)
        if contestant == "hca_plan":
            plan = plans.get(spec.name)
            if isinstance(plan, BaseException):
                raise plan
            return bench_build(dataclasses.replace(spec, plan=plan), "hca", ref, mesh, costs, hca_options)
        base = copy.deepcopy(ref)
        if contestant == "single":
            return Built(base, base, 1.0, False)
        # DDP and FSDP2 average the ranks' gradients: a mean loss per rank trains the global mean.
        scale = float(n) if spec.split_loss == "sum" else 1.0
        if contestant in ("ddp", "ddp_inductor"):
            model = nn.parallel.DistributedDataParallel(base)
            return Built(model, model if contestant == "ddp" else torch.compile(model), scale, True)
        if contestant == "fsdp2":
            model = _fsdp2(base, mesh)
            return Built(model, model, scale, True)
        if contestant in ("expert", "expert_inductor"):
            model = _expert(base, _family(spec), mesh)
            return Built(model, model if contestant == "expert" else torch.compile(model), 1.0, False)
        raise ValueError(f"unknown contestant {contestant!r}; choose from {', '.join(REAL_CONTESTANTS)}")

    return build


def _auto_plan(spec: Spec, mesh, costs: dict) -> tuple[dict | BaseException, float]:
    """``hca.plan`` on this rank's rows of the first batch (as `bench_run._reference` draws it)."""
    from torch_hca.api.autoplan import plan

    torch.manual_seed(0)
    model = spec.build()
    x = spec.batch(torch.Generator().manual_seed(1)).chunk(mesh.size())[dist.get_rank()]
    t0 = time.perf_counter()
    try:
        chosen = plan(
            model, (x,), mesh, inputs=Shard(0), outputs=Shard(0), options={"cost_model": costs} if costs else None
        )
    except Exception as e:  # noqa: BLE001 - hca_plan's row says it failed
        chosen = e
    dist.barrier()
    return chosen, time.perf_counter() - t0


def run_rank(models: list, rows: list, seq: int, contestants: list, cfg: RunConfig, since: float | None = None) -> list:
    mesh = init_mesh()
    n = dist.get_world_size()
    progress = Progress("bench", since, enabled=dist.get_rank() == 0)
    costs, source = hca_costs(cfg, mesh, progress)
    records = []
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=4 * len(REAL_CONTESTANTS)):
        for model in models:
            for r in rows:
                spec = real_spec(model, r, seq, n, cfg.tiny)
                plans, plan_s = {}, None
                if "hca_plan" in contestants:
                    progress(f"{spec.name}: hca.plan ...")
                    plans[spec.name], plan_s = _auto_plan(spec, mesh, costs)
                for rec in _run_model(
                    spec, contestants, cfg, mesh, costs, progress, applies_to=_applies, builder=builder(plans)
                ):
                    rec.update(
                        model_family=model, rows_per_rank=r, seq=seq, parameters=parameter_count(model, cfg.tiny, seq)
                    )
                    if rec["contestant"].startswith("hca"):
                        rec["cost_model"], rec["cost_model_source"] = dict(costs), source
                    if rec["contestant"] == "hca_plan" and isinstance(plans.get(spec.name), dict):
                        rec["plan"] = {
                            k: str(v)
                            for k, v in plans[spec.name].items()
                            if any(not p.is_replicate() for p in (v if isinstance(v, tuple) else (v,)))
                        }
                        rec["plan_time_s"] = plan_s
                    records.append(rec)
    return records


# ------------------------------------------------------------ the table

_HEAD = (
    "contestant",
    "first call s",
    "step s",
    "/ single_inductor",
    "/ ddp",
    "peak mem/rank",
    "grad rel err",
    "coll/step",
    "bytes/step",
    "collectives",
)


def _ratio(r: dict, base: dict | None) -> str:
    ok = base is not None and not base.get("failed") and base.get("step_time_s")
    return _fmt(r["step_time_s"] / base["step_time_s"] if ok and r.get("step_time_s") else None, ".2f")


def _row(r: dict, rows: list) -> tuple:
    if r.get("failed"):  # the error itself goes below the table
        return (r["contestant"], "failed") + ("n/a",) * (len(_HEAD) - 2)
    by = lambda c: next((o for o in rows if o["contestant"] == c), None)
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted((r.get("collectives_by_kind") or {}).items())) or "none"
    return (
        r["contestant"],
        _fmt(r["first_step_s"], ".1f"),
        _fmt(r["step_time_s"], ".2f"),
        _ratio(r, by("single_inductor")),
        _ratio(r, by("ddp")),
        _fmt_bytes(r["peak_mem_bytes"]),
        _fmt(r["max_grad_rel_err"], ".1e"),
        _fmt(r["collectives"], ".0f"),
        _fmt_bytes(r["bytes_per_step"]),
        kinds,
    )


FOOTNOTES = [
    "first call s: the first step (compiles, DDP's buckets, FSDP2's lazy init), slowest rank; hca_plan's "
    "hca.plan time is in its line below the table, not in this column.",
    "step s: median of the timed steps of every round (forward + backward + SGD step, each after a barrier), "
    "slowest rank; / single_inductor, / ddp: this step over theirs (< 1: faster).",
    "peak mem/rank: this rank's parameters (or shards) and DDP's buckets, plus the highest running total of CPU "
    "allocations during one profiled step, max over ranks (docs/bench.md, the bench's footnotes).",
    "grad rel err: max over parameters of |g - g_ref| / |g_ref| after the first step against one device on the "
    f"global batch; above {GRAD_TOL:g} the gradient is wrong and the command exits 1.",
    "coll/step, bytes/step, collectives: the c10d collectives one profiled step issued (by kind) and the bytes "
    "one rank sent in a ring implementation of each, counted the same way for every contestant.",
]


def real_tables(records: list) -> str:
    lines: list[str] = []
    for group in dict.fromkeys(r["model"] for r in records):
        rows = [r for r in records if r["model"] == group]
        r0, n = rows[0], rows[0]["world_size"]
        lines.append(
            f"== {r0['model_family']} ({r0['parameters'] / 1e6:.1f}M parameters): {r0['rows_per_rank']} "
            f"rows/rank x {r0['seq']} tokens, world size {n} (global batch {r0['rows_per_rank'] * n} rows; "
            "one device and tensor parallel take all of it, the others their ranks' rows) =="
        )
        lines += _aligned([_HEAD] + [_row(r, rows) for r in rows])
        lines += [
            f"WRONG GRADIENTS: {r['contestant']} (max rel err {r['max_grad_rel_err']:.1e} > {GRAD_TOL:g})"
            for r in wrong_gradients(rows)
        ]
        lines += [f"{r['contestant']} failed: {r['failed']}" for r in rows if r.get("failed")]
        for r in rows:
            if r.get("plan_time_s") is not None:
                shards = ", ".join(f"{k}: {v}" for k, v in r["plan"].items()) or "every parameter replicated"
                lines.append(f"hca_plan: hca.plan took {r['plan_time_s']:.1f} s and chose {shards}")
        lines.append("")
    lines += _profile_table(records)
    lines += [f"[{i + 1}] {t}" for i, t in enumerate(FOOTNOTES)]
    return "\n".join(lines)


def main(
    world_size: int = 2,
    steps: int = 5,
    models=REAL_MODELS,
    contestants=REAL_CONTESTANTS,
    json_path=None,
    tiny: bool = False,
    default_costs: bool = False,
    *,
    rows=ROWS,
    seq: int | None = None,
    recalibrate: bool = False,
    rounds: int = 1,
    profile_dir: str | None = None,
    round_ms: float = 250.0,
    hca_options: str | dict | None = None,
) -> int:
    from .bench import _hca_options

    models, contestants, rows = list(models), list(contestants), [int(r) for r in rows]
    seq = (TINY_SEQ if tiny else SEQ) if seq is None else seq
    for m in models:
        if m not in REAL_MODELS:
            raise SystemExit(f"unknown model {m!r} for --real; choose from {', '.join(REAL_MODELS)}")
    for c in contestants:
        if c not in REAL_CONTESTANTS:
            raise SystemExit(f"unknown contestant {c!r} for --real; choose from {', '.join(REAL_CONTESTANTS)}")
    if steps < 1 or rounds < 1:
        raise SystemExit("--steps and --rounds must be >= 1")
    if not rows or min(rows) < 1 or seq < 2:
        raise SystemExit("--rows must be positive and --seq at least 2")
    options = _hca_options(hca_options)
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
    for m in models:
        print(f"{m}: {parameter_count(m, tiny, seq):,} parameters{' (tiny)' if tiny else ''}")
    timed = f"{steps}+ timed" + (f" x {rounds} rounds" if rounds > 1 else "")
    print(
        f"torch_hca bench --real: {', '.join(models)} at rows/rank {', '.join(map(str, rows))} x {seq} tokens x "
        f"{', '.join(contestants)} on {world_size} local gloo ranks, 1 warm-up + {timed} + 1 profiled step(s)\n",
        flush=True,
    )
    cfg = RunConfig(
        steps,
        tiny,
        default_costs,
        recalibrate,
        rounds,
        os.path.abspath(profile_dir) if profile_dir else None,
        round_ms / 1e3,
        options,
    )
    progress = Progress("bench")
    progress(f"starting {world_size} local gloo ranks")
    records = merge(launch(run_rank, world_size, models, rows, seq, contestants, cfg, progress.since, timeout_s=3600.0))
    progress(f"done: {len(records)} records")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=2, default=str)
    print(real_tables(records))
    if json_path:
        print(f"\nwrote {len(records)} records to {os.path.abspath(json_path)}")
    return 1 if wrong_gradients(records) else 0
