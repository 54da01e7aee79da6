"""The backend pipeline for one Dynamo graph, its stages in the order of `STAGES`.

    Dynamo graph (the logical program, torch_hca.compiler.logical) --lift--> replicated DTensor program
      --layout--> DTensor program --roles--> --origins--> every node tagged
      --AOTAutograd--> joint graph --transpose--> --collective rewrites--> --backward kept--> partition
      --> forward, backward
      --schedule--> checked order --emit--> FX (eager) or Inductor

With option layout="tune", several layouts of the graph go through this and the first
call keeps the fastest (backends/tune.py).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import textwrap
import time

from typing import Any, Callable

import torch
import torch.fx as fx
from functorch.compile import default_partition
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.tensor import DTensor

from torch_hca._torch_private import (
    graph_arg_example,
    group_size,
    inductor_random_as_eager,
    no_donated_buffers,
    size_hint,
)
from torch_hca.compiler.checks.agreement import InputAgreement
from torch_hca.spmd.collective_kinds import RULES
from torch_hca.spmd.collective_nodes import OPS, node_group, node_payload, payload_bytes
from torch_hca.compiler.options import Options
from torch_hca.runtime.mesh import devices_mixed
from torch_hca.compiler.parameters import parameter_name
from torch_hca.errors import HCAError, UnsupportedError
from torch_hca.compiler.dtensor_failures import dtensor_failure
from torch_hca.compiler.partition import without_unread_collectives
from torch_hca.compiler.randomness import generators_kept, without_dead_draws
from torch_hca.compiler.checks.spmd_check import check_same_collectives
from torch_hca.compiler.checks.refinement import check_refinement
from torch_hca.compiler.checks.uneven import (
    check_forward_collectives,
    check_sizes_only_shape,
    drop_whole_slices,
    uneven_options,
    uneven_shares,
    weight_partial_means,
)
from torch_hca.report import strategy_file
from torch_hca.report.compile_report import CompileReport, new_graph_report, next_graph_index
from torch_hca.report.records import CollectiveRecord, GraphReport
from torch_hca.spmd.placements import dtype_str, layout_str
from torch_hca.report.parallelism import sentence
from torch_hca.passes.collective_rewrites import CollectiveRewritePass, agree_across_ranks, no_rank_rewrites
from torch_hca.passes.rewrite_rules import REWRITE
from torch_hca.passes.infra import PassContext, dump, run_pass
from torch_hca.passes.layout import LayoutPass
from torch_hca.passes.lift import LiftPass
from torch_hca.passes.roles import CotangentRolePass
from torch_hca.passes.schedule import SchedulePass
from torch_hca.passes.origins import OriginPass
from torch_hca.passes.transpose import PARTNER, RULE, BackwardKeptPass, TransposePass

from .emit import decompositions, emit
from .tune import Candidate, Tuned, candidate_options


# One Dynamo graph's stages, in the order they run: (name, its pass; None: a step of torch's).
# The passes up to AOTAutograd run on the DTensor program (`lay_out`), those between AOTAutograd
# and the partition on the joint graph (the partition hook), the schedule on each of forward and
# backward. docs/concepts.md, section 3, numbers the same stages in this order (tests/test_docs.py).
STAGES: tuple[tuple[str, type | None], ...] = (
    ("lift", LiftPass),
    ("layout", LayoutPass),
    ("roles", CotangentRolePass),
    ("origins", OriginPass),
    ("AOTAutograd", None),
    ("transpose", TransposePass),
    ("collective rewrites", CollectiveRewritePass),
    ("backward kept", BackwardKeptPass),
    ("partition", None),
    ("schedule", SchedulePass),
    ("emit", None),
)


def _passes(first: str, last: str) -> tuple[type, ...]:
    """The passes of the stages from `first` to `last`, both included, in order."""
    names = [name for name, _ in STAGES]
    return tuple(p for _, p in STAGES[names.index(first) : names.index(last) + 1] if p is not None)


# TORCH_LOGS="torch_hca" (INFO): one sentence per compiled graph saying which parallelism runs.
log = logging.getLogger(__name__)


def _figures(report: GraphReport) -> str:
    """Which cost-model figures chose the layout, and where they came from (when measured)."""
    figures, source = report.layout.cost_model, report.layout.cost_model_source
    if not figures:
        return ""
    return (
        f"; cost model: {source}: compute {figures['flops_per_s'] / 1e9:.3g} GFLOP/s, "
        f"links {figures['bytes_per_s'] / 1e9:.3g} GB/s"
    )


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any], options: Options) -> Callable:
    agreement = InputAgreement(gm, f"graph {next_graph_index()}", options.input_check)
    uneven = uneven_shares(gm)
    if uneven is not None:  # cut by shares: see torch_hca.compiler.checks.uneven
        check_sizes_only_shape(gm)
        drop_whole_slices(gm)
        asked_check, options = options.check, uneven_options(options)
    logical = _copy(gm) if options.check else None
    if options.layout == "tune":
        device_type = _device_type(gm)
        candidates, failed = _tune_candidates(gm, example_inputs, options, device_type)
        tuned = Tuned(candidates, options.tune_rounds, device_type, failed, options.costs(device_type))
        compiled, report_of, communicates = tuned, lambda: tuned.report, True
        agreement.draws = candidates[0].report.random_draws if candidates else []
    else:
        report = new_graph_report(options)
        if uneven is not None:
            report.uneven = uneven
            if asked_check:
                report.refinement_skipped = "uneven shares: no rank traced the whole's sizes (docs/heterogeneous.md)"
        ctx, gm = lay_out(gm, example_inputs, report)
        agreement.draws = report.random_draws
        if log.isEnabledFor(logging.INFO):
            log.info("hca %s", textwrap.fill(sentence(report) + _figures(report), 120, subsequent_indent="    "))
        if options.inner == "dtensor":
            return _agreed(gm.forward, agreement)
        compiled = lower(gm, example_inputs, ctx)
        forward = report.forward if report.forward is not None else gm
        report_of, communicates = (lambda: report), any(n.target in OPS for n in forward.graph.nodes)
    if logical is not None:
        compiled = _refinement_checked(compiled, logical, report_of)
    # The refinement check runs the backward (and its collectives) inside the first call: check first.
    return _agreed(compiled, agreement, logical is not None or communicates)


def _tune_candidates(
    gm: fx.GraphModule, example_inputs: list[Any], options: Options, device_type: str
) -> tuple[list[Candidate], list[str]]:
    """Each distinct program of `tune.candidate_options`, laid out and lowered (option layout="tune"),
    and "label: why" of each that did not compile."""
    by_program: dict[str, Candidate] = {}
    failed: list[str] = []
    for label, opts in candidate_options(options, device_type):
        first = not by_program and not failed
        report = new_graph_report(opts)
        try:
            ctx, program = lay_out(_copy(gm), example_inputs, report)
            same = by_program.get(program.code)
            if same is None:
                compiled = lower(program, example_inputs, ctx)
        except HCAError as e:
            if first:  # the calibrated solve is what layout="solve" compiles: its error is the user's
                raise
            # Another layout this program cannot take (DTensor's choice under strict, say): not a candidate.
            failed.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            report.dropped = f"layout='tune': {label} failed to compile"
            continue
        if same is not None:
            same.same_as.append(label)
            report.dropped = f"layout='tune': the same DTensor program as graph {same.report.index} ({same.label})"
            continue
        by_program[program.code] = Candidate(label, report, compiled)
    return list(by_program.values()), failed


def _device_type(gm: fx.GraphModule) -> str:
    """The device type of the mesh the graph's DTensors live on ("cpu" without one)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        real = graph_arg_example(node)
        if isinstance(real, DTensor):
            return real.device_mesh.device_type
    return "cpu"


