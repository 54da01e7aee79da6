"""The collective rewrite pass (passes/collective_rewrites.py).

Every rule is checked twice: by the collectives it leaves (kind, count) and by
ground truth, running the graph before and after the pass on real gloo ranks
at world sizes 2 and 4 with the same inputs (fp32, relative error <= 1e-6).
The cases themselves live in tests/rewrite_cases.py (importable by the ranks);
one rank call per world size runs them all. Graph-only checks (the pass
object, the table, agreement, goldens) run on the fake process group.
"""

from __future__ import annotations

import re
import warnings

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import rewrite_cases
from torch_hca.errors import CheckError
from torch_hca.compiler.options import Options
from torch_hca.passes import collective_rewrites as cr
from torch_hca.passes import rewrite_rules as rr
from torch_hca.passes.infra import PassContext, run_pass
from torch_hca.report.records import GraphReport

AR, AG, RS, A2A = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
RULE1, RULE2, RULE3 = "reduce_scatter_of_all_reduce", "local_shard_of_all_gather", "all_to_all_round_trip"
RULE4, RULE5, CAT = "all_reduce_of_gathered_scatter", "all_reduce_of_sum", "piece_of_cat"

# case -> (collectives before, collectives after, rules applied in order), the same on every rank.
EXPECT = {
    # 1. shard_r(all_reduce x) = reduce_scatter x
    "ar_chunk": ({AR: 1}, {RS: 1}, [RULE1]),
    "ar_chunk_dim1": ({AR: 1}, {RS: 1}, [RULE1]),
    "ar_slice": ({AR: 1}, {RS: 1}, [RULE1]),
    "ar_narrow_dim1": ({AR: 1}, {RS: 1}, [RULE1]),
    "ar_other_chunk": ({AR: 1}, {AR: 1}, []),  # another rank's piece
    "ar_chunk_0": ({AR: 1}, {AR: 1}, []),  # own piece on rank 0 only: the ranks must agree
    "ar_uneven": ({AR: 1}, {AR: 1}, []),  # pieces of unequal size
    "ar_full_used": ({AR: 1}, {AR: 1}, []),  # the whole sum is needed too
    # 2. shard_r(all_gather x) = x
    "ag_chunk": ({AG: 1}, {}, [RULE2]),
    "ag_chunk_dim1": ({AG: 1}, {}, [CAT, RULE2]),  # funcol's chunk/cat around a dim-1 gather first
    "ag_own_and_full": ({AG: 1}, {AG: 1}, []),  # the gather stays for its other use: nothing to gain
    "ag_other_chunk": ({AG: 1}, {AG: 1}, []),
    # 3. all_to_all(b->a)(all_to_all(a->b) x) = x
    "a2a_round_trip": ({A2A: 2}, {}, [RULE3]),
    "a2a_round_trip_uneven": ({A2A: 2}, {}, [RULE3]),
    "a2a_other_group": ({A2A: 2}, {A2A: 2}, []),
    "a2a_back_on_some_ranks": ({A2A: 2}, {A2A: 2}, []),  # sizes swap back on ranks 0 and 3 only
    # 4. all_gather(reduce_scatter x) = all_reduce x
    "rs_ag": ({RS: 1, AG: 1}, {AR: 1}, [RULE4]),
    "rs_ag_other_use": ({RS: 1, AG: 1}, {RS: 1, AG: 1}, []),
    "rs_ag_other_group": ({RS: 1, AG: 1}, {RS: 1, AG: 1}, []),
    # 5. all_reduce a + all_reduce b = all_reduce (a + b)
    "ar_sum": ({AR: 2}, {AR: 1}, [RULE5]),
    "ar_sum_three": ({AR: 3}, {AR: 1}, [RULE5, RULE5]),
    "ar_sum_alpha": ({AR: 2}, {AR: 1}, [RULE5]),
    "ar_sum_other_use": ({AR: 2}, {AR: 2}, []),
    "ar_sum_other_group": ({AR: 2}, {AR: 2}, []),
    "ar_sum_max": ({AR: 2}, {AR: 2}, []),  # max does not commute with +
    # several identities, to a fixed point
    "ar_sum_then_shard": ({AR: 2}, {RS: 1}, [RULE5, RULE1]),
    "rs_ag_then_shard": ({RS: 1, AG: 1}, {RS: 1}, [RULE4, RULE1]),
}
# The same, with the pass run inside the graph's fake mode (as in AOTAutograd's partitioner,
# where the ranks' agreement must step out of it).
EXPECT.update({f"{name}/in_fake_mode": EXPECT[name] for name in rewrite_cases.IN_FAKE_MODE})


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ws{n}")
def ranks(request, worlds):
    """Every case's result on every rank of a world of that size."""
    return worlds(request.param).run(rewrite_cases.run_all)


