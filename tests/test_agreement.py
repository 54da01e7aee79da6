"""Ranks that disagree on what SPMD says they share are stopped before the step (torch_hca/compiler/checks/agreement.py).

Before this check each of these cases ran to the end with silently wrong
gradients (the collectives matched, so the first-run collective check passed).
"""

from __future__ import annotations

import pytest

import agreement_cases

RAISES = {
    # case: (world size, words the message must hold)
    "replicate_batch": (
        2,
        ["L['args'][0]", "[8, 16] float32 on rank 0", "[6, 16] float32 on rank 1", "same batch size"],
    ),
    "replicate_values": (2, ["L['args'][0]", "differs between rank 0 and rank 1", "Replicate()"]),
    "nan_on_one_rank": (2, ["L['args'][0]", "differs between rank 0 and rank 1"]),
    "python_scalar": (2, ["traced different programs", "depends on the rank"]),
    "branch": (2, ["traced different programs", "depends on the rank"]),
    "buffer": (2, ["_buffers['shift']", "differs between rank 0 and rank 1"]),
    "mesh2d_same_dp_differs": (4, ["sharded over mesh dims [0]", "differs between rank 0 and rank 1"]),
    # Data parallel: the forward has no collective and runs before the check's verdict.
    "dp_python_scalar": (2, ["traced different programs", "depends on the rank"]),
    "dp_buffer": (2, ["_buffers['shift']", "differs between rank 0 and rank 1"]),
}


class _Recorder:
    """An input check that records when it posts and when it verifies."""

    def __init__(self, events):
        self.events = events

    def post(self, args):
        self.events.append("post")
        return lambda: self.events.append("verify")


@pytest.mark.parametrize("communicates,order", [(True, ["post", "verify", "run"]), (False, ["post", "run", "verify"])])
def test_only_a_forward_without_collectives_runs_before_the_verdict(communicates, order):
    from torch_hca.backends.pipeline import _agreed

    events = []
    run = _agreed(lambda *a: events.append("run") or "out", _Recorder(events), communicates)
    assert run(1) == "out" and events == order


@pytest.mark.parametrize("name", sorted(RAISES))
def test_disagreement_is_a_check_error_on_every_rank(worlds, name):
    world_size, words = RAISES[name]
    results = worlds(world_size).run(agreement_cases.disagreement, name)
    assert all(r["raised"] for r in results), results  # every rank stops: none waits in a collective
    assert len({r["message"] for r in results}) == 1, "every rank judges every pair alike"
    for word in words:
        assert word in results[0]["message"], results[0]["message"]


@pytest.mark.parametrize("name,world_size", [("sharded_pieces_differ", 2), ("mesh2d_dp_pieces_differ", 4)])
def test_pieces_of_a_sharded_input_may_differ(worlds, name, world_size):
    results = worlds(world_size).run(agreement_cases.disagreement, name)
    assert not any(r["raised"] for r in results), results


@pytest.mark.parametrize("mode,raised", [("values", True), ("shapes", False), ("first", False)])
def test_later_calls_follow_the_input_check_option(worlds, mode, raised):
    results = worlds(2).run(agreement_cases.disagreement, "second_call_values", mode)
    assert [r["raised"] for r in results] == [raised] * 2
    if raised:
        assert results[0]["call"] == 1


def test_divergent_plans_are_named_inside_hca_sharded(worlds):
    results = worlds(2).run(agreement_cases.divergent_plans)
    assert all(r["raised"] for r in results), results
    message = results[0]["message"]
    assert "different plans" in message and "'fc1.weight'" in message
    assert "(Shard(dim=0),)" in message and "(Shard(dim=1),)" in message
    assert max(r["seconds"] for r in results) < 10  # not the launch timeout


def test_the_program_digest_reads_past_an_unused_storage_offset():
    """Under dynamic shapes a view at a nonzero offset (``x.chunk(n)[rank]`` on rank 1) brings
    its offset as a graph input that rank 0's graph lacks; the programs are the same."""
    import torch

    from torch_hca.compiler.checks.agreement import program_digest

    graphs = []

    def backend(gm, example_inputs):  # Dynamo drops the graph inputs' records after the backend returns
        graphs.append((gm.code, program_digest(gm)))
        return gm.forward

    def trace(start: int):  # a second size makes Dynamo recompile with dynamic shapes
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: x * 2, backend=backend)
        rows = torch.ones(100, 4)
        compiled(rows[start : start + 10])
        compiled(rows[2 * start : 2 * start + 15])
        torch._dynamo.reset()
        return graphs[-1]

    at_zero, at_offset = trace(0), trace(10)
    assert "storage_offset" not in at_zero[0] and at_zero[0].count("SymInt") + 1 == at_offset[0].count("SymInt")
    assert at_zero[1] == at_offset[1]
    torch._dynamo.reset()
    other = torch.compile(lambda x: x * 3, backend=backend)
    other(torch.ones(10, 4))
    other(torch.ones(15, 4))
    torch._dynamo.reset()
    assert graphs[-1][1] != at_zero[1]


def test_every_rank_keeps_rank_0s_layout_choice(worlds):
    """Rank 1's solver returns another program (it gathers the batch where rank 0 reduces
    gradients), as HiGHS did with two optima of equal cost for Llama on the (2, 2) mesh under
    load; without the agreement the collective check stopped the first backward with
    "compiled different collectives"."""
    results = worlds(2).run(agreement_cases.solver_choices_apart)
    assert all("error" not in r for r in results), results
    first, second = results
    assert (first["forward"], first["backward"]) == (second["forward"], second["backward"])
    assert first["backward"].get("all_reduce", 0) >= 1 and "all_gather" not in first["forward"]  # rank 0's: rows split
    assert "rank 0's choice kept" in second["status"] and "rank 0's choice kept" not in first["status"]
    assert all(r["refinement"] and max(r["refinement"].values()) < 1e-5 for r in results)