def lay_out(gm: fx.GraphModule, example_inputs: list[Any], report: GraphReport) -> tuple[PassContext, fx.GraphModule]:
    """The Dynamo graph as a DTensor program with every layout chosen (rewritten in place) under
    `report.options`, recorded in `report`."""
    ctx = PassContext(report.options, report, list(example_inputs))
    _describe_inputs(gm, report)
    report.dynamo_graph = gm
    dump(ctx, "dynamo", gm.code)
    with generators_kept(_device_type(gm)):  # probing a dropout draws nothing the step would
        for p in _passes("lift", "origins"):
            gm = run_pass(p(), gm, ctx)
            if p is LayoutPass and report.uneven is not None:
                report.weighted_means = weight_partial_means(gm, report.uneven)
    report.dtensor_program = gm
    return ctx, gm


def lower(gm: fx.GraphModule, example_inputs: list[Any], ctx: PassContext) -> Callable:
    """The laid-out DTensor program through AOTAutograd: the backward derived and checked,
    collectives scheduled, forward and backward emitted; the compiled function."""
    report, options = ctx.report, ctx.options
    report.staged = options.staging == "on" or (options.staging == "auto" and devices_mixed())

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        # The backward is checked as traced, then every later change must be an identity.
        agree = agree_across_ranks if options.rank_rewrites else no_rank_rewrites
        made = {CollectiveRewritePass: lambda: CollectiveRewritePass(agree)}
        for p in _passes("transpose", "backward kept"):
            joint = run_pass(made.get(p, p)(), joint, ctx)
        report.joint = joint
        forward, backward = default_partition(report.joint, joint_inputs, **kwargs)
        if removed := without_unread_collectives(backward):
            log.debug(
                "graph %d: the partition's unread copies of forward collectives removed from the backward: %s",
                report.index,
                ", ".join(removed),
            )
        return forward, without_dead_draws(backward, f"graph {report.index}")

    def forward_compiler(fw: fx.GraphModule, inputs):
        if report.uneven is not None:
            check_forward_collectives(fw, report.uneven)
        report.forward = run_pass(SchedulePass("forward"), fw, ctx)
        _record_collectives(report, fw, "forward")
        compiled = emit(report.forward, inputs, options.inner, staged=report.staged)
        return _checked_first_run(
            compiled,
            report.schedules["forward"],
            f"graph {report.index} forward",
            _call_times(report, "forward"),
        )

    def backward_compiler(bw: fx.GraphModule, inputs):
        report.backward = run_pass(SchedulePass("backward"), bw, ctx)
        _record_collectives(report, bw, "backward")
        compiled = emit(report.backward, inputs, options.inner, is_backward=True, staged=report.staged)
        return _checked_first_run(
            compiled,
            report.schedules["backward"],
            f"graph {report.index} backward",
            _call_times(report, "backward"),
        )

    def inference_compiler(fw: fx.GraphModule, inputs):
        report.inference = True
        return forward_compiler(fw, inputs)

    # Random draws under Inductor: decomposed as aten's kernels, as one device's eager program
    # draws them (emit compiles each graph that draws under the same flag).
    with inductor_random_as_eager() if report.random_draws else contextlib.nullcontext():
        table = decompositions(options.inner)
    compiler = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=backward_compiler,
        inference_compiler=inference_compiler,
        partition_fn=partition,
        decompositions=table,
    )
    try:
        with no_donated_buffers():  # see there: a silent wrong gradient under Inductor otherwise
            compiled = compiler(gm, example_inputs)
    except HCAError:
        raise
    except Exception as e:
        if _has_symbolic_shapes(gm):
            raise UnsupportedError(
                f"backend 'hca': tracing graph {report.index} with dynamic shapes failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}); DTensor cannot shard some ops under symbolic sizes in "
                "this torch: compile with torch.compile(..., dynamic=False) to recompile per shape"
            ) from e
        failure = dtensor_failure(gm, e, report.index)  # an op DTensor has no rule for, named
        if failure is not None:
            raise failure from e
        raise
    _dump_tables(ctx)
    return compiled


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph as Dynamo traced it, for the logical program or a candidate of layout="tune"
    (the passes rewrite theirs in place)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copied = fx.GraphModule(gm, graph)
    copied.meta = dict(gm.meta)
    return copied


