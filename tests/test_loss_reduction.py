"""`hca.sharded(..., loss_reduction=)`: a loop ported from DDP gets DDP's gradients (torch_hca/api/plan.py)."""

from __future__ import annotations

import pytest

import reduction_cases

TOL = 1e-5


@pytest.mark.parametrize("world_size,compiled", [(2, True), (4, True), (2, False)])
def test_mean_matches_ddp_and_one_device(worlds, world_size, compiled):
    r = worlds(world_size).run(reduction_cases.ddp_style_step, "mean", compiled)[0]
    assert r["vs_ddp"] <= TOL and r["vs_one_device"] <= TOL, r
    if compiled:  # the scale is local: still one bucketed all-reduce of the gradients, nothing else
        assert r["collectives"] == {"all_reduce": 1}, r


def test_sum_is_the_gradient_of_the_ranks_summed_losses(worlds):
    """The default: each rank's loss is a term of one sum, so gradients are world-size x DDP's."""
    r = worlds(2).run(reduction_cases.ddp_style_step, "sum", True)[0]
    assert r["ratio_to_ddp"] == [2.0] * 4, r
