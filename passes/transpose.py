"""Transpose pass: pair each backward collective with the forward one it transposes.

Reads the AOTAutograd joint graph. A node is backward when it depends on a
tangent. Each backward collective is matched, latest first, with an unpaired
forward collective of the same group and payload whose transpose
(`collective_kinds.RULES`) is its kind. The pairing and the rule are stored in
``node.meta`` so they survive partitioning into the report's table. This
version records; it does not yet rewrite.
"""

from __future__ import annotations

import torch.fx as fx

from torch_hca.collective_kinds import OPS, RULES, Kind, node_payload
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
            match = next(
                (fw for fw in reversed(forward)
                 if PARTNER not in fw.meta and RULES[OPS[fw.target].kind].transpose == kind
                 and _same_payload(fw, bw)),
                None,
            )
            if match is not None:
                match.meta[PARTNER], bw.meta[PARTNER] = bw.name, match.name
                match.meta[RULE] = f"{OPS[match.target].kind.value}; transposed by {bw.name}"
                bw.meta[RULE] = f"transpose of {match.name} ({OPS[match.target].kind.value})"
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


def _same_payload(fw: fx.Node, bw: fx.Node) -> bool:
    (g1, n1), (g2, n2) = payload_key(fw), payload_key(bw)
    return g1 == g2 and n1 == n2
