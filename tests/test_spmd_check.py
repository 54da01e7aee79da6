"""Before a compiled graph first runs, the ranks compare its collectives (torch_hca/compiler/checks/spmd_check.py)."""

from __future__ import annotations

import pytest

import dist_cases
import torch_hca as hca
from torch_hca.compiler.checks.spmd_check import _describe_difference


def test_divergent_programs_are_named_instead_of_hanging(worlds):
    with pytest.raises(hca.RankError) as info:
        worlds(2).run(dist_cases.divergent_batch_sizes)
    text = str(info.value)
    assert "CheckError" in text and "compiled different collectives" in text
    assert "collective #0" in text and "(8, 16)" in text and "(6, 16)" in text


def test_same_programs_run(worlds):
    # Every parity, feature and rewrite test goes through the same check; this one just
    # makes sure a world that saw a failure restarts and agrees again.
    r = worlds(2).run(dist_cases.rewritten_sum_of_all_reduces)[0]
    assert r["out_err"] <= 1e-5


def test_difference_message_names_both_sides():
    msg = _describe_difference("graph 3 forward, group 0", 0, ["all_reduce float32(8, 16)"], 1, [])
    assert "collective #0: rank 0 issues all_reduce float32(8, 16), rank 1 issues no collective" in msg


def test_a_difference_in_one_group_stops_every_rank(worlds):
    results = worlds(4).run(dist_cases.divergent_in_one_tp_group)
    assert all(r["raised"] for r in results), results
    assert len({r["message"] for r in results}) == 1  # every rank judges every pair alike
    assert "rank 0 and rank 1 compiled different collectives" in results[0]["message"]
