"""The verifier's numerical refinement check (torch_hca/verify/numeric.py): every rank of a real
strategy file run in one process, float64, against the model's logical program; corruptions the
structural rules pass are caught there and the first value that differs is named."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import torch_hca as hca
from torch_hca.tools import zoo
from torch_hca.report import strategy_file
from torch_hca.verify import pieces as P
from torch_hca.verify import problems, rules
from torch_hca.verify.numeric import check

from dist_cases import fake_world
from test_verify import _remove_collective, _saved


@pytest.fixture(scope="module")
def tp_file(tmp_path_factory):
    """TransformerBlock under TP_BLOCK, fake world 4: Partial values, all_reduces, a cotangent reduction."""
    with fake_world(4):
        model = hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512))
        return _saved(model, torch.randn(2, 6, 128), tmp_path_factory.mktemp("tp") / "s.json")


def _model():
    return zoo.TransformerBlock(128, 4, 512)  # plain: the check draws its own float64 parameters


X = (torch.randn(2, 6, 128),)


def test_a_real_file_passes_every_value_and_gradient(tp_file):
    start = time.perf_counter()
    result = hca.verify(_model(), tp_file, X)  # numeric on by default with example inputs
    assert result.ok and result.numeric is not None, result
    assert result.numeric.values >= 20 and result.numeric.gradients == 12 and not result.numeric.skipped
    assert "numerical refinement: " in str(result)
    print(f"\n{result} ({time.perf_counter() - start:.2f} s)")
    assert hca.verify(_model(), tp_file, X, numeric=False).numeric is None


def _drop_move(g: dict, node: str, value: str) -> None:
    """A move taken out of the file cleanly: its readers read `value`, its collectives gone."""
    m = next(m for m in g["moves"] if m["node"] == node)
    g["moves"].remove(m)
    del g["values"][node]
    for v in g["values"].values():
        v["reads"] = [value if r == node else r for r in v["reads"]]
    gone = {s["collective"] for s in m["steps"]}
    g["collectives"] = [c for c in g["collectives"] if c["id"] not in gone]
    g["issued"] = [i for i in g["issued"] if not set(i["members"]) & gone]
    kept = {i["id"] for i in g["issued"]}
    for grp in g["groups"].values():
        dropped = [k for k, i in enumerate(grp["forward"]) if i not in kept]
        grp["forward"] = [i for i in grp["forward"] if i in kept]
        for orders in grp.get("ranks", {}).values():  # each rank's posted order with it
            orders["forward"] = [c for k, c in enumerate(orders["forward"]) if k not in dropped]


def test_a_partial_written_as_replicate_is_named(tp_file):
    """The attention's output projection is Partial (row-parallel); written R with its all_reduce
    dropped, the file passes every structural rule but the op rules (its operands are cut on the
    contracted dim: a partial sum), and the numbers, run on their own, differ too."""
    broken = copy.deepcopy(tp_file)
    g = broken["graphs"][0]
    partial = next(n for n, v in g["values"].items() if v["placements"] == ["P(sum)"] and v["kind"] == "op")
    move = next(m["node"] for m in g["moves"] if m["value"] == partial)
    g["values"][partial]["placements"] = ["R"]
    _drop_move(g, move, partial)
    assert [(p.rule, p.where.split(" (")[0]) for p in problems(broken)] == [
        ("op placement", f"graph 0, value {partial!r}")
    ]
    found, _ = check(_model(), broken, X)
    assert [p.rule for p in found] == ["numerical refinement"], found
    assert found[0].where.startswith(f"graph 0, value {partial!r}") and "replicas differing" in found[0].says
    with pytest.raises(hca.StrategyError, match=rf"value '{partial}'.*rule 'op placement'.*R on mesh dim 0"):
        hca.verify(_model(), broken, X)


def test_a_shard_dim_changed_is_named(tp_file):
    """q is Shard(1) (heads); Shard(3) divides its shape too: the op rules tell (the transpose moves
    the heads dim, of size 4, to dim 1), and so do the numbers."""
    broken = copy.deepcopy(tp_file)
    broken["graphs"][0]["values"]["q"]["placements"] = ["S(3)"]
    assert [(p.rule, p.where) for p in problems(broken)] == [("op placement", "graph 0, value 'q' (transpose)")]
    found, summary = check(_model(), broken, X)
    assert len(found) == 1 and found[0].where == "graph 0, value 'q' (transpose)", found
    assert "['S(3)']" in found[0].says and "logical value has [2, 4, 6, 32]" in found[0].says


def test_a_dropped_cotangent_reduction_is_a_gradient_named(tp_file):
    """The forward is right; the layer norm output's cotangent reduction (at `reduce_cotangent`, Megatron's f) gone,
    the layer norm weight's gradient is not."""
    broken = copy.deepcopy(tp_file)
    g = broken["graphs"][0]
    reduction = next(c for c in g["collectives"] if c["direction"] == "backward" and c["origin"] == "reduce_cotangent")
    _remove_collective(broken, reduction["id"])
    assert problems(broken) == []  # "nothing owed is missing" looks one reader deep: it asks nothing here
    found, summary = check(_model(), broken, X)
    assert found and found[0].rule == "numerical refinement" and "gradient of parameter" in found[0].where, found
    assert summary.values >= 20  # every forward value agreed first