def _agreed(compiled: Callable, agreement: InputAgreement, forward_communicates: bool = True) -> Callable:
    """`compiled`, whose result is returned only once every rank agrees on the program and its
    inputs (torch_hca.compiler.checks.agreement). A forward that issues no collective cannot hang on a
    mismatch, so it runs while the peers' posts arrive; one that does runs after the check."""

    def run(*args):
        verify = agreement.post(args)
        if verify is None:
            return compiled(*args)
        if forward_communicates:
            verify()
            return compiled(*args)
        out = compiled(*args)
        verify()  # raises before anyone sees `out`: no gradient or update comes of a mismatch
        return out

    return run


def _refinement_checked(compiled: Callable, logical: fx.GraphModule, report_of: Callable[[], GraphReport]) -> Callable:
    """`compiled`, checked against the logical program on its first call (option ``check``);
    `report_of()` is the report of the program that ran (with layout="tune", the one kept)."""
    pending = [True]

    def run(*args):
        if pending:
            pending.clear()
            errors = check_refinement(logical, compiled, list(args), f"refinement check, graph {report_of().index}")
            report_of().refinement = errors
        return compiled(*args)

    return run


def _checked_first_run(
    compiled: Callable, schedule: dict[str, Any], what: str, times: collections.deque | None
) -> Callable:
    """`compiled`, checking on its first call that every rank issues the same collectives,
    and keeping the wall time of each later call in `times` (`CompileReport.measured`; None:
    not timed, as on CUDA, whose calls return before their kernels finish).

    ``schedule`` is the schedule pass's record of the graph; its ``per_group`` (each group's
    collectives in issue order) is what the ranks compare, and ``per_rank`` is set to what each
    member of each group posted (the strategy file's per-rank orders). The first call is not
    timed: it compiles (Inductor) and checks.
    """
    pending = [True]

    def run(args):
        if pending:
            schedule["per_rank"] = check_same_collectives(schedule["per_group"], what)
            pending.clear()
            return compiled(args)
        if times is None:
            return compiled(args)
        t0 = time.perf_counter()
        out = compiled(args)
        times.append(time.perf_counter() - t0)
        return out

    run._boxed_call = True  # AOTAutograd's calling convention: one list of arguments
    return run