def test_cases_and_expectations_agree():
    names = list(rewrite_cases.cases(0, 2, None, None))
    assert sorted(names + [f"{n}/in_fake_mode" for n in rewrite_cases.IN_FAKE_MODE]) == sorted(EXPECT)


@pytest.mark.parametrize("case", EXPECT)
def test_rewrite(ranks, case):
    before, after, rules = EXPECT[case]
    for rank, results in enumerate(ranks):
        got = results[case]
        assert (got["before"], got["after"], got["rules"]) == (before, after, rules), f"rank {rank}: {got}"
        assert got["err"] <= 1e-6, f"rank {rank}: outputs differ after the rewrite, relative error {got['err']:.2e}"
        assert got["wrong_vals"] == [], f"rank {rank}: meta['val'] wrong on {got['wrong_vals']}"


@pytest.mark.parametrize(
    "case, rule, proposers",
    [
        ("ar_chunk_0", RULE1, lambda n: [0]),
        ("a2a_back_on_some_ranks", RULE3, lambda n: [0, 3] if n > 2 else []),
    ],
)
def test_a_match_some_ranks_lack_is_not_applied(ranks, case, rule, proposers):
    """These ranks found the match alone; rewriting only there would leave the others in the exchange."""
    found = [rank for rank, results in enumerate(ranks) if rule in results[case]["proposed"]]
    assert found == proposers(len(ranks))
    assert all(results[case]["rules"] == [] for results in ranks)


# ---------------------------------------------------------------- graph-only, fake process group


def _trace(fn, *shapes) -> fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def _own_chunk(x):
    # The fake process group is rank 0 of 4: piece 0 is this rank's.
    return torch.chunk(funcol.all_reduce(x, "sum", dist.group.WORLD), 4, dim=1)[0]


def test_rank_dependent_rewrites_need_every_rank(fake_pg):
    calls: list[list[str]] = []

    def nobody_else(keys):  # another rank did not find the match
        calls.append(keys)
        return set()

    gm = _trace(_own_chunk, (3, 8))
    assert cr.rewrite_collectives(gm, nobody_else) == []
    assert calls == [[f"{RULE1}@all_reduce"]]
    assert rewrite_cases.counts(gm) == {AR: 1}

    applied = cr.rewrite_collectives(gm, lambda keys: set(keys))
    assert [a.rule for a in applied] == [RULE1]
    assert rewrite_cases.counts(gm) == {RS: 1}


def test_without_fake_values_nothing_is_rewritten_but_ranks_still_agree(fake_pg):
    gm = fx.symbolic_trace(
        lambda x: torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0")) + 1
    )
    calls = []
    assert cr.rewrite_collectives(gm, lambda keys: calls.append(keys) or set(keys)) == []
    assert calls == [[]]  # one exchange, as on a rank that did find something


