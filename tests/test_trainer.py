"""`hca.Trainer` (torch_hca/api/trainer.py): transformers.Trainer on a sharded model, as one device trains it."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_cases  # noqa: E402

TOL = 1e-5


def test_four_data_parallel_steps_match_one_device(worlds):
    """Trainer's dataloader gives each rank its rows; the plan's data parallelism (no DDP) makes
    the step one device's on the global batch (SGD with momentum): parameters, logged losses, the
    checkpoint's model and evaluate()'s loss."""
    results = worlds(2).run(trainer_cases.train_like_one_device, {})
    r0, r1 = results
    assert r0["is_subclass"] and r0["wrapped"] == "GPT2LMHeadModel", r0  # not DistributedDataParallel
    assert r0["global_batches"] == r1["global_batches"], (r0, r1)
    rows0, rows1 = (sum(r["rows"], []) for r in results)
    assert len(set(rows0 + rows1)) == 2 * len(rows0) == 2 * trainer_cases.STEPS * trainer_cases.ROWS, (rows0, rows1)
    for r in results:
        assert r["param_err"] <= TOL and r["loss_err"] <= TOL, r
        assert len(r["logged"]) == trainer_cases.STEPS, r
    assert r0["logged"] == r1["logged"], (r0["logged"], r1["logged"])  # the global batch's loss on both
    assert r0["saved_err"] <= TOL, r0
    assert r0["eval_err"] <= TOL and r1["eval_err"] <= TOL, (r0, r1)
    # The compiled program's collectives, not DDP's: at this size the solver's cheapest step gathers
    # the token ids (one all-gather) and runs whole on every rank, so no gradient is summed (as in
    # tests/test_loss_reduction.py's GPT-2 with labels=).
    assert r0["collectives"] == r1["collectives"] == {"all_gather": 1}, r0["collectives"]


def test_unsupported_use_is_refused_with_the_fix(worlds):
    found = worlds(2).run(trainer_cases.refusals)[0]
    expected = {
        "unsharded": r"PlanError: hca.Trainer: this GPT2LMHeadModel is not sharded by torch_hca; shard it",
        "compiled": r"UnsupportedError: hca.Trainer: model is what torch.compile returned; pass the sharded model",
        "replicated inputs": r"UnsupportedError: hca.Trainer: the plan has inputs=.*Replicate.*use inputs=Shard\(0\)",
        "sum": r'PlanError: hca.Trainer: the model is sharded with loss_reduction="sum".*loss_reduction="mean"',
        "torch_compile": r"OptionsError: hca.Trainer: leave TrainingArguments' torch_compile",
    }
    for name, pattern in expected.items():
        assert re.match(pattern, found[name]), (name, found[name])


def test_resuming_from_a_checkpoint_continues_as_if_never_stopped(worlds):
    """A fresh model and hca.Trainer resumed from checkpoint-2 (model, momentum, scheduler, RNG and
    trainer state; the same run's, as a run stopped after step 2 leaves it) trains steps 3 and 4 as
    the uninterrupted run did; without the optimizer's state it does not. A checkpoint that cannot
    resume here is refused before any tensor is read, naming the fix."""
    results = worlds(2).run(trainer_cases.resume_like_uninterrupted, {})
    for r in results:
        assert r["step"] == trainer_cases.STEPS, r
        assert r["batches"][:2] == r["rows"][trainer_cases.SAVE_AT :], r  # steps 3 and 4 see the same rows
        assert r["param_err"] <= TOL and r["reference_err"] <= TOL, r
        assert len(r["logged"]) == trainer_cases.STEPS and r["loss_err"] <= TOL, r
        assert r["forgetful_err"] > 100 * TOL, r  # the comparison sees momentum: the control fails it
        # Under another plan with reshard=True: the pieces moved to the new layout, steps 3 and 4 as before.
        assert r["resharded_layout"] == "(Shard(dim=1),)" and r["resharded_err"] <= TOL, r
        # The resumed program is the new plan's, not the checkpoint's: one more forward all_gather
        # than the DP run's one (the split c_fc's), and none backward.
        assert r["resharded_collectives"] == {"forward": {"all_gather": 2}, "backward": {}}, r
    found = results[0]["refused"]
    assert results[1]["refused"] == found, results
    fix = r"or start a new run from its weights: hca.sharded\(plan, ...\)\(\w+.from_pretrained\("
    expected = {
        "model only": r"CheckpointError: hca.Trainer: .* has no hca_state/ .*save_only_model=True.*" + fix,
        "four ranks": r"CheckpointError: hca.Trainer: .* was written by 4 ranks and this run has 2; resume it with 4 ranks.*"
        + fix,
        "another plan": r"CheckpointError: hca.Trainer: .*parameter 'transformer.h.0.mlp.c_fc.weight' was saved laid out "
        r"as \(R\) over a \(2,\) mesh and is \(S\(1\)\) over a \(2,\) mesh here: the checkpoint is of another plan; "
        r"resume with the plan it was trained under, or pass hca.Trainer\(..., reshard=True\) to load it into this "
        r"plan's layout, " + fix,
    }
    for name, pattern in expected.items():
        assert re.match(pattern, found[name]), (name, found[name])


def test_resuming_at_another_world_size_continues_the_run(worlds):
    """The 2-rank run's checkpoint-2 resumed by 4 ranks of one row each (the same 4 rows a step),
    reshard=True: steps 3 and 4 train on the uninterrupted run's global batches to its parameters
    and losses. Without reshard, or with another number of rows a step, it is refused by name."""
    run = worlds(2).run(trainer_cases.checkpoint_for_another_world, {})[0]
    results = worlds(4).run(trainer_cases.resume_at_another_world, run)
    for r in results:
        assert r["step"] == trainer_cases.STEPS, r
        assert r["global_batches"] == run["global_batches"][trainer_cases.SAVE_AT :], (r, run["global_batches"])
        assert r["param_err"] <= TOL, r
        # The log history: steps 1 and 2 restored from trainer_state.json, 3 and 4 logged by this world.
        assert len(r["logged"]) == trainer_cases.STEPS, r
        assert max(abs(a - b) / abs(b) for a, b in zip(r["logged"], run["logged"])) <= TOL, (r, run["logged"])
        assert r["collectives"] == {"all_gather": 1}, r  # the 4-rank program, as the 2-rank run's
    found = results[0]["refused"]
    assert all(r["refused"] == found for r in results), results
    assert re.match(
        r"CheckpointError: hca.Trainer: .* was written by 2 ranks and this run has 4; resume it with 2 ranks, or "
        r"pass hca.Trainer\(..., reshard=True\)",
        found["no reshard"],
    ), found
    assert re.match(
        r"CheckpointError: hca.Trainer: .*'s steps took 4 rows each \(2 ranks\) and this run's take 8 \(4 ranks x "
        r"per_device_train_batch_size x gradient_accumulation_steps\).*so that a step takes 4 rows",
        found["other rows"],
    ), found
