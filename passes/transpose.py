"""Transpose pass: each backward collective looked up as the transpose of the move it belongs to.

Reads the AOTAutograd joint graph as traced. A node is backward when it
depends on a tangent. Every collective carries the origin tag of the DTensor
program node it came from (passes/origins.py): the move whose forward issued it,
or whose backward it belongs to. For each backward collective the pass

1. checks the move table allows its kind in the backward of its origin on its
   mesh dimension (`Origin.backward_kinds`, from `collective_kinds.backward_kinds`);
2. pairs it with the latest unpaired forward collective of the same origin,
   group and element count whose transpose (`collective_kinds.RULES`) it is;
   a backward collective with no forward partner is the transpose of a local
   step of its origin (R -> S) or the sum of a replicated value's partial
   cotangent, which the table also says.

A backward collective with no origin, or one the table does not allow, is
unproven: an error under ``strict``. The pairing and the rule go to
``node.meta`` (the report's collectives table); what the backward owes (each
collective's kind, group, size, origin and inputs) is recorded, so that
`BackwardKeptPass` can check later passes kept it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch.fx as fx
from torch.utils._pytree import tree_leaves

from torch_hca._torch_private import origin_of
from torch_hca.spmd.collective_kinds import RULES, Kind
from torch_hca.spmd.collective_nodes import OPS, WAIT, node_group, node_kind, node_payload
from torch_hca.errors import CheckError

from .rewrite_rules import REWRITE
from .infra import PassContext, PassResult
from .origins import Origin, Origins

PARTNER, RULE = "hca_partner", "hca_rule"


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Every node that depends on a tangent input."""
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            a in seen for a in node.all_input_nodes
        ):
            seen.add(node)
    return seen


def collectives(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in OPS]


def numel_of(node: fx.Node) -> int | None:
    vals = node_payload(node)
    return sum(v.numel() for v in vals) if all(hasattr(v, "numel") for v in vals) else None


@dataclass(frozen=True)
class Owed:
    """One backward collective as derived: what every later pass must keep (or rewrite by an identity)."""

    node: str
    kind: Kind
    group: str
    numel: int | None
    origin: str | None
    inputs: tuple[str, ...]  # what it reduces or moves
    readers: tuple[str, ...]  # who reads its result (through its wait), as node@argument

    @staticmethod
    def of(node: fx.Node) -> "Owed":
        waits = [w for w in node.users if w.target is WAIT] or [node]
        readers = sorted(
            f"{r.name}@{i}"
            for w in waits
            for r in w.users
            for i, a in enumerate(tree_leaves((r.args, r.kwargs)))
            if a is w
        )
        return Owed(
            node.name,
            node_kind(node),
            node_group(node),
            numel_of(node),
            origin_of(node),
            tuple(a.name for a in node.all_input_nodes),
            tuple(readers),
        )

    def differences(self, now: "Owed", names: set[str]) -> list[str]:
        """What changed from `self` to `now`; readers only where no rewrite replaced one (`names`: the graph's nodes)."""
        fields = ["kind", "group", "numel", "origin", "inputs"]
        graph_names = lambda readers: {r.rpartition("@")[0] for r in readers}
        if graph_names(self.readers) <= names and graph_names(now.readers) <= names:
            fields.append("readers")
        show = lambda v: v.value if isinstance(v, Kind) else v
        return [
            f"{f} {show(getattr(self, f))} -> {show(getattr(now, f))}"
            for f in fields
            if getattr(self, f) != getattr(now, f)
        ]


def _unproven(ctx: PassContext, node: fx.Node, why: str) -> str:
    message = f"transpose pass: backward {node_kind(node).value} {node.name} is unproven: {why}"
    if ctx.options.strict:
        raise CheckError(message + " (strict mode)")
    return message


def _allowed(origin: Origin, dim: int | None, forward: list[fx.Node]) -> set[Kind]:
    """The kinds the backward of `origin` may issue on one group.

    By the move table for a node of the DTensor program; for per-rank code (an
    hca.collectives call, whose backward `torch_hca.api.collectives` derived from
    the same table) the transposes of what its forward issued on that group.
    """
    if origin.local_view:
        return {RULES[node_kind(fw)].transpose for fw in forward}
    return origin.backward_kinds(dim)


def _transposes(fw: fx.Node, origin: Origin, dim: int | None) -> set[Kind]:
    """The kinds that transpose forward collective `fw` of `origin`."""
    kinds = {RULES[node_kind(fw)].transpose}
    if node_kind(fw) is Kind.ALL_GATHER and dim is not None and Kind.ALL_TO_ALL in origin.forward_kinds(dim):
        kinds.add(Kind.ALL_GATHER)  # gloo: all_to_all as all_gather + keep a piece, both ways
    return kinds


def _unpaired_rule(kind: Kind, origin: Origin, dim: int | None) -> str:
    steps = origin.transition(dim) if dim is not None and not origin.local_view else []
    if kind is Kind.ALL_REDUCE and any(dst == "P" for _, dst in steps):
        return f"cotangent reduction for {origin.describe(dim)}: the partial cotangent of its partial result, summed"
    if kind is Kind.ALL_REDUCE and any(src == "R" for src, _ in steps):
        return (
            f"cotangent reduction for {origin.describe(dim)}: the partial cotangents of a value it reads, "
            f"replicated over {origin.dim_label(dim)}, summed"
        )
    if kind is Kind.ALL_GATHER and any(src == "R" and dst.startswith("S") for src, dst in steps):
        return (
            f"transpose of the local chunk (R -> S) in {origin.describe(dim)}: zero-embed, then sum, as one all_gather"
        )
    return f"backward of {origin.describe(dim)}, as the move table allows"


