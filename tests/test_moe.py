"""Mixture of experts: HF Mixtral compiled by hca trains as one device (docs/huggingface.md).

What runs is correct but not expert parallel: the program gathers the tokens (and, with the
experts stored split, the expert weights) and routes every token on every rank. The collectives
are pinned so that a change to either shows here."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import moe_cases  # noqa: E402

TOL = 1e-5


def _assert_one_device(results):
    for r in results:
        errs = [r["out_err"], *r["grad_errs"].values(), *r["param_errs"].values()]
        assert r["grad_errs"] and max(errs) <= TOL, r


def test_mixtral_at_2_ranks_batch_split_and_experts_stored_split(worlds):
    results = worlds(2).run(moe_cases.mixtral_parity, ["dp", "experts"])
    _assert_one_device([rank[plan] for rank in results for plan in ("dp", "experts")])
    dp, experts = results[0]["dp"], results[0]["experts"]
    # The token ids gathered once; every rank computes the whole batch, so no gradient is summed.
    assert (dp["forward"], dp["backward"]) == ({"all_gather": 1}, {}), dp
    # ... and with the experts stored split, both expert weight tensors gathered too.
    assert (experts["forward"], experts["backward"]) == ({"all_gather": 2}, {}), experts
    assert set(experts["experts"].values()) == {"(Shard(dim=0),)"}, experts["experts"]


def test_mixtral_at_4_ranks_one_expert_each(worlds):
    results = worlds(4).run(moe_cases.mixtral_parity, ["experts"])
    _assert_one_device([rank["experts"] for rank in results])
    assert all((r["experts"]["forward"], r["experts"]["backward"]) == ({"all_gather": 2}, {}) for r in results)
