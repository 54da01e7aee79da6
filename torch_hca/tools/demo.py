"""`python -m torch_hca demo`: a GPT-style model, tensor parallel on 2 local gloo ranks.

The model (`torch_hca.tools.zoo.GPT`: causal attention, ``arange`` positions, the
output projection tied to the token embedding) is written for one device.
The demo compiles it with backend "hca", prints the DTensor program and the
collectives table, trains a few Adam steps on a next-token loss next to a
single-device copy, and checks gradients and parameters against it. Progress
lines with the elapsed time go to stderr (`torch_hca.tools.progress`).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from torch_hca.runtime.launch import launch
from torch_hca.runtime.mesh import init_mesh
from torch_hca.api.plan import sharded
from torch_hca.report.compile_report import report
from torch_hca.report.text import WIDTH, readable_code
from . import zoo
from .progress import Progress

VOCAB, DIM, HEADS, HIDDEN, LAYERS, BATCH, SEQ, STEPS = 128, 128, 4, 512, 2, 2, 16, 5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def run_rank(since: float | None = None) -> dict:
    mesh = init_mesh()
    progress = Progress("demo", since, enabled=torch.distributed.get_rank() == 0)
    progress(f"compiling the model and running step 1 of {STEPS} ...")
    torch.manual_seed(0)
    ref = zoo.GPT(VOCAB, DIM, HEADS, HIDDEN, LAYERS, max_len=SEQ)
    model = sharded(zoo.TP_GPT, mesh=mesh)(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca")
    opt, ref_opt = torch.optim.Adam(model.parameters(), 1e-3), torch.optim.Adam(ref.parameters(), 1e-3)
    grad_err, times = 0.0, []
    start = time.perf_counter()
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        t0 = time.perf_counter()
        loss = zoo.lm_loss(compiled(ids), ids)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if step == 0:
            compile_s = time.perf_counter() - start
            progress(f"step 1 done in {compile_s:.1f} s (compile included); steps 2-{STEPS} ...")
        ref_loss = zoo.lm_loss(ref(ids), ids)
        ref_loss.backward()
        refs = dict(ref.named_parameters())
        grad_err = max(grad_err, *(_rel(p.grad.full_tensor(), refs[n].grad) for n, p in model.named_parameters()))
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    progress(f"{STEPS} steps done; median step {1e3 * statistics.median(times[1:]):.1f} ms")
    refs = dict(ref.named_parameters())
    param_err = max(_rel(p.full_tensor(), refs[n]) for n, p in model.named_parameters())
    rep = report(compiled)
    return {
        "program": rep.dtensor_code.strip(),
        "table": rep.table(WIDTH),
        "forward": rep.collective_counts("forward"),
        "backward": rep.collective_counts("backward"),
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "grad_err": grad_err,
        "param_err": param_err,
        "compile_s": compile_s,
        "step_ms": 1e3 * statistics.median(times[1:]),
    }


def header(world_size: int) -> str:
    return (
        f"torch_hca demo: GPT-style model ({LAYERS} layers, dim {DIM}, {HEADS} heads, MLP {HIDDEN},\n"
        f"vocab {VOCAB}, tied embeddings), tensor parallel over {world_size} local gloo ranks\n"
    )


def passed(results: list[dict]) -> bool:
    return all(x["grad_err"] <= 1e-5 and x["param_err"] <= 1e-5 for x in results)


def summary(results: list[dict]) -> str:
    """What the demo prints once the ranks are done (lines of at most `report.WIDTH`)."""
    r = results[0]
    return "\n".join(
        [
            "== DTensor program (rank 0) ==",
            readable_code(r["program"]),
            "\n== collectives in the compiled graphs ==",
            r["table"],
            "\n== summary ==",
            f"collectives per step: forward {r['forward']}, backward {r['backward']}",
            f"final loss {r['loss']:.6f} (single device {r['ref_loss']:.6f}) after {STEPS} Adam steps",
            f"max gradient relative error vs single device: {max(x['grad_err'] for x in results):.2e}",
            f"max parameter relative error after {STEPS} steps: {max(x['param_err'] for x in results):.2e}",
            f"first call (compile + step) {r['compile_s']:.1f} s; median step {r['step_ms']:.1f} ms",
            "PASS: gradients match a single device (rel err <= 1e-5)"
            if passed(results)
            else "FAIL: gradients differ from a single device",
        ]
    )


def main(world_size: int = 2) -> int:
    print(header(world_size), flush=True)
    progress = Progress("demo")
    progress(f"starting {world_size} local gloo ranks")
    results = launch(run_rank, world_size, progress.since)
    progress("done")
    print(summary(results))
    return 0 if passed(results) else 1
