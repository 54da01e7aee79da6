"""The programs hca compiles for the bench's real-size models, checked as graphs on a fake
process group of world 2 (no numbers: the bench checks those against one device).

Each test pins the collectives per transformer block, so that a cost-model change that silently
replicates a layer, or gathers the batch again, fails here and not only in a slow bench.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import torch_hca as hca
from torch_hca.tools.real_models import MEGATRON, LossOf, gpt2_small

from dist_cases import fake_world

pytest.importorskip("transformers")


def _compiled(model, ids, **options):
    torch._dynamo.reset()
    c = torch.compile(model, backend="hca", options={"strict": True, **options}, dynamic=False)
    c(ids).float().pow(2).mean().backward()
    return hca.report(c)


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_gpt2_data_parallel_keeps_the_batch_split(fake_pg):
    """HF GPT-2 (tiny config) on DP storage: every op runs on its rank's rows, the gradients are
    summed, nothing else moves. Two faults made this gather activations: Conv1D's addmm counted
    as one FLOP per output element (so replicating a block looked free), and the causal mask,
    made replicated, was never offered batch-split to attention."""
    torch.manual_seed(0)
    model = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(gpt2_small(tiny=True))
    rep = _compiled(model, torch.randint(0, 128, (4, 64)))
    assert rep.collective_counts("forward") == {}
    assert set(rep.collective_counts("backward")) == {"all_reduce"}
    assert rep.parallelism().split(": ")[1] == "data parallel"
    assert "100% of the compute split over 2 ranks" in rep.parallelism()


def test_gpt2_small_megatron_program(fake_pg_2_full_size):
    rep = fake_pg_2_full_size
    n_layer = N_LAYER
    forward = [(c.kind, c.bytes) for c in rep.collectives if c.direction == "forward"]
    # Per block: the attention's and the MLP's row-parallel partial sums (2 all_reduce); the lookup's
    # sum of the rows each rank holds of the tied table (cut 25,129 : 25,128 by vocabulary), and the
    # loss's sum. Per block also 1 all_gather: c_attn's Shard(1) cuts the fused q|k|v columns in
    # half, not by heads, so c_attn's output is gathered and each rank takes its heads of q, k and v
    # locally. The head runs vocabulary-split, its logits never move: 1 all_gather of each rank's
    # log-sum-exp per row (63 rows).
    assert rep.collective_counts("forward") == {"all_reduce": 2 * n_layer + 2, "all_gather": n_layer + 1}, forward
    assert ("all_gather", 63 * 2 * 4) in forward
    assert max(b for _, b in forward) <= 3 * 64 * 768 * 4  # c_attn's q|k|v: no table, no logits
    # Backward: per block the attention's and the MLP's input cotangents summed, the head's input's;
    # per block 3 all_gather, the transposes of the local chunks of q, k and v.
    assert rep.collective_counts("backward") == {"all_reduce": 2 * n_layer + 1, "all_gather": 3 * n_layer}
    line = rep.parallelism()
    assert line.split(": ")[1].startswith("tensor parallel")
    # 6 parameters a block sharded (c_attn, c_fc: weight S(1), bias S(0); both c_proj weights S(0)), and the table.
    assert (
        f"stored {6 * n_layer + 1} of {12 * n_layer + 4} parameters sharded (S(0) {4 * n_layer + 1}, S(1) {2 * n_layer})"
        in line
    )
    assert "gather of weights" not in line  # every sharded weight is read as stored
    # The rest: norms and the position embedding's lookup.
    assert "99% of the compute split over 2 ranks" in line


def test_gpt2_small_logits_returned_are_gathered_padded(fake_pg_2_small):
    """The logits returned replicated (the loss outside): the vocabulary-split head's pieces (25,129
    and 25,128 classes) gathered once, padded to the largest: 2 x 25,129 x 64 floats on the wire."""
    model = hca.sharded(MEGATRON["gpt2_small"], inputs=Replicate(), outputs=Replicate())(gpt2_small(layers=1))
    rep = _compiled(model, torch.randint(0, 50257, (1, 64)))
    gathers = [c.bytes for c in rep.collectives if c.direction == "forward" and c.kind == "all_gather"]
    assert gathers[-1] == 2 * 25129 * 64 * 4, gathers
    assert "gather of weights" not in rep.parallelism()


# GPT-2 small's width, heads and tied 50,257-token vocabulary with 2 of its 12 blocks: every block
# compiles to the same collectives (the counts above are per block), at half the 12-block compile
# time (measured 10.5 s against 21.8 s); the 12-block model gives 95% and 72 of 148 in the line.
N_LAYER = 2


@contextlib.contextmanager
def _fake_world_2():
    """A fake process group of world 2 and its mesh, for one compile."""
    with fake_world(2):
        torch.manual_seed(0)
        yield


@pytest.fixture
def fake_pg_2_full_size():
    """GPT-2 small's blocks (`N_LAYER` of them) on Megatron storage (`real_models.MEGATRON`), one row of 64 tokens."""
    with _fake_world_2():
        module = LossOf(gpt2_small(layers=N_LAYER).hf)  # as the bench's hca_megatron runs it
        model = hca.sharded(MEGATRON["gpt2_small"], inputs=Replicate(), outputs=Replicate())(module)
        yield _compiled(model, torch.randint(0, 50257, (1, 64)))


