"""Bad input, table-driven: every row of `tests/bad_input_cases.py` raises its `HCAError`
subclass with a message that names the problem (the parameter, option or argument, and its
value) and the fix. `tests/test_errors.py` holds more, one test each.

Rows marked ``owner`` still fail and another piece of work owns the fix: they are strict
xfails, so the day they pass the mark has to go.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import torch_hca as hca
from torch_hca.runtime.mesh import reset_current_mesh

from bad_input_cases import CASES, Case, run_on_ranks


def _rows(world: str) -> list:
    return [
        pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.owner)] if c.owner else [])
        for c in CASES
        if c.world == world
    ]


def _raises(case: Case) -> None:
    with pytest.raises(case.error, match=case.match):
        case.call()


def test_enough_distinct_rows():
    assert len(CASES) >= 100 and len({c.id for c in CASES}) == len(CASES)
    assert all(issubclass(c.error, hca.HCAError) for c in CASES)


@pytest.mark.parametrize("case", _rows("fake"))
def test_bad_input(fake_pg, case):
    _raises(case)


@pytest.mark.parametrize("case", _rows("none"))
def test_bad_input_without_a_process_group(case):
    assert not dist.is_initialized()
    reset_current_mesh()
    _raises(case)


@pytest.fixture(scope="module")
def rank_results(worlds):
    """Every "ranks" row, run once on 2 gloo ranks: {row id: [(exception type, message) per rank]}."""
    ids = [c.id for c in CASES if c.world == "ranks"]
    per_rank = worlds(2).run(run_on_ranks, ids, timeout_s=120)
    return {case_id: [dict((r[0], r[1:]) for r in rows)[case_id] for rows in per_rank] for case_id in ids}


@pytest.mark.parametrize("case", _rows("ranks"))
def test_bad_input_across_ranks(rank_results, case):
    for rank, (name, message) in enumerate(rank_results[case.id]):
        raised = getattr(hca, name, None) if name else None
        assert isinstance(raised, type) and issubclass(raised, case.error), (rank, name, message)
        assert re.search(case.match, message), (rank, message)


@pytest.mark.parametrize(
    "op",
    [lambda t: t.sort(dim=0).values, lambda t: t.max(0).values * t, lambda t: torch.linalg.qr(t)[0]],
    ids=["sort", "max-dim", "qr"],
)
def test_ops_returning_several_tensors_run_replicated(fake_pg, op):
    # Once a raw TypeError/StopIteration inside the backend; such ops now run whole on every rank.
    from bad_input_cases import Then, _compiled

    compiled = _compiled(hca.sharded({"fc.weight": hca.Shard(0)}, inputs=hca.Shard(0))(Then(op)))
    compiled(torch.randn(8, 8)).sum().backward()
    assert any("runs replicated: it returns 2 tensors" in line for line in hca.report(compiled).graph.run_replicated)
