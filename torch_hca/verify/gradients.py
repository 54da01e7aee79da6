"""The numerical refinement check's backward (`torch_hca.verify.numeric`): one backward from seeded
random cotangents through every rank's pieces, and each parameter's gradient, put back together as
the file stores it, against the logical program's gradient."""

from __future__ import annotations

from typing import Any

import torch

from . import pieces as P
from .rules import Problem


def check(run: Any) -> list[Problem]:
    """`run`: a `numeric._Run` whose forward ran to its outputs (`run.results`); its `compare` puts pieces back together."""
    if run.skipped or not run.leaves:
        return []
    outs, cots, whole_outs, whole_cots = [], [], [], []
    for node, parts, placements in run.results:
        logical = run.logical[node.name]
        if not logical.requires_grad or not logical.is_floating_point():
            continue
        g = torch.randn(tuple(logical.shape), dtype=logical.dtype, generator=run.gen)
        whole_outs.append(logical)
        whole_cots.append(g)
        given = [p if p.startswith(("S", "R")) else "R" for p in placements]  # a Partial's cotangent: whole
        for piece, cot in zip(parts, P.cut(g, given, run.mesh)):
            if piece.requires_grad:
                outs.append(piece)
                cots.append(cot)
    if not whole_outs:
        return []
    names = sorted(run.leaves)
    want = torch.autograd.grad(whole_outs, [run.leaves[n][0] for n in names], whole_cots, allow_unused=True)
    try:
        torch.autograd.backward(outs, cots)
    except P.NotSimulated as e:
        run.summary.skipped.append(f"{run.where} gradients ({e})")
        return []
    found = []
    for n, w in zip(names, want):
        whole, parts, v = run.leaves[n]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parts]
        placements = list(v["placements"])
        if v.get("cotangent_role") == "deferred":  # replicated here, summed later by hca.reduce_gradients
            placements = ["P(sum)" if p == "R" else p for p in placements]
        run.summary.gradients += 1
        problem = run.compare(n, grads, w if w is not None else torch.zeros_like(whole), placements, "gradient")
        if problem is not None:
            found.append(problem)
    more = len(found) - 1
    return found[:1] + (
        [Problem(run.where, "numerical refinement", f"{more} more gradients differ", "(not listed)")]
        if more > 0
        else []
    )