def test_symbolic_shapes_are_left_alone(fake_pg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        gm = make_fx(_own_chunk, tracing_mode="symbolic")(torch.randn(3, 8))
    assert cr.rewrite_collectives(gm) == []
    assert rewrite_cases.counts(gm) == {AR: 1}


def test_pass_object_through_the_driver(fake_pg):
    gm = _trace(_own_chunk, (3, 8))
    ctx = PassContext(Options(), GraphReport(index=0, options=Options()))
    p = cr.CollectiveRewritePass()
    assert (p.name, p.reads, p.writes) == (
        "collective_rewrites",
        "joint forward+backward graph (local tensors, _c10d_functional)",
        "the same graph with collective chains replaced by equal, cheaper ones",
    )
    out = run_pass(p, gm, ctx)  # lints the result
    (record,) = ctx.report.passes
    assert record.name == "collective_rewrites" and record.changed
    assert record.decisions == [
        f"{RULE1}: shard_r(all_reduce x) = reduce_scatter x; [all_reduce, wait_tensor, getitem] -> "
        "[split_tensor, getitem_4, getitem_5, getitem_6, getitem_7, cat_default, "
        "reduce_scatter_tensor_default, wait_tensor_default]"
    ]
    made = [n for n in out.graph.nodes if rr.REWRITE in n.meta]
    assert len(made) == 8 and all(n.meta[rr.REWRITE] == "shard_r(all_reduce x) = reduce_scatter x" for n in made)
    result = out.graph.find_nodes(op="output")[0].args[0]
    assert result.meta["val"].shape == (3, 2)

    again = cr.CollectiveRewritePass().run(out, ctx)  # a fixed point: nothing left to do
    assert not again.changed and again.decisions == []


def test_rule_table():
    names = [r.name for rules in rr.RULES.values() for r in rules]
    assert sorted(names) == sorted([RULE1, RULE2, RULE3, RULE4, RULE5, CAT])
    assert all(isinstance(op, torch._ops.OpOverload) for op in rr.RULES)
    assert {r.name for rules in rr.RULES.values() for r in rules if r.rank_dependent} == {RULE1, RULE2, RULE3}
    before = {op: list(rules) for op, rules in rr.RULES.items()}
    with pytest.raises(CheckError, match="registered twice"):
        rr.rule(torch.ops.aten.mul.Tensor, "x = x")(rr.all_reduce_of_sum)
    assert rr.RULES == before


def test_piece_reads_only_even_pieces(fake_pg):
    def pieces(x):
        return (torch.chunk(x, 4)[1], x[2:4], x[3:5], torch.split(x, 3)[1], x.narrow(1, 4, 2), x[::2], x[-2:])

    gm = _trace(pieces, (8, 6))
    out = gm.graph.find_nodes(op="output")[0].args[0]
    got = [(p.dim, p.index, p.pieces) if (p := rr.piece(n)) else None for n in out]
    # x[3:5] is off a piece boundary; split(x, 3) leaves a short last piece; x[::2] strides.
    assert got == [(0, 1, 4), (0, 1, 4), None, None, (1, 2, 3), None, (0, 3, 4)]


# ---------------------------------------------------------------- golden graphs

_LIVENESS = re.compile(r";  (?:\w+ = )+None$")


def _code(gm: fx.GraphModule) -> str:
    gm.recompile()
    return "\n".join(_LIVENESS.sub("", l.rstrip()) for l in gm.code.splitlines() if l.strip())


class Golden(expecttest.TestCase):
    """Regenerate with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_collective_rewrites.py``."""

    def setUp(self):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

    def tearDown(self):
        dist.destroy_process_group()

    def test_shard_of_all_reduce_along_dim_1(self):
        gm = _trace(_own_chunk, (3, 8))
        cr.rewrite_collectives(gm)
        self.assertExpectedInline(
            _code(gm),
            """\
def forward(self, x_1):
    split_tensor = torch.ops.aten.split.Tensor(x_1, 2, 1)
    getitem_4 = split_tensor[0]
    getitem_5 = split_tensor[1]
    getitem_6 = split_tensor[2]
    getitem_7 = split_tensor[3]
    cat_default = torch.ops.aten.cat.default([getitem_4, getitem_5, getitem_6, getitem_7], 0)
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(cat_default, 'sum', 4, '0')
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default)
    return wait_tensor_default""",
        )

    def test_sum_of_all_reduces_then_own_shard(self):
        world = dist.group.WORLD

        def fn(x, y):
            return torch.chunk(funcol.all_reduce(x, "sum", world) + funcol.all_reduce(y, "sum", world), 4)[0]

        gm = _trace(fn, (8, 3), (8, 3))
        applied = cr.rewrite_collectives(gm)
        self.assertExpectedInline(
            "\n".join(map(str, applied)),
            """\
all_reduce_of_sum: all_reduce a + all_reduce b = all_reduce (a + b); [all_reduce, all_reduce_1, wait_tensor, wait_tensor_1, add] -> [add_tensor, all_reduce_default, wait_tensor_default]
reduce_scatter_of_all_reduce: shard_r(all_reduce x) = reduce_scatter x; [all_reduce_default, wait_tensor_default, getitem] -> [reduce_scatter_tensor_default, wait_tensor_default_1]""",
        )
        self.assertExpectedInline(
            _code(gm),
            """\
def forward(self, x_1, y_1):
    add_tensor = torch.ops.aten.add.Tensor(x_1, y_1)
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(add_tensor, 'sum', 4, '0')
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default)
    return wait_tensor_default_1""",
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_sum_of_all_reduces_merged_in_the_backend(worlds, world_size):
    """Default options: all_reduce(a) + all_reduce(b) compiles to one all_reduce of a + b."""
    import dist_cases

    r = worlds(world_size).run(dist_cases.rewritten_sum_of_all_reduces)[0]
    assert r["out_err"] <= 1e-5 and r["grad_err"] <= 1e-5
    assert r["forward"] == {"all_reduce": 1}


@pytest.mark.parametrize("world_size", [2, 4])
def test_rewrite_in_the_backend_end_to_end(worlds, world_size):
    """Per-rank code compiled with rank_rewrites: all_reduce + own chunk becomes one reduce_scatter."""
    import dist_cases

    r = worlds(world_size).run(dist_cases.rewritten_per_rank_code)[0]
    assert r["out_err"] <= 1e-5 and r["grad_err"] <= 1e-5
    assert r["forward"] == {"reduce_scatter": 1}
    assert "rewritten by" in r["rules"][0]
    assert r["backward"] == {"all_reduce": 1}  # the I role: the rows' cotangents summed
