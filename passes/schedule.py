"""Schedule pass: the order the forward and backward graphs run in.

This first version keeps the order AOTAutograd produced and proves it legal
with the independent checker (`torch_hca.schedule_check`); overlap and
bucketing come later and must pass the same check.
"""

from __future__ import annotations

import torch.fx as fx

from torch_hca.schedule_check import check_order

from .infra import PassContext, PassResult


class SchedulePass:
    name = "schedule"
    reads = "forward or backward graph (local tensors, _c10d_functional)"
    writes = "the same graph in a checked order"

    def __init__(self, which: str):
        self.which = which
        self.name = f"schedule_{which}"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        summary = check_order(gm, self.which)
        ctx.report.schedules[self.which] = {
            "order": "as traced",
            "per_group": summary.per_group,
            "fingerprint": summary.fingerprint,
        }
        return PassResult(gm, False, [f"order as traced; fingerprint {summary.fingerprint}"])
