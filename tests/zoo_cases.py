"""Work run on every rank by tests/test_zoo.py: the model zoo against one device.

Plain module, importable by the spawned ranks; no pytest here. Exceptions
propagate (a `LocalWorld` reports them as `RankError` with the traceback).

How the loss is taken: every rank gathers the *logical* (global) output with
`dist_cases.full` (an identity for replicated outputs) and applies the model's
``loss_fn`` to it and to the global inputs, exactly as the single-device
reference does. Each rank then holds the whole global loss, and the backward of
the gather hands each rank's local output piece its slice of the global output's
gradient (Replicate -> Shard is a local slice, no collective), which is what the
compiled backward expects for an output laid out as the plan's ``outputs``. (The
alternative, each rank's loss on its own piece with the ranks' losses adding up to
the global one, holds for a sum but not for the means inside cross-entropy.)
The gather runs eagerly, outside the compiled graphs: it is not in the report's
collective counts.

The optimizer steps are SGD with momentum by default: linear in the gradients, so a
gradient within 1e-7 gives parameters within about as much, while the momentum
buffers still exercise optimizer state held as DTensors. Adam (``optimizer="adam"``)
divides by the gradient's own running magnitude, so it turns fp32 reduction-order
differences on near-zero gradient elements into whole-lr steps (measured: llama,
megatron plan, 2 ranks, 2 Adam steps at lr 1e-2: gradients within 3.5e-7,
parameters 1.1e-5); test_parity.py's sequence-parallel docstring saw the same.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

import torch_hca as hca
from torch_hca.report import strategy_file
from torch_hca.tools.step_profile import StepProfile

import model_zoo
from dist_cases import full, rel_err

LR = 1e-2


def backend_options() -> dict:
    """Strict, and the refinement check on: a wrong output or gradient stops the first call."""
    return {"strict": True, "check": True}


def local_piece(x: torch.Tensor, mesh, layout) -> torch.Tensor:
    """This rank's piece of global `x` laid out as `layout`, cut locally (no collective:
    every rank drew the same global data from the same seed)."""
    layout = (layout,) if not isinstance(layout, tuple) else layout
    return distribute_tensor(x, mesh, layout, src_data_rank=None).to_local()


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=LR)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    raise ValueError(f"optimizer {name!r}: use 'sgd' (with momentum) or 'adam'")


def zoo_parity(
    model_name: str,
    plan_name: str,
    steps: int = 2,
    optimizer: str = "sgd",
    options: dict | None = None,
    count_c10d: bool = False,
    dropout: float = 0.0,
    reload: bool = False,
) -> dict[str, Any]:
    """Outputs, gradients and `steps` optimizer steps of the sharded, hca-compiled model
    against the single-device reference, plus the report's graphs and collectives.
    ``options``: backend options to use instead of `backend_options()`. ``count_c10d``: also
    the c10d ops the compiled forward and backward of the last step ran (``ran``, by kind).
    ``dropout``: the model's hidden dropout (`model_zoo.DROPOUT_MODELS`); the compiled steps and the
    reference's each draw from their own copy of one seeded generator state, carried from step to
    step, so a step that draws more than one device's (a backward drawing again) shifts the next
    step's masks."""
    torch._dynamo.reset()
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    ref, make_inputs, loss_fn = model_zoo.build(model_name, dropout)
    spec = model_zoo.plan_spec(model_name, plan_name, world_size, ref)
    mesh = hca.init_mesh(spec.mesh_shape, spec.mesh_names)
    batches = [make_inputs(model_zoo.BATCH) for _ in range(steps)]  # same on every rank (same seed)
    local = lambda xs: tuple(local_piece(x, mesh, spec.inputs) for x in xs)

    plan = spec.plan
    if plan is None:  # "auto": the solver's storage plan, chosen on this rank's example inputs
        plan = hca.plan(copy.deepcopy(ref), local(batches[0]), mesh, inputs=spec.inputs, outputs=spec.outputs)
        torch._dynamo.reset()
    model = hca.sharded(plan, mesh=mesh, inputs=spec.inputs, outputs=spec.outputs)(copy.deepcopy(ref))
    options = backend_options() if options is None else options
    compiled = torch.compile(model, backend="hca", options=options)
    torch._dynamo.utils.counters.clear()

    result: dict[str, Any] = {
        "options": options,
        "plan": {k: str(v) for k, v in plan.items()},
        "tied_ref": model_zoo.tied_groups(ref),
        "tied_sharded": model_zoo.tied_groups(model),
    }
    torch.manual_seed(1000)  # the same on every rank
    streams = {"compiled": torch.get_rng_state(), "reference": torch.get_rng_state()}
    opt = _optimizer(optimizer, model.parameters())  # named_parameters/parameters: a tied weight once
    ref_opt = _optimizer(optimizer, ref.parameters())
    for step, xs in enumerate(batches):
        counting = count_c10d and step == len(batches) - 1
        t0 = time.perf_counter()
        torch.set_rng_state(streams["compiled"])
        with StepProfile(world_size) if counting else contextlib.nullcontext() as forward_ran:
            out = compiled(*local(xs))
        t1 = time.perf_counter()
        full_out = full(out, mesh, spec.outputs)
        loss = loss_fn(full_out, xs)
        t2 = time.perf_counter()
        with StepProfile(world_size) if counting else contextlib.nullcontext() as backward_ran:
            loss.backward()
        t3 = time.perf_counter()
        streams["compiled"] = torch.get_rng_state()
        if counting:  # the eager gather of the output (`full`) and its backward run outside these
            result["ran"] = {"forward": forward_ran.by_kind, "backward": backward_ran.by_kind}
        torch.set_rng_state(streams["reference"])
        ref_out = ref(*xs)
        ref_loss = loss_fn(ref_out, xs)
        ref_loss.backward()
        streams["reference"] = torch.get_rng_state()
        if step == 0:
            result["first_call_s"] = t1 - t0
            result["first_backward_s"] = t3 - t2
            result["out_err"] = rel_err(full_out.detach(), ref_out.detach())
            result["loss_err"] = rel_err(loss.detach(), ref_loss.detach())
            result["grad_errs"], result["grad_abs_errs"] = grad_errors(model, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    refs = dict(ref.named_parameters())
    fulls = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    scale = _norm(refs[n].detach() for n in fulls)
    result["param_errs"] = {n: rel_err(t, refs[n].detach()) for n, t in fulls.items()}
    result["param_abs_errs"] = {n: ((t - refs[n].detach()).norm() / scale).item() for n, t in fulls.items()}
    # Buffers the forward updates in place (BatchNorm's running statistics) must follow too.
    buffers = dict(model.named_buffers())
    result["buffer_errs"] = {n: _buffer_err(buffers[n], b) for n, b in ref.named_buffers()}
    rep = hca.report(compiled)
    result["graphs"] = len(rep.graphs)
    # Dynamo's own count: the report finds a module's graphs by the parameters they read, and
    # every parameter enters the first graph, so it cannot see a break.
    result["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    result["refinement"] = [g.refinement for g in rep.graphs]
    result["random_draws"] = [d for g in rep.graphs for d in g.random_draws]
    result["tuning"] = [g.tuning for g in rep.graphs]  # option layout="tune": each candidate's time
    result["implicit"] = [m for g in rep.graphs for m in g.implicit_redistributions]
    result["forward"] = rep.collective_counts("forward")
    result["backward"] = rep.collective_counts("backward")
    result["collective_bytes"] = sum(c.bytes for c in rep.collectives)  # one call of every graph
    # The strategy this compile decided, as its file holds it, checked by the independent
    # verifier (torch_hca/verify): milliseconds, so every parity case is also a verifier case.
    saved = strategy_file.build(rep)
    verified = hca.verify(saved, raise_on_failure=False)
    result["verify_problems"] = [str(p) for p in verified.problems]
    # A forward collective the backward issues again (torch_hca/compiler/partition.py removes unread copies).
    result["issued_again"] = [c["id"] for g in saved["graphs"] for c in g["collectives"] if "recomputes" in c]
    if dist.get_rank() == 0:  # the file against the model, every rank simulated in float64 (one rank does it)
        if os.environ.get("TORCH_HCA_ZOO_DUMP"):  # the verifier's inputs, to rerun it in one process
            torch.save(
                {"model": copy.deepcopy(ref), "strategy": saved, "inputs": batches[0]},
                os.path.join(os.environ["TORCH_HCA_ZOO_DUMP"], f"{model_name}-{plan_name}-{dist.get_world_size()}.pt"),
            )
        checked = hca.verify(copy.deepcopy(ref), saved, batches[0], raise_on_failure=False)
        result["model_verify_problems"] = [str(p) for p in checked.problems]
        result["numeric"] = checked.numeric and dataclasses.asdict(checked.numeric)
        result["verify_s"] = checked.seconds
    if reload:
        result["reloaded"] = _reloaded(ref, plan, spec, mesh, options, saved, batches[0], loss_fn, local)
    return result


def _reloaded(ref, plan, spec, mesh, options, saved: dict, xs, loss_fn, local) -> dict[str, Any]:
    """The strategy file this rank saved, loaded by a fresh compile of the trained reference (in
    this process, as a user reloading does): its collectives, its probing time, and one step's
    outputs and gradients against the reference's."""
    torch._dynamo.reset()
    model = hca.sharded(plan, mesh=mesh, inputs=spec.inputs, outputs=spec.outputs)(copy.deepcopy(ref))
    torch.manual_seed(2000)  # the same draws for both, as in the steps above
    state = torch.get_rng_state()
    with tempfile.TemporaryDirectory(prefix="hca-strategy-") as folder:
        path = os.path.join(folder, "strategy.json")
        with open(path, "w") as f:
            json.dump(saved, f)
        compiled = torch.compile(model, backend="hca", options={**options, "strategy": path})
        out = full(compiled(*local(xs)), mesh, spec.outputs)
        loss_fn(out, xs).backward()
    torch.set_rng_state(state)
    ref.zero_grad()
    ref_out = ref(*xs)
    loss_fn(ref_out, xs).backward()
    rep = hca.report(compiled)
    grad_errs, grad_abs_errs = grad_errors(model, ref)
    return {
        "out_err": rel_err(out.detach(), ref_out.detach()),
        "grad_errs": grad_errs,
        "grad_abs_errs": grad_abs_errs,
        "forward": rep.collective_counts("forward"),
        "backward": rep.collective_counts("backward"),
        "probe_seconds": sum(g.layout.probe_seconds for g in rep.graphs),
    }


def _buffer_err(t: torch.Tensor, ref: torch.Tensor) -> float:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    if ref.is_floating_point():
        return rel_err(t.detach(), ref.detach()) if ref.norm() > 0 else (t - ref).norm().item()
    return (t.long() - ref.long()).abs().max().item() if t.numel() else 0.0  # integer counters: how far off


def _norm(tensors) -> torch.Tensor:
    return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)).float().clamp_min(1e-30)


