"""Transpose pass: pair each backward collective with the forward one it transposes.

Reads the AOTAutograd joint graph. A node is backward when it depends on a
tangent. Each backward collective is matched, latest first, with an unpaired
forward collective of the same group and payload whose transpose
(`collective_kinds.RULES`) is its kind. The pairing and the rule are stored in
``node.meta`` so they survive partitioning into the report's table. This
version records; it does not yet rewrite.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from torch_hca.collective_kinds import OPS, RULES, WAIT, Kind, node_payload
from torch_hca.errors import CheckError

from .infra import PassContext, PassResult

PARTNER, RULE = "hca_partner", "hca_rule"


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Every node that depends on a tangent input."""
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(a in seen for a in node.all_input_nodes):
            seen.add(node)
    return seen


def payload_key(node: fx.Node) -> tuple:
    vals = node_payload(node)
    numel = sum(v.numel() for v in vals) if all(hasattr(v, "numel") for v in vals) else None
    return node.args[OPS[node.target].group_arg], numel


class TransposePass:
    name = "transpose"
    reads = "joint forward+backward graph (local tensors, _c10d_functional)"
    writes = "the same graph, each collective annotated with its partner and rule"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        backward = backward_nodes(gm.graph)
        colls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in OPS]
        forward = [n for n in colls if n not in backward]
        decisions = []
        for bw in (n for n in colls if n in backward):
            kind = OPS[bw.target].kind
            if kind is Kind.ALL_REDUCE:
                # Not a transpose: all_reduce's transpose (R -> P) moves nothing. A backward
                # all_reduce is the eager role's reduction of a replicated value's cotangent.
                bw.meta[RULE] = "cotangent reduction: partial cotangent of a replicated value, P -> R (eager role)"
                decisions.append(f"{bw.name}: {bw.meta[RULE]}")
                continue
            emulated = kind is Kind.ALL_GATHER and _emulates_all_to_all(bw)
            match = next(
                (fw for fw in reversed(forward)
                 if PARTNER not in fw.meta and _same_payload(fw, bw)
                 and (RULES[OPS[fw.target].kind].transpose == kind and not _emulates_all_to_all(fw)
                      or emulated and OPS[fw.target].kind is Kind.ALL_GATHER and _emulates_all_to_all(fw))),
                None,
            )
            chunk = _local_chunk_of(gm.graph, backward, bw) if match is None and kind is Kind.ALL_GATHER else None
            if match is not None:
                match.meta[PARTNER], bw.meta[PARTNER] = bw.name, match.name
                match.meta[RULE] = f"{OPS[match.target].kind.value}; transposed by {bw.name}"
                bw.meta[RULE] = f"transpose of {match.name} ({OPS[match.target].kind.value})"
            elif chunk is not None:
                # R -> S(d) in forward is a local chunk; its transpose is a zero-embed S -> P,
                # and the replicated input's cotangent must then be summed: together, S -> R.
                bw.meta[PARTNER] = chunk.name
                bw.meta[RULE] = f"transpose of local chunk {chunk.name} (R -> S): zero-embed then sum, as one all_gather"
            else:
                bw.meta[RULE] = "backward collective with no forward partner"
                if ctx.options.strict:
                    raise CheckError(
                        f"transpose pass: backward {kind.value} {bw.name} transposes no forward "
                        "collective (strict mode)"
                    )
            decisions.append(f"{bw.name}: {bw.meta[RULE]}")
        for fw in forward:
            if PARTNER not in fw.meta:
                kind = OPS[fw.target].kind
                fw.meta[RULE] = (
                    "P -> R; its transpose R -> P needs no communication"
                    if kind is Kind.ALL_REDUCE else f"{RULES[kind].placements}; no backward partner"
                )
                decisions.append(f"{fw.name}: {fw.meta[RULE]}")
        return PassResult(gm, False, decisions)


def _emulates_all_to_all(gather: fx.Node) -> bool:
    """An all_gather re-cut to this rank's piece of another dim: DTensor's all_to_all on gloo.

    Gloo has no all_to_all, so DTensor moves S(a) -> S(b) as all_gather + split
    + cat; its transpose S(b) -> S(a) is the same construction.
    """
    name = lambda n: getattr(n.target, "__name__", "")
    # Follow the gathered buffer through split / getitem / cat / clone; a split of which
    # only one piece is read keeps this rank's shard of another dim: an all_to_all.
    frontier, seen = list(gather.users), set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if name(node).startswith("split"):
            pieces = node.meta.get("val")
            if isinstance(pieces, (list, tuple)) and len(pieces) > 1 and len(node.users) == 1:
                return True
        if node.target is WAIT or name(node).startswith(("split", "cat", "clone")) or node.target is operator.getitem:
            frontier.extend(node.users)
    return False


# Forward ops DTensor uses to take this rank's shard of a replicated value.
_CHUNKS = {"split", "split_with_sizes", "chunk", "slice", "narrow"}


def _local_chunk_of(graph: fx.Graph, backward: set[fx.Node], gather: fx.Node) -> fx.Node | None:
    """A forward chunk whose piece is the size of what `gather` collects from this rank."""
    shard = gather.args[0].meta.get("val") if isinstance(gather.args[0], fx.Node) else None
    if shard is None:
        return None
    for node in graph.nodes:
        if node in backward or node.op != "call_function" or getattr(node.target, "__name__", "").split(".")[0] not in _CHUNKS:
            continue
        vals = node.meta.get("val")
        vals = vals if isinstance(vals, (list, tuple)) else [vals]
        if any(getattr(v, "shape", None) == shard.shape for v in vals):
            return node
    return None


def _same_payload(fw: fx.Node, bw: fx.Node) -> bool:
    (g1, n1), (g2, n2) = payload_key(fw), payload_key(bw)
    return g1 == g2 and n1 == n2
