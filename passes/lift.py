"""Lift pass: the logical program Dynamo traced becomes a DTensor program (`torch_hca.compiler.lifting`).

Parameters and arguments enter in their stated layouts, every other value is
replicated until the layout pass places it.
"""

from __future__ import annotations

import torch.fx as fx

from torch_hca.compiler.lifting import lift

from .infra import PassContext, PassResult


class LiftPass:
    name = "lift"
    reads = "logical program: Dynamo graph over global plain tensors, hca::enter/leave markers"
    writes = "DTensor program: storage and arguments in their layouts, every other value replicated"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        lifted = lift(gm)
        if lifted is None:
            return PassResult(gm, False)
        ctx.report.run_replicated = lifted.run_replicated
        ctx.report.random_draws = lifted.draws
        return PassResult(gm, True, lifted.decisions)
