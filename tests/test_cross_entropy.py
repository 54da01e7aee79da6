"""The vocabulary-parallel loss (torch_hca/compiler/cross_entropy.py): logits split by classes are
never gathered; the loss and every gradient equal one device's, on real gloo ranks."""

from __future__ import annotations

import pytest

import cross_entropy_cases

TOL = 1e-5
VOCAB, ROWS, DIM = 8192, 64, 32  # logits 64 x 8192 (2 MB) against 64 x 32 (8 KB) per all-reduce


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_vocabulary_split_head_computes_its_loss_where_the_classes_lie(worlds, world_size, reduction):
    for r in worlds(world_size).run(cross_entropy_cases.compiled_head_loss, VOCAB, reduction):
        assert r["loss_err"] <= TOL and max(r["grad_errs"].values()) <= TOL, r
        assert r["verified"][0], r["verified"][1]
        assert "chunk_logsumexp" in r["program"] and "cross_entropy_pick" in r["program"], r["program"]
        # Forward: the looked-up rows summed, each rank's log-sum-exp gathered (one value per row and
        # rank), the loss summed (a scalar, or the per-row losses); backward: the hidden state's
        # cotangent summed. The head and embedding stay where they lie and no logits move.
        loss_bytes = 4 if reduction != "none" else ROWS * 4
        assert r["collectives"] == [
            ("forward", "all_reduce", ROWS * DIM * 4),
            ("forward", "all_gather", ROWS * world_size * 4),
            ("forward", "all_reduce", loss_bytes),
            ("backward", "all_reduce", ROWS * DIM * 4),
        ], r["collectives"]
