"""DTensor's sharding rules against ground truth, for the op families our models use.

The layout pass picks input placements under which DTensor runs an op without
moving any argument by itself, and then trusts the output placement DTensor
claims. This file checks that trust: for each family (tests/op_family_cases.py)
and each combination of input placements (Replicate, Shard(d) for every dim,
Partial for float inputs) on a 1-D mesh of 2 and of 4 ranks, and a sample on a
2x2 mesh, a combination that DTensor accepts with no implicit redistribution
(`torch_hca._torch_private.record_implicit_redistributions` records none) must
give, reassembled from the claimed output placement, the single-device result
(fp32, max error relative to the largest value at most 1e-5).

How the ranks run: LocalTensor (`torch.distributed._local_tensor`), every rank
in this process over the fake process group of `fake_pg`. The fake group's own
collectives return garbage, but under LocalTensorMode collectives are done
on the ranks' local tensors, and an accepted combination runs none anyway.
LocalTensor handled every family here, so no family falls back to computing
per-rank pieces by hand. Inputs are cut and outputs reassembled by hand,
never by DTensor's own distribute/full_tensor, so a wrong rule cannot hide
behind a matching wrong redistribution.

2x2 mesh: every combination for one-input families (at most 36). For the
others all combinations would be thousands and DTensor's own propagation is
slow there (about a second each once a flattened sequence-sharded dim becomes
_StridedShard), so the candidates are pairs of combinations accepted on a 1-D
mesh (one per mesh dim) plus a few drawn from all, with a fixed seed.

Replicate outputs must agree on every rank (not just one copy). The
unflatten_tokens family also takes _StridedShard token dims, as DTensor's
flatten of a sequence-sharded batch leaves them; two of those DTensor labels
wrongly (KNOWN_WRONG below).

Each (family, mesh) case asserts at least one accepted combination with a
sharded input, so no case passes by accepting only all-Replicate.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import op_family_cases as cases
from torch_hca.compiler.layout import candidates as layout_candidates
from op_family_cases import BY_NAME, RTOL, Mismatch

MESHES = [
    pytest.param(2, (2,), id="ws2"),
    pytest.param(4, (4,), id="ws4"),
    pytest.param(4, (2, 2), id="2x2"),
]
# 2x2 candidates per family: every combination if at most FULL_2D, else pairs of
# 1-D accepted combinations and a few drawn ones.
FULL_2D, PAIRS_2D, DRAWN_2D = 36, 10, 4
# DTensor's propagation takes about a second per combination where a flattened
# sequence-sharded dim becomes _StridedShard (3-D linear, 4-D matmul).
FEWER_2D = {"linear_3d": (6, 2), "linear_3d_bias": (6, 2), "matmul_4d": (3, 1), "hca_attention_gqa_mask": (3, 1)}

# DTensor rules found wrong here (torch 2.13): (family, mesh shape) -> input placements
# that DTensor accepts without moving anything and then labels wrongly (confirmed on
# real gloo ranks with DTensor's own full_tensor). They are always tried and must stay
# wrong; when a torch upgrade fixes one, the test says so.
# Both are aten.view (32, 8) -> (4, 8, 8) of a _StridedShard token dim whose split
# factor is not the batch size as the local piece sees it:
KNOWN_WRONG = {
    # claims _S(1, 2) (seq rows {i, 4+i}); rank i holds seq half i%2 of batches i//2, i//2+2
    ("unflatten_tokens", (4,)): [((_StridedShard(0, split_factor=2),),)],
    # claims (Shard(0), _S(1, 4)); the pieces are (Shard(0), _S(1, 2))
    ("unflatten_tokens", (2, 2)): [((Shard(0), _StridedShard(0, split_factor=4)),)],
}

_accepted_1d: dict[str, list] = {}  # family -> placements accepted on a 1-D mesh


def _mesh(fake_pg, shape):
    return fake_pg if len(shape) == 1 else init_device_mesh("cpu", shape)


def _candidates(family, mesh, fake_pg):
    if mesh.ndim == 1:
        return cases.combos_1d(family)
    if family.name not in _accepted_1d:  # this case ran alone: find them on the 4-rank line
        _accepted_1d[family.name] = [
            o.placements for c in cases.combos_1d(family) if (o := cases.run(family, fake_pg, c)) and o.accepted
        ]
    pairs, drawn = FEWER_2D.get(family.name, (PAIRS_2D, DRAWN_2D))
    accepted_1d = _accepted_1d[family.name]
    return cases.combos_2d(family, accepted_1d, drawn, pairs, seed=len(family.name), full_up_to=FULL_2D)


@pytest.mark.parametrize("fake_pg, mesh_shape", MESHES, indirect=["fake_pg"])
@pytest.mark.parametrize("name", list(BY_NAME))
def test_accepted_placements_match_single_device(name, fake_pg, mesh_shape):
    family, mesh = BY_NAME[name], _mesh(fake_pg, mesh_shape)
    known = KNOWN_WRONG.get((name, mesh_shape), [])
    candidates = [c for c in _candidates(family, mesh, fake_pg) if _offered(name, c)]
    candidates += [list(k) for k in known if list(k) not in candidates]
    accepted, wrong = [], {}
    for combo in candidates:
        outcome = cases.run(family, mesh, combo)
        if outcome is None or not outcome.accepted:
            continue
        accepted.append(outcome)
        try:
            err = cases.check(outcome)
        except Mismatch as e:
            wrong[outcome.placements] = f"{outcome.describe()}: {e}"
            continue
        if err > RTOL:
            wrong[outcome.placements] = f"{outcome.describe()}: relative error {err:.3g}"
    if mesh.ndim == 1:
        _accepted_1d[name] = [o.placements for o in accepted]
    sharded = sum(o.sharded for o in accepted)
    print(f"{name} mesh {mesh_shape}: {len(accepted)} accepted, {sharded} sharded, {len(wrong)} wrong")

    unexpected = [msg for p, msg in wrong.items() if p not in known]
    assert not unexpected, f"{name} on mesh {mesh_shape}: DTensor's output placement is wrong for\n" + "\n".join(
        unexpected
    )
    fixed = [p for p in known if p not in wrong]
    assert not fixed, f"{name} on mesh {mesh_shape}: no longer wrong, remove from KNOWN_WRONG: {fixed}"
    assert sharded >= 1, f"{name} on mesh {mesh_shape}: no sharded combination accepted; the check is vacuous"


def _offered(name: str, combo) -> bool:
    """Whether the layout solver offers these input placements at all.

    DTensor's convolution rule ignores the weight's placement (it gets most combinations
    wrong), so the solver reads a convolution's input whole or batch-split and its weight
    and bias whole (`layout_candidates.BATCH_SPLIT_ONLY`): only those are checked here.
    """
    if name not in layout_candidates.BATCH_SPLIT_ONLY:
        return True
    return all(layout_candidates.offered_read(name, i, tuple(layout)) for i, layout in enumerate(combo))


# -------------------------------------------- the checker itself can fail


def _caught(outcome, mesh, placements) -> bool:
    spec = types.SimpleNamespace(mesh=mesh, placements=placements, shard_order=None)
    try:
        return cases.check(outcome, spec) > RTOL
    except Mismatch:
        return True


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_wrong_claims_are_caught(fake_pg):
    """Reassembling by any placement other than the one DTensor claims must fail."""
    linear = BY_NAME["linear_3d"]
    partial = cases.run(linear, fake_pg, [(Shard(2),), (Shard(1),)])  # contracted dim sharded
    assert partial.accepted and partial.out_spec.placements == (Partial(),)
    assert not _caught(partial, fake_pg, (Partial(),))
    for wrong in [Replicate(), Partial("avg"), Shard(0), Shard(2)]:
        assert _caught(partial, fake_pg, (wrong,)), wrong

    rows = cases.run(linear, fake_pg, [(Shard(1),), (Replicate(),)])
    assert rows.accepted and rows.out_spec.placements == (Shard(1),)
    assert not _caught(rows, fake_pg, (Shard(1),))
    for wrong in [Replicate(), Partial(), Shard(0), Shard(2)]:
        assert _caught(rows, fake_pg, (wrong,)), wrong


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_cut_then_reassemble_is_identity(fake_pg):
    """Every pair of placements on a 2x2 mesh, same tensor dim twice included."""
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.randn(8, 8)
    options = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), Partial()]
    for p in options:
        for q in options:
            pieces = cases.cut(x, mesh, (p, q), torch.Generator().manual_seed(0))
            spec = types.SimpleNamespace(mesh=mesh, placements=(p, q), shard_order=None)
            assert cases.rel_err(cases.reassemble(pieces, spec), x) <= RTOL, (p, q)


@pytest.mark.parametrize("fake_pg", [4], indirect=True)
def test_strided_shard_reassembly(fake_pg):
    """_StridedShard as DTensor documents it: rows of 8 on a 2x2 mesh, right-to-left."""
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.arange(8.0).repeat_interleave(2).view(8, 2)
    rows = {0: [0, 1], 1: [4, 5], 2: [2, 3], 3: [6, 7]}  # rank -> rows it holds
    pieces = {r: x[idx] for r, idx in rows.items()}
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    cut = cases.cut(x, mesh, placements, torch.Generator())
    assert all(torch.equal(cut[r], pieces[r]) for r in rows)
    spec = types.SimpleNamespace(mesh=mesh, placements=placements, shard_order=None)
    assert torch.equal(cases.reassemble(pieces, spec), x)
