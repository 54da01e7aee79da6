"""Random draws: every rank keeps its piece of what one device draws (torch_hca.compiler.randomness).

Graph-only checks on the fake process group (rank 0 of 2); parity on real ranks, with
transformers' models under dropout, is in tests/test_zoo.py
(`test_dropout_draws_what_one_device_draws`), the errors in tests/bad_input_cases.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import torch_hca as hca
from torch_hca.compiler import dtensor_ops
from torch_hca.compiler import randomness

aten = torch.ops.aten


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate(), Partial()], ids=["S0", "S1", "R", "P"])
def test_dropout_keeps_this_ranks_piece_of_one_devices_mask(fake_pg, placement):
    whole = torch.randn(6, 8)
    local = whole.chunk(2, dim=placement.dim)[0] if placement.is_shard() else whole
    x = DTensor.from_local(local, fake_pg, (placement,), run_check=False)
    torch.manual_seed(7)
    want = F.dropout(whole, 0.3, training=True)
    torch.manual_seed(7)
    got = dtensor_ops.dropout(x, 0.3, training=True)
    assert got.placements == (placement,)  # no data moved: a shard's slice, a partial sum's whole mask
    piece = want.chunk(2, dim=placement.dim)[0] if placement.is_shard() else want
    torch.testing.assert_close(got.to_local(), piece, rtol=0, atol=0)
    # Both consumed the generator alike: the next draw is the same.
    torch.manual_seed(7)
    F.dropout(whole, 0.3, training=True)
    after_one_device = torch.rand(1)
    torch.manual_seed(7)
    dtensor_ops.dropout(x, 0.3, training=True)
    assert torch.equal(torch.rand(1), after_one_device)


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_dropout_off_is_the_input_and_p_one_is_zero(fake_pg):
    x = DTensor.from_local(torch.randn(4, 4), fake_pg, (Shard(0),), run_check=False)
    assert dtensor_ops.dropout(x, 0.5, training=False) is x
    assert dtensor_ops.dropout(x, 0.0, training=True) is x
    assert torch.equal(dtensor_ops.dropout(x, 1.0).to_local(), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="between 0 and 1"):
        dtensor_ops.dropout(x, 1.5)


def test_draws_reads_the_schema_tag():
    assert randomness.draws(aten.bernoulli_.float) and randomness.draws(aten.native_dropout.default)
    assert not randomness.draws(aten.mm.default) and not randomness.draws(F.dropout)


def test_generators_kept_and_their_digest():
    torch.manual_seed(3)
    before = randomness.generator_digest("cpu")
    with randomness.generators_kept("cpu"):
        torch.rand(10)
        assert randomness.generator_digest("cpu") != before
    assert randomness.generator_digest("cpu") == before
    torch.manual_seed(4)
    assert randomness.generator_digest("cpu") != before


class _Dropped(nn.Module):
    def __init__(self, inplace: bool = False, p: float = 0.5):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(p, inplace=inplace)

    def forward(self, x):
        h = self.drop(torch.relu(self.up(x)))
        return self.drop(self.down(h)) + h.sum(-1, keepdim=True)  # h read again after an in-place dropout


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "in-place"])
def test_compiled_dropout_is_recorded_adds_no_collective_and_compiles_without_drawing(fake_pg, inplace):
    plan = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}
    torch.manual_seed(0)
    model = hca.sharded(plan, mesh=fake_pg)(_Dropped(inplace))
    compiled = torch.compile(model, backend="hca", options={"layout": "dtensor"})
    x = torch.randn(4, 8)
    reference = _Dropped(inplace)
    # The first call compiles (Dynamo traces, the passes probe every layout) and runs: it must
    # leave the generator where one device's forward leaves it.
    torch.manual_seed(1)
    compiled(x).sum().backward()
    after_compiled = torch.rand(1)
    torch.manual_seed(1)
    reference(x)
    assert torch.equal(torch.rand(1), after_compiled)
    rep = hca.report(compiled)
    draws = rep.graph.random_draws
    assert len(draws) == 2 and all("bernoulli_" in d for d in draws)
    plain = torch.compile(
        hca.sharded(plan, mesh=fake_pg)(_Dropped(inplace, p=0.0)), backend="hca", options={"layout": "dtensor"}
    )
    plain(x).sum().backward()
    assert hca.report(plain).graph.random_draws == []
    for direction in ("forward", "backward"):  # dropout adds no collective
        assert rep.collective_counts(direction) == hca.report(plain).collective_counts(direction)
    assert rep.collective_counts("forward") == {"all_reduce": 1}  # the activations stayed sharded


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_an_eager_sharded_module_draws_as_one_device(fake_pg):
    """Called without torch.compile, a sharded module's forward runs over DTensors; its dropout
    draws the whole mask too (torch_hca.compiler.rewrites), here on rows split over the mesh."""
    torch.manual_seed(0)
    reference = _Dropped()
    torch.manual_seed(0)
    model = hca.sharded({}, mesh=fake_pg, inputs=Shard(0), outputs=Shard(0))(_Dropped())
    x = torch.randn(8, 8)
    torch.manual_seed(5)
    want = reference(x)
    torch.manual_seed(5)
    got = model(x.chunk(2)[0])  # rank 0's rows
    torch.testing.assert_close(got, want.chunk(2)[0])
