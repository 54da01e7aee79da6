"""`hca.step`: the optimizer steps on every rank or on none (torch_hca/api/step.py)."""

from __future__ import annotations

import pytest

import step_cases


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_nan_on_one_rank_stops_every_rank(worlds, world_size):
    results = worlds(world_size).run(step_cases.one_step, 1, "raise")
    for r in results:
        assert r["stepped"] is None and not any(r["moved"])
        assert "rank 1: 0.weight" in r["error"] and "no rank took the optimizer step" in r["error"]


def test_skip_step_skips_everywhere(worlds):
    results = worlds(2).run(step_cases.one_step, 1, "skip_step")
    for r in results:
        assert r["stepped"] is False and not any(r["moved"]) and not any(r["grads_left"])


def test_finite_gradients_step_everywhere(worlds):
    results = worlds(2).run(step_cases.one_step, None, "raise")
    for r in results:
        assert r["stepped"] is True and all(r["moved"])
