"""Layout pass: a placement for every value, chosen globally, every move an explicit node.

With ``layout="solve"`` (the default) the layout solver
(`torch_hca.compiler.layout.solver`) picks each op's input and output layouts for the
whole graph at once, by cost; the pass inserts a `dtensor_ops.redistribute`
node wherever a value is read in another layout than it was written in.
With ``layout="dtensor"`` DTensor's own per-op choices are kept.

Every rank solves, and every rank keeps rank 0's choice (`layout_solver.solve`).

Either way the pass then runs the program on the fake DTensors Dynamo traced
with and watches for any redistribution DTensor would still do on its own:
each becomes an explicit node too and is listed in the report (after the
solver there should be none: a test checks). Whatever cannot be made
explicit (a move inside a composite op) is reported, and is an error under
``strict``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from torch_hca.compiler import dtensor_ops
from torch_hca.compiler.layout import candidates as layout_candidates
from torch_hca.compiler.layout.probes import call_node
from torch_hca.compiler.layout import solver as layout_solver
from torch_hca.compiler.layout.move_costs import Costs
from torch_hca._torch_private import (
    RedistributionEvent,
    fake_dtensor_work,
    graph_arg_example,
    is_mask_partial,
    mask_buffer_states,
    record_implicit_redistributions,
)
from torch_hca.spmd.collective_kinds import move_kind
from torch_hca.spmd.placements import dtype_str, layout_str, letter
from torch_hca.errors import StrategyError, UnsupportedError
from torch_hca.compiler.parameters import parameter_name
from torch_hca.report.records import Redistribution
from torch_hca.report.layout_record import LayoutRecord
from torch_hca.report import strategy_file, strategy_replay

from .infra import PassContext, PassResult


def _execute(gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    return call_node(gm, node, args, kwargs)


def _attribute(node: fx.Node, env, events: list[RedistributionEvent]) -> dict[fx.Node, tuple]:
    """Map each event to the graph input of `node` it moved, where that is unambiguous."""
    inputs = [n for n in node.all_input_nodes if isinstance(env.get(n), DTensor)]
    moves: dict[fx.Node, tuple] = {}
    for e in events:
        hits = [n for n in inputs if env[n]._spec == e.src]
        if len(hits) == 1 and hits[0] not in moves:
            moves[hits[0]] = tuple(e.dst.placements)
    return moves


def _describe(e: RedistributionEvent) -> str:
    return f"{e.op} argument {e.arg_index}: {layout_str(e.src.placements)} -> {layout_str(e.dst.placements)}"


def _value_meta(v: Any) -> dict[str, Any] | None:
    if isinstance(v, DTensor):
        return {"shape": list(v.shape), "dtype": dtype_str(v.dtype), "placements": layout_str(v.placements)}
    return None


def _as_written_s(ops, costs, memory_weight: float) -> float:
    return layout_solver.total_cost(ops, costs, layout_solver.as_written(ops, memory_weight), memory_weight)


class LayoutPass:
    name = "layout"
    reads = "Dynamo graph over DTensors"
    writes = "DTensor program: every redistribution an explicit node"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        placeholders = gm.graph.find_nodes(op="placeholder")
        facts = strategy_file.graph_facts(gm, _mesh_of(gm))  # before the graph changes (docs/strategy.md)
        loaded = self._loaded(gm, ctx, facts) if ctx.options.strategy else None
        with fake_dtensor_work([n.meta.get("example_value") for n in placeholders]):
            if loaded is not None:
                decisions = self._replay(gm, ctx, loaded)
            else:
                decisions = self._solve(gm, ctx) if ctx.options.layout == "solve" else []
            implicit = self._rewrite(gm, ctx)
        if loaded is not None:
            strategy_replay.check_replayed(
                loaded, ctx.report.values, ctx.report.redistributions, f"graph {ctx.report.index}"
            )
        elif ctx.options.layout == "dtensor":
            ctx.report.layout = LayoutRecord("none (DTensor's per-op choices)")
        # After the solver, a move DTensor still wanted means a strategy it mis-predicted.
        ctx.report.layout.left_to_dtensor = implicit
        ctx.report.layout.strategy_facts = facts
        return PassResult(gm, bool(decisions or implicit), decisions + implicit)

    def _solve(self, gm: fx.GraphModule, ctx: PassContext) -> list[str]:
        """Choose every op's layouts with the solver and insert the moves it implies."""
        mesh = _mesh_of(gm)
        if mesh is None:
            ctx.report.layout = LayoutRecord("none (no DTensor in the graph)")
            return []
        symbolic = _symbolic_value(gm)
        if symbolic is not None:
            # Divisibility of a symbolic size is unknown: keep DTensor's choices.
            ctx.report.layout = LayoutRecord(
                f"none (dynamic shapes: {symbolic} has a symbolic size; DTensor's per-op choices kept)"
            )
            return []
        model, source = ctx.options.costs_and_source(mesh.device_type)
        start = time.perf_counter()
        try:
            ops = layout_candidates.build_ops(gm, mesh, model, _storage_of)
        except UnsupportedError as e:
            if ctx.options.strict:
                raise
            ctx.report.layout = LayoutRecord(f"none ({e}); DTensor's per-op choices kept")
            return []
        o = ctx.options
        solution_start = time.perf_counter()
        solution = layout_solver.solve(
            ops,
            Costs(mesh, model),
            memory_weight=o.memory_weight,
            memory_budget=None if o.memory_budget is None else o.memory_budget,
            time_limit_s=o.solver_time_limit_s,
        )
        ctx.report.layout = LayoutRecord(
            solution.solver,
            status=solution.status,
            objective_s=solution.objective_s,
            bound_s=solution.bound_s,
            seconds=solution.seconds,
            cost_model=model.as_dict(),
            cost_model_source=source,
            strategies=sum(len(op.strategies) for op in ops),
            values=solution.explain,
            probe_seconds=solution_start - start,
            # The user's layouts kept (no move where DTensor's rules run an op): the alternative
            # the one-sentence summary names, priced by the same model.
            as_written_s=_as_written_s(ops, Costs(mesh, model), o.memory_weight),
        )
        return self._emit(gm, ctx, ops, solution)

    @staticmethod
    def _loaded(gm: fx.GraphModule, ctx: PassContext, facts: dict) -> dict:
        """This graph's entry of the strategy file, checked against this model, mesh and world size."""
        mesh = _mesh_of(gm)
        data = strategy_replay.load(ctx.options.strategy)
        return strategy_replay.match_graph(
            data,
            facts,
            list(mesh.shape) if mesh is not None else [1],
            ctx.report.parameters,
            f"graph {ctx.report.index}",
            shares=strategy_file.shares_entry(ctx.report),
        )

    def _replay(self, gm: fx.GraphModule, ctx: PassContext, entry: dict) -> list[str]:
        """The strategy file's moves inserted as the solver would have (no probing, no solve)."""
        start = time.perf_counter()
        nodes = {n.name: n for n in gm.graph.nodes}
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        decisions = []
        for value, before, layout, readers in strategy_replay.moves_to_replay(entry):
            src, users = nodes.get(value), [nodes.get(r) for r in readers]
            if src is None or None in users or not users:
                raise StrategyError(
                    f"strategy file: graph {ctx.report.index}: a move of {value!r} read by {readers} names a node this "
                    "program lacks (hand-edited, or another torch)"
                )
            first = min(users, key=order.__getitem__)
            with gm.graph.inserting_before(first):
                node = gm.graph.call_function(dtensor_ops.redistribute, (src, layout))
            for user in users:
                user.replace_input_with(src, node)
            _inherit_source(node, first)
            self._record(ctx, node, src, before, layout, f"{first.name} reads it so (strategy file)")
            decisions.append(f"{node.name}: {src.name} -> {layout_str(layout)} for {first.name} (strategy file)")
        priced = entry.get("cost_model") or {}  # the figures the file's layout was priced with
        ctx.report.layout = LayoutRecord(
            f"strategy file {ctx.options.strategy}",
            seconds=0.0,
            probe_seconds=0.0,
            replay_seconds=time.perf_counter() - start,
            cost_model=priced.get("figures"),
            cost_model_source=priced.get("source"),
        )
        return decisions

    def _emit(self, gm: fx.GraphModule, ctx: PassContext, ops, solution) -> list[str]:
        """One explicit redistribute per (value, layout) read, before its first reader."""
        graph = gm.graph
        moved: dict[tuple[fx.Node, tuple], fx.Node] = {}
        decisions = []
        for op in ops:
            if op.fixed and not (op.node.op == "call_function" and op.node.target in layout_candidates.FIXED_READS):
                continue  # a parameter, an input, or the user's own redistribute
            chosen = solution.choice[op.node]
            for src, layout in zip(op.slots, chosen.inputs):
                written = solution.choice[src].output  # every DTensor value is an op of the solve
                if written == layout:
                    continue
                if (src, layout) not in moved:
                    with graph.inserting_before(op.node):
                        moved[src, layout] = graph.call_function(dtensor_ops.redistribute, (src, layout))
                    node = moved[src, layout]
                    _inherit_source(node, op.node)
                    self._record(ctx, node, src, written, layout, f"{op.node.name} reads it so (layout solver)")
                    decisions.append(
                        f"{node.name}: {src.name} {layout_str(written)} -> {layout_str(layout)} for {op.node.name}"
                    )
                op.node.replace_input_with(src, moved[src, layout])
        return decisions

    def _rewrite(self, gm: fx.GraphModule, ctx: PassContext) -> list[str]:
        env: dict[fx.Node, Any] = {}
        inputs = iter(ctx.example_inputs)
        decisions: list[str] = []
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op == "placeholder":
                # Dynamo's fake value for the input: no real data moves here.
                real = next(inputs)
                env[node] = node.meta.get("example_value", real)
                continue
            if node.op == "output":
                break
            restore_masks = mask_buffer_states(env.get(n) for n in node.all_input_nodes)
            with record_implicit_redistributions() as events:
                value = _execute(gm, node, env)
            # DTensor masks a vocabulary-sharded embedding's indices (R -> _MaskPartial) inside the
            # op, with a placement object the op itself makes: no explicit move can stand for it.
            if events and not any(is_mask_partial(p) for e in events for p in e.dst.placements):
                restore_masks()  # the moves below reduce the same masked partials again
                moves = _attribute(node, env, events)
                for src, placements in moves.items():
                    with graph.inserting_before(node):
                        moved = graph.call_function(dtensor_ops.redistribute, (src, placements))
                    node.replace_input_with(src, moved)
                    env[moved] = moved.meta["example_value"] = dtensor_ops.redistribute(env[src], placements)
                    _inherit_source(moved, node)
                    moved.meta["hca_layout"] = ctx.report.values[moved.name] = _value_meta(env[moved])
                    self._record(ctx, moved, src, env[src].placements, placements, f"{node.name} needs it")
                    decisions.append(
                        f"{moved.name}: {src.name} {layout_str(env[src].placements)} -> {layout_str(placements)} for {node.name}"
                    )
                with record_implicit_redistributions() as events:
                    value = _execute(gm, node, env)
            elif not events and node.op == "call_method" and node.target == "redistribute":
                self._record(
                    ctx,
                    node,
                    node.args[0],
                    env[node.args[0]].placements,
                    tuple(value.placements),
                    "explicit in the program",
                )
            for e in events:
                msg = f"{node.name}: {_describe(e)}"
                ctx.report.implicit_redistributions.append(msg)
                if ctx.options.strict:
                    raise UnsupportedError(
                        f"layout pass: DTensor redistributes implicitly inside {msg} "
                        f"(source: {node.meta.get('stack_trace', '?').strip().splitlines()[-1:]}); "
                        "no explicit node can express it yet"
                    )
            env[node] = node.meta["example_value"] = value  # later passes read the layouts chosen here
            meta = _value_meta(value)
            if meta is not None:
                node.meta["hca_layout"] = meta
                ctx.report.values[node.name] = meta
        return decisions

    @staticmethod
    def _record(ctx: PassContext, node: fx.Node, src: fx.Node, before, after, reason: str) -> None:
        costed = [
            f"{k.value}@{m}"
            for m, (b, a) in enumerate(zip(before, after))
            if (k := move_kind(letter(b), letter(a))) is not None
        ]
        ctx.report.redistributions.append(
            Redistribution(
                node.name, src.name, layout_str(before), layout_str(after), reason, ", ".join(costed) or "local"
            )
        )


def _inherit_source(move: fx.Node, reader: fx.Node) -> None:
    """A move inserted for `reader` reports the module and source line of the code that reads it."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in reader.meta:
            move.meta[key] = reader.meta[key]


def _storage_of(node: fx.Node):
    """A parameter's storage layout (it may be gathered, not re-sharded), else None."""
    if node.op != "placeholder":
        return None
    real = graph_arg_example(node)
    if isinstance(real, DTensor) and parameter_name(real) is not None:
        return tuple(real.placements)
    return None


def _mesh_of(gm: fx.GraphModule):
    for node in gm.graph.nodes:
        v = node.meta.get("example_value")
        if isinstance(v, DTensor):
            return v.device_mesh
    return None


def _symbolic_value(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        v = node.meta.get("example_value")
        if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
            return node.name
    return None
