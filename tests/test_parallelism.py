"""Which parallelism runs: `hca.report(c).parallelism()` opens `str(report)` and the compile log
(TORCH_LOGS="torch_hca") with one sentence per graph (fake process group, world 4)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

import torch_hca as hca
from torch_hca.tools import zoo

from compile_log import compile_log_lines


def _compiled(model, x, **options):
    torch._dynamo.reset()
    c = torch.compile(model, backend="hca", options={"strict": True, "schedule": False, **options}, dynamic=False)
    c(x).sum().backward()
    return hca.report(c)


def test_data_parallel_storage_says_data_parallel(fake_pg):
    rep = _compiled(hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 4)), torch.randn(8, 16))
    (line,) = rep.parallelism().splitlines()
    assert line.startswith("graph ") and ": data parallel: stored 8 parameters replicated, inputs (S(0)); " in line
    assert "100% of the compute split over 4 ranks, the replicated parameters' gradients summed" in line
    assert "moves: none" in line and "as written the same cost" in line
    assert rep.collective_counts() == {"all_reduce": 8}  # what the sentence says is what runs
    assert str(rep).startswith("== parallelism ==\n" + line[:60])


def test_megatron_storage_says_tensor_parallel_and_names_the_rejected_layout(fake_pg):
    rep = _compiled(hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512)), torch.randn(2, 6, 128))
    line = rep.parallelism()
    assert ": tensor parallel: stored 7 of 12 parameters sharded (S(0) 5, S(1) 2), inputs (R)" in line
    assert "2 sum of activations" in line
    assert "as written" in line and "(rejected)" in line  # the user's layout kept costs more in the model
    assert rep.collective_counts("forward") == {"all_reduce": 2}


def test_fsdp_storage_says_weights_gathered(fake_pg):
    rep = _compiled(
        hca.sharded({"*": Shard(0)}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 4)), torch.randn(64, 16)
    )
    line = rep.parallelism()
    assert ": FSDP-style (weights gathered to compute): stored 8 of 8 parameters sharded (S(0) 8)" in line
    assert "moves: 8 gather of weights" in line
    assert rep.collective_counts() == {"all_gather": 8, "reduce_scatter": 8}


def test_replicated_compute_is_called_so(fake_pg):
    rep = _compiled(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16))
    assert "replicated compute (every rank computes everything)" in rep.parallelism()
    assert "0% of the compute split" in rep.parallelism()


def test_the_compile_log_says_it(fake_pg):
    with compile_log_lines() as said:
        _compiled(hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 2)), torch.randn(8, 16))
    (said,) = said
    assert ": data parallel: stored 4 parameters replicated" in said.replace("\n    ", " ")
    assert max(map(len, said.splitlines())) <= 124


@pytest.mark.parametrize("name", ["as_written", "dtensor"])
def test_as_written_keeps_the_users_parallelism(fake_pg, name):
    """Under Megatron storage on tiny weights the solver gathers the weights; as written, the
    layers stay split and their partial sums are reduced."""
    rep = _compiled(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16), layout=name)
    assert rep.collective_counts("forward") == {"all_reduce": 1}
    assert "layout by none (DTensor's per-op choices)" in rep.parallelism()