def test_in_place_means_an_update_not_a_name_ending_in_underscore():
    """``m & k`` is ``operator.and_`` (a new tensor; HF's masks are built so), ``m &= k`` is
    ``operator.iand``: only the second, and ``add_``, make the numerical check skip the graph."""
    import operator

    import torch.fx as fx

    from torch_hca.verify.float64 import in_place

    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    nodes = [
        g.call_function(operator.and_, (a, b)),
        g.call_function(operator.iand, (a, b)),
        g.call_method("add_", (a, b)),
        g.call_function(torch.add, (a, b)),
        g.call_function(torch.relu, (a,), {"inplace": True}),
    ]
    assert [in_place(n) for n in nodes] == [False, True, True, False, True]


def test_a_tied_weight_read_whole_and_by_a_split_batch_is_summed_once():
    """The zoo's BERT, Megatron plan, fake world 4: the solver computes the embeddings whole and cuts
    them by batch, and the tied MLM head reads a split batch, so the table's gradient mixes a whole
    contribution (the lookup's) with partial ones (the head's) before one all_reduce. DTensor adds
    the whole one as whole / n per rank; the check does too (it used to count it 4 times, a false
    alarm). Negative control: that all_reduce removed, the table's gradient is named."""
    import model_zoo
    from dist_cases import local_piece
    from torch_hca.report import strategy_file

    torch._dynamo.reset()
    with fake_world(4) as mesh:
        torch.manual_seed(0)
        ref, make_inputs, _ = model_zoo.build("bert")
        spec = model_zoo.plan_spec("bert", "megatron", 4, ref)
        xs = make_inputs(model_zoo.BATCH)
        model = hca.sharded(spec.plan, mesh=mesh, inputs=spec.inputs, outputs=spec.outputs)(copy.deepcopy(ref))
        compiled = torch.compile(model, backend="hca", options={"strict": True})
        compiled(*(local_piece(x, mesh, spec.inputs) for x in xs)).sum().backward()
        saved = strategy_file.build(hca.report(compiled))
    table = next(
        n for n, v in saved["graphs"][0]["values"].items() if v.get("parameter", "").endswith("word_embeddings.weight")
    )
    mark = next(n for n, v in saved["graphs"][0]["values"].items() if v["reads"] == [table])
    summed = [c for c in saved["graphs"][0]["collectives"] if c["direction"] == "backward" and c.get("origin") == mark]
    assert [c["kind"] for c in summed] == ["all_reduce"], summed
    found, summary = check(copy.deepcopy(ref), saved, xs)
    assert found == [] and summary.gradients > 30, (found, summary)
    broken = copy.deepcopy(saved)
    _remove_collective(broken, summed[0]["id"])
    found, _ = check(copy.deepcopy(ref), broken, xs)
    assert found and "word_embeddings.weight" in found[0].where, found


def test_a_dim_cut_by_two_mesh_dims_is_taken_apart_inner_mesh_dim_first():
    """S(0),S(0) -> S(1),S(2) on a (2, 2) mesh: the file writes DTensor's order (mesh dim 1's
    all_to_all first), which simulated step by step gives back the value; the other order (what
    files said before 2026-12-08) mixes the rows of other ranks, and the rule 'nested order' names it."""
    mesh = {"shape": [2, 2], "ranks": [[0, 1], [2, 3]]}
    steps = strategy_file._move_steps(["S(0)", "S(0)"], ["S(1)", "S(2)"], [8, 4, 6], "float64", mesh)
    assert [(s["mesh_dim"], s["src"], s["dst"]) for s in steps] == [(1, "S(0)", "S(2)"), (0, "S(0)", "S(1)")]
    grid = P.Mesh([2, 2], mesh["ranks"])
    x = torch.randn(8, 4, 6, dtype=torch.float64)

    def run(order):
        pieces = P.cut(x, ["S(0)", "S(0)"], grid)
        for s in order:
            pieces = P.step(pieces, grid, s["mesh_dim"], s["src"], s["dst"], "all_to_all")
        return P.assemble(pieces, ["S(1)", "S(2)"], grid)[0]

    assert torch.equal(run(steps), x) and not torch.equal(run(steps[::-1]), x)
    collectives = []
    for i, s in enumerate(steps):  # each step's forward all_to_all, as the file links them
        s["collective"] = f"forward:all_to_all_{i}"
        collectives.append(
            {"id": s["collective"], "kind": "all_to_all", "mesh_dim": s["mesh_dim"], "bytes": s["bytes"]}
            | {"direction": "forward", "partner": None}
        )
    G = rules.Graph(0, {"values": {}, "moves": [], "collectives": collectives, "issued": []}, {"mesh": mesh})
    value = {"shape": [8, 4, 6], "dtype": "float64", "placements": ["S(0)", "S(0)"]}
    verdict = lambda order: list(rules._steps(G, "move", value, ["S(0)", "S(0)"], ["S(1)", "S(2)"], order))
    assert verdict(steps) == []
    found = verdict(steps[::-1])
    assert [p.rule for p in found] == ["nested order"] and "mesh dim 1 holds S(0)" in str(found[0]), found


def test_a_mean_over_the_ranks_pieces_hands_each_one_nth_of_the_cotangent():
    """P(avg) -> R (no backward collective): the exact adjoint of the mean is g / n on every rank;
    R -> P(avg) sums the n equal shares back to g."""
    grid = P.Mesh([4], [0, 1, 2, 3])
    xs = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    out = P.step(xs, grid, 0, "P(avg)", "R", None)
    assert torch.allclose(out[0], torch.stack(xs).mean(0).detach())
    g = torch.randn(3, dtype=torch.float64)
    torch.autograd.backward(out, [g] * 4)  # each rank's replica of the mean, its cotangent g
    assert all(torch.allclose(x.grad, g / 4) for x in xs)
    ys = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    torch.autograd.backward(P.step(ys, grid, 0, "R", "P(avg)", None), [g / 4] * 4)
    assert all(torch.allclose(y.grad, g) for y in ys)
