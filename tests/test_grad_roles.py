"""Cotangent roles for parameter gradients: eager (inside backward) or deferred (hca.reduce_gradients).

Counted, not only checked by value: a silently dropped deferral keeps the
numbers right and the traffic wrong. Backward collectives are counted from the
compiled backward graph (it runs whole on every call), `reduce_gradients`'
at run time.
"""

from __future__ import annotations

import pytest

import dist_cases

K = 4  # microbatches of gradient accumulation


@pytest.mark.parametrize("world_size", [2, 4])
def test_eager_role_reduces_every_microbatch(worlds, world_size):
    r = worlds(world_size).run(dist_cases.accumulate, "eager", K)[0]
    assert r["grad_err"] <= 1e-5
    # The schedule pass buckets the backward's gradient all-reduces: all 8 gradients
    # (4352 bytes, under the 25 MiB cap) in one all-reduce per microbatch.
    assert r["parameters"] == 8
    assert r["in_backward"] == {"all_reduce": K}, "one bucketed all-reduce of every gradient per microbatch"
    assert r["placements_before_reduce"] == ["(Replicate(),)"]
    assert r["buckets"] == [] and r["in_reduce_gradients"] == {}, "nothing left for reduce_gradients"


@pytest.mark.parametrize("world_size", [2, 4])
def test_deferred_role_reduces_once_bucketed(worlds, world_size):
    r = worlds(world_size).run(dist_cases.accumulate, "deferred", K)[0]
    assert r["grad_err"] <= 1e-5
    assert r["in_backward"] == {}, "deferred gradients must not be reduced during accumulation"
    assert r["placements_before_reduce"] == ["(Partial(sum),)"]
    # All 8 gradients (4 x ([16, 16] + [16]) fp32) fit one bucket: one all-reduce in total.
    assert r["buckets"] == [(r["parameters"], 4 * (16 * 16 + 16) * 4)]
    assert r["in_reduce_gradients"] == {"all_reduce": 1}
    assert r["placements"] == ["(Replicate(),)"]
