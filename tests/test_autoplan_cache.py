"""`hca.plan` leaves no fake state in DTensor's sharding cache (fake process group, world 4).

The solver probes every layout of every op on fake DTensors, and DTensor caches what
each probe decided. A vocabulary-sharded embedding decides a `_MaskPartial` output that
carries the mask its input made; a probe never reduces it, so the cached placement kept
a fake mask, and the next eager DTensor embedding of the same shapes, on real tensors,
failed comparing its mask with it ("Please convert all Tensors to FakeTensors first").
Only placements and shapes are checked here: the fake group's collectives return garbage.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import torch_hca as hca
from torch_hca.compiler.layout import probes as layout_probes

VOCAB, DIM, OUT = 64, 32, 8


@pytest.fixture(autouse=True)
def _fresh_probes():
    """The solver caches its probes per process; each test must probe DTensor itself."""
    layout_probes._PROBES.clear()
    yield


def _model():
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, OUT))


def _eager_dtensor_program(mesh, ids):
    """Embedding with a vocabulary-sharded table, then a column-parallel linear, in eager DTensor."""
    table = distribute_tensor(torch.randn(VOCAB, DIM), mesh, [Shard(0)])
    weight = distribute_tensor(torch.randn(OUT, DIM), mesh, [Shard(0)])
    x = distribute_tensor(ids, mesh, [Replicate()])
    h = F.embedding(x, table)  # _MaskPartial: each rank looks up its rows, masks the rest
    h = h.redistribute(mesh, [Replicate()])
    y = F.linear(h, weight).redistribute(mesh, [Replicate()])
    return y


def test_eager_dtensor_after_plan(fake_pg):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 8))
    plan = hca.plan(_model(), (ids,))
    assert set(plan) == {"0.weight", "1.weight", "1.bias"}
    y = _eager_dtensor_program(fake_pg, ids)
    assert isinstance(y, DTensor) and y.placements == (Replicate(),)
    assert tuple(y.shape) == (2, 8, OUT) and not isinstance(y._local_tensor, torch._subclasses.FakeTensor)


def test_eager_dtensor_after_a_plan_that_failed(fake_pg):
    # The probes ran before the budget check failed: the cache is cleared on the way out too.
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(hca.PlanError, match="no layout fits memory_budget"):
        hca.plan(_model(), (ids,), memory_budget=1_000)
    y = _eager_dtensor_program(fake_pg, ids)
    assert y.placements == (Replicate(),) and tuple(y.shape) == (2, 8, OUT)
