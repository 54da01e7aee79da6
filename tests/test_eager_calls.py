"""A sharded module called outside torch.compile: training, eval and Hugging Face generate().

The same model object trains compiled and evaluates, samples and trains eagerly; each
eager call equals one device (docs/huggingface.md, "Evaluate and generate").
"""

from __future__ import annotations

import pytest

import eager_cases
import model_zoo

TOL = 1e-5
ZOO_PLANS = ["dp", "megatron", "fsdp"]
GENERATE_MODELS = ["gpt2", "llama", "mistral", "mixtral"]


@pytest.fixture(scope="module")
def zoo_at_2(worlds):
    return worlds(2).run(eager_cases.zoo_eager, sorted(model_zoo.MODELS), ZOO_PLANS)


@pytest.mark.parametrize(
    ("model_name", "plan_name"),
    [(m, p) for m in sorted(model_zoo.MODELS) for p in ZOO_PLANS if model_zoo.has_plan(m, p, 2)],
)
def test_eager_train_and_eval_match_one_device(zoo_at_2, model_name, plan_name):
    for rank, results in enumerate(zoo_at_2):
        r = results[(model_name, plan_name)]
        assert r["train_out_err"] <= TOL, (rank, r["train_out_err"])
        assert r["grad_errs"] and max(r["grad_errs"].values()) <= TOL, (rank, r["grad_errs"])
        assert all(e <= TOL for e in r["zero_grad_abs_errs"].values()), (rank, r["zero_grad_abs_errs"])
        assert r["eval_out_err"] <= TOL, (rank, r["eval_out_err"])


def test_data_parallel_eval_runs_no_collective(zoo_at_2):
    """Parameters replicated, the batch split: evaluating needs nothing from the other rank
    (convnet's batch norm too: with running statistics it is elementwise). BERT's one gather is
    Hugging Face's: it builds the 4-D padding mask by indexing the 2-D one with the whole
    batch's row numbers, and DTensor gathers a split tensor indexed that way."""
    expected = {name: {} for name in model_zoo.MODELS} | {"bert": {"all_gather_single": 1}}
    for results in zoo_at_2:
        assert {name: results[(name, "dp")]["eval_collectives"] for name in model_zoo.MODELS} == expected


def test_megatron_eval_runs_the_megatron_collectives(zoo_at_2):
    """torch's test Transformer, vocabulary-parallel embeddings and Megatron layers: one all-reduce
    per embedding and two per layer (the row-parallel outputs' partial sums), one all-gather of
    the vocabulary-split logits (the head is tied to the split token embedding)."""
    for results in zoo_at_2:
        counts = results[("test_transformer", "megatron")]["eval_collectives"]
        assert counts == {"all_reduce": 2 + 2 * model_zoo.TT_LAYERS, "all_gather_single": 1}, counts


def test_fsdp_eval_gathers_the_split_weights(zoo_at_2):
    """An FSDP-style plan evaluates as FSDP does: the weights stored split are gathered, the batch
    stays split."""
    for results in zoo_at_2:
        for name in model_zoo.MODELS:
            counts = results[(name, "fsdp")]["eval_collectives"]
            assert counts.get("all_gather_single", 0) >= 1, (name, counts)


def test_eager_train_and_eval_at_4_ranks(worlds):
    """Llama's 4 kv heads split one per rank under Megatron, and the (dp, tp) mesh."""
    results = worlds(4).run(eager_cases.zoo_eager, ["llama"], ["megatron", "2d"])
    for rank_results in results:
        assert sorted(rank_results) == [("llama", "2d"), ("llama", "megatron")]
        for key, r in rank_results.items():
            assert max(r["grad_errs"].values()) <= TOL, (key, r["grad_errs"])
            assert r["train_out_err"] <= TOL and r["eval_out_err"] <= TOL, (key, r)


@pytest.fixture(scope="module")
def generated(worlds):
    return worlds(2).run(eager_cases.hf_generate, GENERATE_MODELS, ["dp", "megatron"])


@pytest.mark.parametrize("plan_name", ["dp", "megatron"])
@pytest.mark.parametrize("model_name", GENERATE_MODELS)
def test_generate_gives_one_devices_tokens(generated, model_name, plan_name):
    """Greedy and sampled (same seed) generate() with the KV cache, on the sharded model and
    through its torch.compile wrapper, give one device's tokens for the same rows."""
    for rank, results in enumerate(generated):
        r = results[(model_name, plan_name)]
        assert r["logits_err"] <= TOL, (rank, r)
        assert r["new_tokens"] == 8, (rank, r)
        assert r["greedy_same"] and r["sampled_same"] and r["compiled_greedy_same"], (rank, r)


def test_save_pretrained_writes_the_whole_model_once(worlds, tmp_path):
    """Every rank calls save_pretrained; rank 0 writes the gathered model, which loads with
    from_pretrained on one device and into a sharded model of another plan."""
    results = worlds(2).run(eager_cases.hf_save_and_load, str(tmp_path / "gpt2"))
    for r in results:
        assert r["files"] == ["config.json", "generation_config.json", "model.safetensors"], r
        assert r["one_device_err"] <= TOL and r["resharded_err"] <= TOL, r


def test_eager_dropout_draws_as_one_device_and_differently_seeded_ranks_are_named(worlds):
    same = worlds(2).run(eager_cases.eager_dropout, True)
    # The same masks: a mask drawn differently is off by O(1); a rank's rows against the whole batch's
    # matmul may round differently (seen: 1e-7 on another machine's BLAS).
    assert all(set(r) == {"err"} and r["err"] <= 1e-6 for r in same), same
    differ = worlds(2).run(eager_cases.eager_dropout, False)
    for r in differ:
        assert "rank(s) [1] differs from rank 0's" in r["error"] and "torch.manual_seed" in r["error"], r


@pytest.mark.parametrize("world_size", [2, 4])
def test_training_through_an_op_dtensor_has_no_rule_for_matches_one_device(worlds, world_size):
    """An eager training call through the no-rule fallback: output and every gradient equal one
    device's at 2 and 4 ranks. The op's split input is gathered (one all_gather forward) and its
    result is replicated, so the next layer runs on the whole batch on every rank and the output is
    cut to the rank's rows; in the backward that cut's cotangent is gathered (one all_gather), the
    replicated layer's gradients come out whole and the first layer's partial (summed where read)."""
    for r in worlds(world_size).run(eager_cases.eager_no_rule_training):
        assert r["out_err"] <= TOL and r["grad_err"] <= TOL, r
        assert r["forward"] == {"all_gather_single": 1}, r
        assert r["backward"] == {"all_gather_single": 1}, r
        assert r["grad_placements"] == ["(Partial(sum),)", "(Replicate(),)"], r


def test_an_op_dtensor_has_no_rule_for_runs_whole_or_is_named(worlds):
    """An op DTensor cannot shard (a custom op; nonzero, whose shape depends on the data) runs whole on
    every rank, its split input gathered, equal to one device; one that writes in place into a split
    value is an `UnsupportedError` naming it and the fix, not DTensor's RuntimeError."""
    for r in worlds(2).run(eager_cases.eager_no_rule, False):
        assert r["err"] <= TOL, r
        # The split h gathered once for each op DTensor has no rule for (the custom op, nonzero).
        assert r["calls"] == {"all_gather_single": 2}, r
    for r in worlds(2).run(eager_cases.eager_no_rule, True):
        assert "'hca_tests::add_one_'" in r["error"] and "Shard(dim=0)" in r["error"], r
        assert "out of place" in r["error"], r
