"""Layout pass: every placement change in the DTensor program becomes an explicit node.

This first version keeps DTensor's own per-op choices. It runs the Dynamo
graph on the fake DTensors Dynamo traced with, watches where DTensor would
redistribute an op's argument by itself, and inserts that redistribution as
an explicit `dtensor_ops.redistribute` node before the op. Whatever remains
implicit (a move inside a composite op, on a value the graph never names) is
reported, and is an error under ``strict``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from torch_hca import dtensor_ops
from torch_hca._torch_private import RedistributionEvent, fake_mode_of, record_implicit_redistributions
from torch_hca.errors import UnsupportedError
from torch_hca.report import Redistribution, layout_str

from .infra import PassContext, PassResult


def _execute(gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return obj
    raise UnsupportedError(f"layout pass: unexpected node kind {node.op} at {node.name}")


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
        return {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""), "placements": layout_str(v.placements)}
    return None


class LayoutPass:
    name = "layout"
    reads = "Dynamo graph over DTensors"
    writes = "DTensor program: every redistribution an explicit node"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        placeholders = gm.graph.find_nodes(op="placeholder")
        fake_mode = fake_mode_of([n.meta.get("example_value") for n in placeholders])
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            decisions = self._rewrite(gm, ctx)
        return PassResult(gm, bool(decisions), decisions)

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
            with record_implicit_redistributions() as events:
                value = _execute(gm, node, env)
            if events:
                moves = _attribute(node, env, events)
                for src, placements in moves.items():
                    with graph.inserting_before(node):
                        moved = graph.call_function(dtensor_ops.redistribute, (src, placements))
                    node.replace_input_with(src, moved)
                    env[moved] = dtensor_ops.redistribute(env[src], placements)
                    moved.meta["hca_layout"] = ctx.report.values[moved.name] = _value_meta(env[moved])
                    self._record(ctx, moved, src, env[src].placements, placements, f"{node.name} needs it")
                    decisions.append(f"{moved.name}: {src.name} {layout_str(env[src].placements)} -> {layout_str(placements)} for {node.name}")
                with record_implicit_redistributions() as events:
                    value = _execute(gm, node, env)
                for e in events:
                    msg = f"{node.name}: {_describe(e)}"
                    ctx.report.implicit_redistributions.append(msg)
                    if ctx.options.strict:
                        raise UnsupportedError(
                            f"layout pass: DTensor redistributes implicitly inside {msg} "
                            f"(source: {node.meta.get('stack_trace', '?').strip().splitlines()[-1:]}); "
                            "no explicit node can express it yet"
                        )
            elif node.op == "call_method" and node.target == "redistribute":
                self._record(ctx, node, node.args[0], env[node.args[0]].placements, tuple(value.placements), "explicit in the program")
            env[node] = value
            meta = _value_meta(value)
            if meta is not None:
                node.meta["hca_layout"] = meta
                ctx.report.values[node.name] = meta
        return decisions

    @staticmethod
    def _record(ctx: PassContext, node: fx.Node, src: fx.Node, before, after, reason: str) -> None:
        ctx.report.redistributions.append(
            Redistribution(node.name, src.name, layout_str(before), layout_str(after), reason)
        )