class TransposePass:
    name = "transpose"
    reads = "joint forward+backward graph as traced (local tensors, _c10d_functional, origin tags)"
    writes = "the same graph, each collective labelled with its origin, partner and rule"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        origins: Origins = ctx.origins or Origins()
        backward = backward_nodes(gm.graph)
        colls = collectives(gm.graph)
        by_origin: dict[str, list[fx.Node]] = {}
        decisions = []
        for fw in (n for n in colls if n not in backward):
            origin = origins.get(origin_of(fw))
            by_origin.setdefault(origin.name if origin else "", []).append(fw)
            dim = origins.dims.get(node_group(fw))
            fw.meta[RULE] = (
                f"{node_kind(fw).value} of {origin.describe(dim)}"
                if origin
                else f"{node_kind(fw).value} with no origin tag"
            )
        for bw in (n for n in colls if n in backward):
            kind, origin, dim = node_kind(bw), origins.get(origin_of(bw)), origins.dims.get(node_group(bw))
            forward = [
                fw for fw in by_origin.get(origin.name if origin else "", []) if node_group(fw) == node_group(bw)
            ]
            if origin is None:
                bw.meta[RULE] = _unproven(ctx, bw, "it carries no origin tag")
            elif not origin.local_view and dim is None:
                bw.meta[RULE] = _unproven(ctx, bw, f"its group {node_group(bw)} is no mesh dimension")
            elif kind not in (allowed := _allowed(origin, dim, forward)):
                names = ", ".join(sorted(k.value for k in allowed)) or "nothing"
                bw.meta[RULE] = _unproven(
                    ctx, bw, f"only {names} may transpose {origin.describe(dim)} on group {node_group(bw)}"
                )
            else:
                partner = next(
                    (
                        fw
                        for fw in reversed(forward)
                        if PARTNER not in fw.meta
                        and numel_of(fw) == numel_of(bw)
                        and kind in _transposes(fw, origin, dim)
                    ),
                    None,
                )
                if partner is not None:
                    partner.meta[PARTNER], bw.meta[PARTNER] = bw.name, partner.name
                    partner.meta[RULE] += f"; transposed by {bw.name}"
                    bw.meta[RULE] = f"transpose of {partner.name} ({node_kind(partner).value} of {origin.name})"
                else:
                    bw.meta[RULE] = _unpaired_rule(kind, origin, dim)
            decisions.append(f"{bw.name}: {bw.meta[RULE]}")
        ctx.owed = [Owed.of(n) for n in colls if n in backward]
        for move in ctx.report.redistributions:  # what each move issued, next to what the solver costed
            issued = [
                f"{node_kind(fw).value}@{origins.dims.get(node_group(fw), '?')}" for fw in by_origin.get(move.node, [])
            ]
            move.emitted = ", ".join(issued) or "local"
        for fw in (n for n in colls if n not in backward and PARTNER not in n.meta):
            fw.meta[RULE] += "; no backward collective transposes it"
            decisions.append(f"{fw.name}: {fw.meta[RULE]}")
        return PassResult(gm, False, decisions)


class BackwardKeptPass:
    """Check the passes after tracing kept every backward collective the transpose pass derived.

    A collective may only disappear or appear through a collective rewrite (an
    identity); otherwise each keeps its kind, group, size, origin and inputs,
    and each group's order. A difference is an error under ``strict``, else a warning.
    """

    name = "backward_kept"
    reads = "joint graph after the collective rewrites"
    writes = "nothing; labels rewritten collectives"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.owed is None:
            return PassResult(gm, False, ["nothing derived to check"])
        backward = backward_nodes(gm.graph)
        now = [n for n in collectives(gm.graph) if n in backward]
        for n in now:
            if REWRITE in n.meta:
                n.meta[RULE] = f"rewritten by {n.meta[REWRITE]}" + (f"; was {n.meta[RULE]}" if RULE in n.meta else "")
        then = {o.node: o for o in ctx.owed}
        kept = {n.name: Owed.of(n) for n in now if REWRITE not in n.meta}
        problems = [
            f"{name} ({then[name].kind.value} of {then[name].origin}) was dropped"
            for name in then
            if name not in kept and name not in ctx.rewritten
        ]
        problems += [
            f"{name} ({o.kind.value} of {o.origin}) is extra: no move's backward derived it"
            for name, o in kept.items()
            if name not in then
        ]
        names = {n.name for n in gm.graph.nodes if REWRITE not in n.meta}
        problems += [
            f"{name} changed: {', '.join(d)}"
            for name, o in kept.items()
            if name in then and (d := then[name].differences(o, names))
        ]
        for group in {o.group for o in then.values()}:
            order = [o.node for o in ctx.owed if o.group == group and o.node in kept and kept[o.node].group == group]
            issued = [
                name for name, o in kept.items() if o.group == group and name in then and then[name].group == group
            ]
            if order != issued:
                first = next(a for a, b in zip(issued, order) if a != b)
                problems.append(f"{first} was reordered on group {group}: derived order {order}, now {issued}")
        if problems:
            message = f"backward check: {len(problems)} difference(s) from the derived backward: " + "; ".join(problems)
            if ctx.options.strict:
                raise CheckError(message + " (strict mode)")
            warnings.warn(message, stacklevel=2)
        return PassResult(gm, False, problems or [f"{len(then)} backward collectives kept"])
