"""The vocabulary-parallel embedding (torch_hca/compiler/embedding.py): a table cut by rows is read
where it lies, its result a partial sum of the looked-up rows, on real gloo ranks."""

from __future__ import annotations

import pytest

import embedding_cases

TOL = 1e-5


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("rows, padding_idx", [(10, None), (11, 4), (11, 10)])
def test_a_row_sharded_table_looks_up_as_one_device(worlds, world_size, rows, padding_idx):
    for r in worlds(world_size).run(embedding_cases.eager_lookup, rows, padding_idx):
        assert r["placements"] == ("P(sum)",), r  # no gather: each rank's rows, summed
        assert r["grad_placements"] == ("S(0)",), r  # each rank's rows' gradient stays where they live
        assert r["out_err"] <= TOL and r["grad_err"] <= TOL, r


@pytest.mark.parametrize("world_size", [2, 4])
def test_compiled_vocabulary_parallel_reads_the_table_in_place(worlds, world_size):
    """1 MB table, 16 ids: the forward sums 16 looked-up rows (4 KB) instead of gathering the table,
    the backward moves nothing for it; gradients (padding row included) equal one device's."""
    for r in worlds(world_size).run(embedding_cases.compiled_lookup):
        assert max(r["grad_errs"].values()) <= TOL, r
        forward = [c for c in r["collectives"] if c[0] == "forward"]
        assert forward == [("forward", "all_reduce", 2 * 8 * 64 * 4)], r
        # The summed rows' cotangent is replicated and each rank's table rows take theirs locally.
        assert [c for c in r["collectives"] if c[0] == "backward"] == [], r