def _call_times(report: GraphReport, which: str) -> collections.deque | None:
    """Where the calls of `report`'s `which` graph are timed: CPU meshes only."""
    return report.call_times[which] if (report.mesh or {}).get("device_type", "cpu") == "cpu" else None


def _has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("example_value")
        if isinstance(val, torch.SymInt) or (
            isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in val.shape)
        ):
            return True
    return False


def _dump_tables(ctx: PassContext) -> None:
    """The collectives table, the report and this graph's strategy file, next to the graphs, in debug mode.

    ``graph{N}_strategy.json`` is a strategy file of this graph alone (docs/strategy.md): `hca.verify`
    reads it, and ``options={"strategy": path}`` loads it for a module compiled as one graph."""
    if ctx.options.debug_dir:
        rep = CompileReport([ctx.report])
        dump(ctx, "collectives", rep.table() + "\n", suffix="txt")
        dump(ctx, "report", rep.to_json() + "\n", suffix="json")
        if strategy_file.laid_out(ctx.report):
            text = json.dumps(strategy_file.build(rep), indent=1, sort_keys=True)
            dump(ctx, "strategy", text + "\n", suffix="json")


def _describe_inputs(gm: fx.GraphModule, report: GraphReport) -> None:
    """Name the parameters the graph reads and note the mesh."""
    for node in gm.graph.find_nodes(op="placeholder"):
        real = graph_arg_example(node)
        if isinstance(real, torch.nn.Parameter):  # lets hca.report find the module's graphs
            report.add_parameter(real)
        if not isinstance(real, DTensor):
            continue
        if report.mesh is None:
            mesh = real.device_mesh
            report.mesh = {
                "shape": list(mesh.shape),
                "names": list(mesh.mesh_dim_names or ()),
                "device_type": mesh.device_type,
            }
        name = parameter_name(real)
        if name is not None:
            report.parameters[name] = {
                "shape": list(real.shape),
                "dtype": dtype_str(real.dtype),
                "placements": layout_str(real.placements),
                "graph_input": node.name,
            }


def _record_collectives(report: GraphReport, gm: fx.GraphModule, direction: str) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in OPS:
            continue
        info = OPS[node.target]
        vals = node_payload(node)
        group = node_group(node)
        n = group_size(group)
        payload = size_hint(payload_bytes(node))  # the example's sizes, where they are symbolic
        report.collectives.append(
            CollectiveRecord(
                kind=info.kind.value,
                group=group,
                group_size=n,
                bytes=payload,
                wire_bytes=RULES[info.kind].wire_bytes(payload, n),
                direction=direction,
                node=node.name,
                dtype=str(vals[0].dtype),
                shape=tuple(size_hint(s) for s in vals[0].shape),
                partner=node.meta.get(PARTNER),
                rule="; ".join(
                    filter(
                        None, [node.meta.get(RULE, ""), node.meta.get(REWRITE) and f"rewritten by {node.meta[REWRITE]}"]
                    )
                ),
            )
        )