def grad_errors(model: torch.nn.Module, ref: torch.nn.Module) -> tuple[dict[str, float], dict[str, float]]:
    """Per parameter (a tied weight once, under its first name, as named_parameters lists
    it): the error relative to the reference gradient, and relative to the norm of the
    whole reference gradient (for gradients that are zero analytically,
    `model_zoo.ZERO_GRADIENT`). A gradient on one side only is inf."""
    refs = dict(ref.named_parameters())
    scale = _norm(p.grad for p in refs.values() if p.grad is not None)
    rel, whole = {}, {}
    for name, p in model.named_parameters():
        if p.grad is None or refs[name].grad is None:
            rel[name] = whole[name] = float("inf") if (p.grad is None) != (refs[name].grad is None) else 0.0
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        rel[name] = rel_err(g, refs[name].grad)
        whole[name] = ((g - refs[name].grad).norm() / scale).item()
    return rel, whole


def inductor_compile_time(model_name: str, batch: int = model_zoo.BATCH) -> dict[str, Any]:
    """The model on one device under `torch.compile(model)` (Inductor): the first
    forward + backward's wall time (compiles both), a later one's, and the graph count."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, make_inputs, loss_fn = model_zoo.build(model_name)
    compiled = torch.compile(model)
    xs = make_inputs(batch)
    t0 = time.perf_counter()
    loss = loss_fn(compiled(*xs), xs)
    loss.backward()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss_fn(compiled(*xs), xs).backward()
    second = time.perf_counter() - t0
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return {
        "first_call_s": first,
        "second_call_s": second,
        "graphs": graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "loss": loss.item(),
    }
