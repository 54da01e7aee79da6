"""The table of collective kinds (`torch_hca.spmd.collective_kinds`).

* Every kind against its transpose: ``<A x, y> = <x, A^T y>`` summed over the
  mesh, on real gloo ranks at world sizes 2 and 4, fp64 and fp32, parameters
  drawn by hypothesis in this process (rank work in tests/collective_cases.py).
* Every emitter issues exactly the `_c10d_functional` ops it claims (fake
  process group, traced with make_fx).
* The table itself: closed under transposition, no duplicate registration,
  ring byte anchors.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import collective_cases
from torch_hca.spmd import collective_kinds as ck
from torch_hca.spmd import collective_nodes as cn
from torch_hca.spmd.collective_kinds import RULES, Kind, bytes_per_rank
from torch_hca.spmd.collective_nodes import OPS, WAIT
from torch_hca.errors import CheckError, CollectiveError

WORLD_SIZES = (2, 4)
TOLERANCE = {"torch.float64": 1e-10, "torch.float32": 1e-5}


# ------------------------------------------------------------ drawn cases


def _dim(draw, ndim: int) -> int:
    return draw(st.integers(-ndim, ndim - 1))


def _index(draw, high: int) -> list:
    """1-d (index_select) or 2-d (embedding) indices below `high`, repeats likely."""
    values = st.integers(0, high - 1)
    if draw(st.booleans()):
        return draw(st.lists(values, min_size=1, max_size=6))
    rows = draw(st.integers(1, 3))
    return draw(st.lists(st.lists(values, min_size=rows, max_size=rows), min_size=1, max_size=3))


def _shape_with(shape: list[int], dim: int, sizes: list[int]) -> list[int]:
    dim %= len(shape)
    return shape[:dim] + sizes + shape[dim + 1 :]


def _params(draw, kind: Kind, n: int, shape: list[int]) -> tuple[list[int], dict]:
    ndim = len(shape)
    if kind is Kind.ALL_REDUCE:
        return shape, {}
    if kind in (Kind.BROADCAST, Kind.REDUCE, Kind.KEEP_ROOT):
        return shape, {"root": draw(st.integers(0, n - 1))}
    if kind is Kind.SCALED_ALL_REDUCE:
        return shape, {"scale": draw(st.one_of(st.none(), st.floats(-2.0, -0.01), st.floats(0.01, 2.0)))}
    if kind is Kind.WEIGHTED_ALL_REDUCE:  # uneven shares: each rank's share of the rows
        shares = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
        return shape, {"weights": tuple(s / sum(shares) for s in shares), "after": draw(st.booleans())}
    if kind in (Kind.ALL_GATHER, Kind.ZERO_EMBED):
        return shape, {"dim": _dim(draw, ndim)}
    if kind in (Kind.REDUCE_SCATTER, Kind.LOCAL_CHUNK):
        dim = _dim(draw, ndim)
        return _shape_with(shape, dim, [shape[dim] * n]), {"dim": dim}
    if kind is Kind.ALL_TO_ALL:
        a, b = draw(st.permutations(range(ndim)))[:2]
        return _shape_with(shape, b, [shape[b] * n]), {"src_dim": a, "dst_dim": b}
    if kind is Kind.PERMUTE:
        if draw(st.booleans()):
            return shape, {"shift": draw(st.integers(-2 * n, 2 * n))}
        return shape, {"perm": tuple(draw(st.permutations(range(n))))}
    dim = _dim(draw, ndim)
    if kind is Kind.GATHER:
        return shape, {"dim": dim, "index": _index(draw, shape[dim]), "length": shape[dim]}
    length = draw(st.integers(1, 4))  # INDEX_ADD: the rows land in `length` slots
    index = _index(draw, length)
    index_shape = list(torch.tensor(index).shape)
    return _shape_with(shape, dim, index_shape), {"dim": dim, "index": index, "length": length}


@st.composite
def cases(draw, kind: Kind, n: int) -> dict:
    ndim = draw(st.integers(2 if kind is Kind.ALL_TO_ALL else 1, 3))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    shape, params = _params(draw, kind, n, shape)
    return {"shape": shape, "params": params, "seed": draw(st.integers(0, 2**16))}


# ------------------------------------------------------- adjoint identities


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_adjoint_identity_on_gloo(worlds, kind, n):
    # No shrinking: each example is a run on real ranks, and a failure restarts them.
    @settings(max_examples=3, deadline=None, database=None, phases=(Phase.explicit, Phase.generate))
    @given(st.lists(cases(kind, n), min_size=3, max_size=5))
    def check(batch):
        results = worlds(n).run(collective_cases.adjoint_cases, kind.value, batch)
        for r in results[0]:
            assert "error" not in r, r
            assert r["rel"] <= TOLERANCE[r["dtype"]], f"{kind.value} {r}"
        assert all(res == results[0] for res in results), "ranks disagree on the mesh-wide sums"

    check()


# ------------------------------------------------- emitters and their ops

EXAMPLES = {  # one concrete call per kind, at world size 4
    Kind.BROADCAST: ((4, 3), {"root": 2}),
    Kind.REDUCE: ((4, 3), {"root": 1}),
    Kind.ALL_REDUCE: ((4, 3), {}),
    Kind.SCALED_ALL_REDUCE: ((4, 3), {"scale": 0.5}),
    Kind.WEIGHTED_ALL_REDUCE: ((4, 3), {"weights": (0.125, 0.125, 0.25, 0.5), "after": False}),
    Kind.ALL_GATHER: ((2, 3), {"dim": 1}),
    Kind.REDUCE_SCATTER: ((4, 8), {"dim": 1}),
    Kind.ALL_TO_ALL: ((2, 8), {"src_dim": 0, "dst_dim": 1}),
    Kind.PERMUTE: ((2, 3), {"shift": 1}),
    Kind.LOCAL_CHUNK: ((8, 3), {"dim": 0}),
    Kind.ZERO_EMBED: ((2, 3), {"dim": 0}),
    Kind.GATHER: ((5, 3), {"dim": 0, "index": torch.tensor([1, 1, 4]), "length": 5}),
    Kind.INDEX_ADD: ((3, 2), {"dim": 0, "index": torch.tensor([0, 0, 2]), "length": 4}),
    Kind.KEEP_ROOT: ((4, 3), {"root": 3}),
}


def _c10d_counts(gm: torch.fx.GraphModule) -> Counter:
    return Counter(
        n.target
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
    )


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_emitter_issues_exactly_its_ops(fake_pg, kind):
    shape, params = EXAMPLES[kind]
    group = dist.group.WORLD.group_name
    gm = make_fx(lambda x: RULES[kind].emit(x, group, **params))(torch.randn(shape))
    ops = RULES[kind].ops
    want = Counter(ops) + (Counter({WAIT: len(ops)}) if ops else Counter())
    assert _c10d_counts(gm) == want


def test_emitters_read_back_as_their_kind():
    # The graph readers (report, schedule check, transpose pass) know every op an emitter issues.
    shares = {
        Kind.REDUCE: Kind.ALL_REDUCE,
        Kind.SCALED_ALL_REDUCE: Kind.ALL_REDUCE,
        Kind.PERMUTE: Kind.ALL_TO_ALL,
        Kind.WEIGHTED_ALL_REDUCE: Kind.ALL_REDUCE,
    }
    for kind, rule in RULES.items():
        for op in rule.ops:
            assert OPS[op].kind is shares.get(kind, kind), (kind, op)


def test_every_kind_has_one_rule_and_the_table_is_closed_under_transpose():
    assert set(RULES) == set(Kind)
    for kind, rule in RULES.items():
        assert rule.kind is kind and RULES[rule.transpose].transpose is kind
        shape, params = EXAMPLES[kind]
        back = RULES[rule.transpose].transpose_params(rule.transpose_params(params))
        assert back.keys() == params.keys() and all(
            torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v for k, v in params.items()
        ), (kind, params, back)
    # The pairs of the transpose table (docs/theory.md, section 3).
    assert {(k, r.transpose) for k, r in RULES.items()} >= {
        (Kind.BROADCAST, Kind.REDUCE),
        (Kind.ALL_GATHER, Kind.REDUCE_SCATTER),
        (Kind.REDUCE_SCATTER, Kind.ALL_GATHER),
        (Kind.ALL_REDUCE, Kind.ALL_REDUCE),
        (Kind.SCALED_ALL_REDUCE, Kind.SCALED_ALL_REDUCE),
        (Kind.WEIGHTED_ALL_REDUCE, Kind.WEIGHTED_ALL_REDUCE),
        (Kind.ALL_TO_ALL, Kind.ALL_TO_ALL),
        (Kind.PERMUTE, Kind.PERMUTE),
        (Kind.LOCAL_CHUNK, Kind.ZERO_EMBED),
        (Kind.GATHER, Kind.INDEX_ADD),
    }


def test_what_is_left_of_a_sum_when_its_input_is_already_summed():
    # hca.collectives' backward for dst R: the transpose's move R -> X instead of P -> X.
    assert ck.already_summed(Kind.ALL_REDUCE) == ()
    assert ck.already_summed(Kind.REDUCE_SCATTER) == (Kind.LOCAL_CHUNK,)
    assert ck.already_summed(Kind.REDUCE) == (Kind.KEEP_ROOT,)
    for kind in (
        Kind.ALL_GATHER,
        Kind.ALL_TO_ALL,
        Kind.BROADCAST,
        Kind.PERMUTE,
        Kind.SCALED_ALL_REDUCE,
        Kind.WEIGHTED_ALL_REDUCE,
    ):
        assert ck.already_summed(kind) is None, kind


def test_transpose_params():
    assert RULES[Kind.ALL_TO_ALL].transpose_params({"src_dim": 0, "dst_dim": 2}) == {"src_dim": 2, "dst_dim": 0}
    assert RULES[Kind.PERMUTE].transpose_params({"shift": 3}) == {"shift": -3}
    assert RULES[Kind.PERMUTE].transpose_params({"perm": (2, 0, 3, 1)}) == {"perm": (1, 3, 0, 2)}
    # Weight before the sum (each rank's share of a mean) <-> weight after it (its cotangent).
    assert RULES[Kind.WEIGHTED_ALL_REDUCE].transpose_params({"weights": (0.25, 0.75)}) == {
        "weights": (0.25, 0.75),
        "after": True,
    }


def test_a_duplicate_registration_raises():
    with pytest.raises(CheckError, match="all_reduce registered twice"):
        ck._kind(Kind.ALL_REDUCE, "P -> R", Kind.ALL_REDUCE, ck._ring_twice)(lambda x, g, r, n: x)
    with pytest.raises(CheckError, match="registered twice"):
        cn._register(torch.ops._c10d_functional.all_reduce.default, cn.OpInfo(Kind.ALL_REDUCE, "input", 2))


def test_bytes_per_rank_ring_anchors():
    s, n = 1024, 4
    assert bytes_per_rank(Kind.ALL_REDUCE, s, n) == 2 * (n - 1) / n * s
    assert bytes_per_rank(Kind.SCALED_ALL_REDUCE, s, n) == 2 * (n - 1) / n * s
    for kind in (Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.ALL_TO_ALL, Kind.BROADCAST, Kind.REDUCE):
        assert bytes_per_rank(kind, s, n) == (n - 1) / n * s, kind
    assert bytes_per_rank(Kind.PERMUTE, s, n) == s and bytes_per_rank(Kind.PERMUTE, s, 1) == 0
    for kind in (Kind.LOCAL_CHUNK, Kind.ZERO_EMBED, Kind.GATHER, Kind.INDEX_ADD, Kind.KEEP_ROOT):
        assert bytes_per_rank(kind, s, n) == 0 and not RULES[kind].communicates
    for kind, rule in RULES.items():  # a transpose moves what its forward moves
        assert bytes_per_rank(kind, s, n) == bytes_per_rank(rule.transpose, s, n)
    assert RULES[Kind.ALL_REDUCE].wire_bytes(s, n) == bytes_per_rank(Kind.ALL_REDUCE, s, n)
    with pytest.raises(CollectiveError, match="group_size >= 1"):
        bytes_per_rank(Kind.ALL_REDUCE, s, 0)


@pytest.mark.parametrize(
    "kind, shape, params, message",
    [
        (Kind.REDUCE_SCATTER, (6, 3), {"dim": 0}, "cannot split evenly"),
        (Kind.LOCAL_CHUNK, (3, 5), {"dim": -1}, "cannot split evenly"),
        (Kind.ALL_TO_ALL, (4, 4), {"src_dim": 1, "dst_dim": 1}, "must differ"),
        (Kind.ALL_GATHER, (4, 4), {"dim": 2}, "out of range"),
        (Kind.BROADCAST, (4,), {"root": 4}, "not a rank of a group of 4"),
        (Kind.PERMUTE, (4,), {"perm": (0, 0, 1, 2)}, "not a permutation"),
    ],
)
def test_bad_parameters_raise_before_communicating(fake_pg, kind, shape, params, message):
    with pytest.raises(CollectiveError, match=message):
        RULES[kind].emit(torch.randn(shape), dist.group.WORLD.group_name, **params)


# ----------------------------------------------------------------------------- the move table

_AR, _AG, _RS, _A2A = ck.Kind.ALL_REDUCE, ck.Kind.ALL_GATHER, ck.Kind.REDUCE_SCATTER, ck.Kind.ALL_TO_ALL
# (src, dst) on one mesh dim -> (forward kind, kinds its backward may issue), for every pair the solver costs.
MOVES = {
    ("R", "R"): (None, {_AR}),  # only the cotangent reduction of a replicated value
    ("R", "P"): (None, {_AR}),
    ("R", "S0"): (None, {_AG, _AR}),  # local chunk; its transpose is zero-embed + sum: all_gather
    ("P", "R"): (_AR, {_AR}),  # the cotangent may arrive replicated (nothing) or partial
    ("P", "P"): (None, {_AR}),  # a partial result's cotangent may arrive partial: summed
    ("P", "S0"): (_RS, {_AG}),
    ("S0", "R"): (_AG, {_RS}),  # reduce_scatter when the cotangent arrives partial
    # P's cotangent is replicated (a local chunk back) or arrives partial: summed (whole or in pieces).
    ("S0", "P"): (_AG, {_AR, _RS}),
    ("S0", "S0"): (None, set()),
    ("S0", "S1"): (_A2A, {_A2A, _AG}),  # gloo moves all_to_all as all_gather + keep a piece
}


@pytest.mark.parametrize("src,dst", list(MOVES))
def test_the_move_table_says_how_to_move_and_transpose_every_pair(src, dst):
    forward, backward = MOVES[src, dst]
    assert ck.move_kind(src, dst) is forward
    assert ck.backward_kinds(src, dst) == backward
    if forward is not None and backward:  # a communicating move transposes to its physical transpose
        assert ck.RULES[forward].transpose in backward


def test_a_nested_shard_counts_the_gather_and_recut_of_its_outer_dim():
    from torch_hca.passes.origins import Origin

    # (S1, S1) -> (S1, R): the inner cut of tensor dim 1 changes, so DTensor gathers and re-cuts dim 0's too.
    origin = Origin("m", "redistribute", (("S1", "S1"),), ("S1", "R"))
    assert ("S1", "R") in origin.transition(0) and _AG in origin.backward_kinds(0)
    assert origin.transition(1) == [("S1", "R")]