@pytest.fixture
def fake_pg_2_small():
    with _fake_world_2():
        yield


def test_llama_megatron_program_is_vocabulary_parallel(fake_pg_2_llama):
    """The 125M Llama's blocks (2 of 12) with its 32,000-row embedding and head cut by rows: the
    lookup sums its 64 looked-up rows (196 KB) instead of gathering the 98 MB table, the head runs
    vocabulary-split and gathers only its logits for the replicated output."""
    rep, table_bytes = fake_pg_2_llama
    forward = [c for c in rep.collectives if c.direction == "forward"]
    # Per block 2 all_reduce (attention's and the MLP's row-parallel sums), 1 for the lookup, 1 logits gather.
    assert rep.collective_counts("forward") == {"all_reduce": 2 * N_LAYER + 1, "all_gather": 1}
    assert max(c.bytes for c in rep.collectives) < table_bytes / 4  # no table gathered, either way
    assert [c.bytes for c in forward if c.kind == "all_gather"] == [64 * 32000 * 4]
    assert "stored 16 of 21 parameters sharded" in rep.parallelism()


def test_llama_megatron_loss_in_the_module_gathers_no_logits(fake_pg_2_llama_loss):
    """The same model with its next-token loss in the compiled module (`real_models.LossOf`, as the
    bench's hca_megatron runs it): the head's logits stay split by classes and the loss is computed
    where they lie: each rank's log-sum-exp per row gathered (63 rows x 2 ranks), the target logits
    and the loss summed. Nothing of the 8 MB of logits moves."""
    rep = fake_pg_2_llama_loss
    forward = [(c.kind, c.bytes) for c in rep.collectives if c.direction == "forward"]
    assert rep.collective_counts("forward") == {"all_reduce": 2 * N_LAYER + 1 + 1, "all_gather": 1}, forward
    assert [b for k, b in forward if k == "all_gather"] == [63 * 2 * 4]
    assert max(b for _, b in forward) == 64 * 768 * 4  # a hidden state: the lookup's and blocks' sums
    # Backward: per block the cotangents of the attention's and the MLP's inputs summed once each
    # (read through `reduce_cotangent`, Megatron's "f"), and the head's input: nothing gathered.
    assert rep.collective_counts("backward") == {"all_reduce": 2 * N_LAYER + 1}
    # Every weight gradient is the rank's piece: no matmul makes a whole 768 x 768 q or o gradient
    # (before `reduce_cotangent`, o_proj's gathered its saved input and multiplied all of it).
    mm = [n for n in rep.graphs[0].joint.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert mm and all(tuple(n.meta["val"].shape) != (768, 768) for n in mm)


def _llama(loss_inside: bool):
    from torch_hca.tools.real_models import LossOf, llama_100m

    module = llama_100m()
    module.hf.model.layers = module.hf.model.layers[:N_LAYER]
    return LossOf(module.hf) if loss_inside else module


@pytest.fixture
def fake_pg_2_llama():
    """`real_models.llama_100m` with `N_LAYER` blocks on Megatron storage, one row of 64 tokens."""
    with _fake_world_2():
        module = _llama(loss_inside=False)
        table_bytes = module.hf.model.embed_tokens.weight.numel() * 4
        model = hca.sharded(MEGATRON["llama_100m"], inputs=Replicate(), outputs=Replicate())(module)
        yield _compiled(model, torch.randint(0, 32000, (1, 64))), table_bytes


@pytest.fixture
def fake_pg_2_llama_loss():
    """As `fake_pg_2_llama`, the loss in the module."""
    with _fake_world_2():
        model = hca.sharded(MEGATRON["llama_100m"], inputs=Replicate(), outputs=Replicate())(_llama(loss_inside=True))
        yield _compiled(model, torch.randint(0, 32000, (1, 64)))
