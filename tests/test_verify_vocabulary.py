"""The verifier's reading of the vocabulary-parallel loss (torch_hca/verify/vocabulary.py): the
re-traced ``F.cross_entropy`` expanded as the file lists it, each rank's log-sum-exp column and
target logit run in float64; a real file accepted, its corruptions named.

The file is real: `HeadLoss` (head and embedding stored by vocabulary rows) compiled on a fake
process group of 2 ranks, saved once per module; the checks run against the plain module."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import torch_hca as hca
from torch_hca.verify import problems, vocabulary
from torch_hca.verify.numeric import check

from cross_entropy_cases import HeadLoss
from dist_cases import fake_world

VOCAB = 8192


def _inputs():
    torch.manual_seed(1)
    ids, labels = torch.randint(0, VOCAB, (4, 16)), torch.randint(0, VOCAB, (4, 16))
    labels[0, :5] = -100
    return ids, labels


@pytest.fixture(scope="module")
def head_file(tmp_path_factory):
    with fake_world(2):
        plan = {"emb.weight": Shard(0), "head.weight": Shard(0)}
        model = hca.sharded(plan, inputs=Replicate(), outputs=Replicate())(HeadLoss(VOCAB))
        torch._dynamo.reset()
        c = torch.compile(model, backend="hca", options={"strict": True, "schedule": False}, dynamic=False)
        c(*_inputs()).backward()
        return hca.report(c).save_strategy(tmp_path_factory.mktemp("ce") / "s.json")


@pytest.mark.parametrize("classes,pieces", [(10, 4), (8, 2), (7, 3), (3, 4)])  # uneven, even, an empty piece
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_expansion_is_the_loss_on_one_device(classes, pieces, reduction):
    torch.manual_seed(0)
    x = torch.randn(12, classes, dtype=torch.float64)
    t = torch.randint(0, classes, (12,))
    t[:3] = -100
    lse = torch.logsumexp(vocabulary.chunk_logsumexp(x, pieces), 1)
    nll = (lse - vocabulary.pick(x, t, -100)) * (t != -100)
    got = {"mean": lambda: nll.sum() / (t != -100).sum(), "sum": nll.sum, "none": lambda: nll}[reduction]()
    torch.testing.assert_close(got, F.cross_entropy(x, t, reduction=reduction), rtol=1e-12, atol=1e-12)
    assert torch.chunk(x, pieces, 1)[0].shape[1] == -(-classes // pieces)  # pieces cut as torch.chunk


def test_the_file_is_accepted_and_every_value_compared(head_file):
    ops = {v["op"].rsplit(".", 1)[-1] for v in head_file["graphs"][0]["values"].values()}
    assert {"chunk_logsumexp", "pick"} <= ops  # the compiler expanded the loss
    result = hca.verify(HeadLoss(VOCAB), head_file, _inputs())
    assert result.ok and "15 by name, 0 by shape, 0 unpaired" in result.model, result
    assert result.numeric.values >= 15 and result.numeric.gradients == 4 and not result.numeric.skipped, result


def test_a_partial_target_logit_written_replicated_is_named(head_file):
    """`pick` on logits split by classes is a Partial sum: written R, the ranks' pieces differ. The op
    rules do not read `pick` (the compiler's own op) but name its reader: `sub` of a partial and a
    replicated value written partial."""
    broken = copy.deepcopy(head_file)
    broken["graphs"][0]["values"]["pick"]["placements"] = ["R"]
    assert [(p.rule, p.where) for p in problems(broken)] == [("op placement", "graph 0, value 'sub' (_operator.sub)")]
    found, _ = check(HeadLoss(VOCAB), broken, _inputs())
    assert [p.rule for p in found] == ["numerical refinement"], found
    assert found[0].where.startswith("graph 0, value 'pick'") and "replicas differing" in found[0].says, found


def test_a_log_sum_exp_split_by_rows_is_named(head_file):
    """The per-piece log-sum-exp of logits split by classes is split by columns; its move rewritten
    to gather rows (the same all_gather, the same bytes) passes the rules, not the numbers."""
    broken = copy.deepcopy(head_file)
    g = broken["graphs"][0]
    g["values"]["chunk_logsumexp"]["placements"] = ["S(0)"]
    move = next(m for m in g["moves"] if m["value"] == "chunk_logsumexp")
    move["src"], move["steps"][0]["src"] = ["S(0)"], "S(0)"
    assert problems(broken) == []
    found, _ = check(HeadLoss(VOCAB), broken, _inputs())
    assert len(found) == 1 and found[0].where.startswith("graph 0, value 'chunk_logsumexp'"), found
    assert "['S(0)']" in found[0].says, found


def test_a_log_sum_exp_written_replicated_is_named_by_the_rules(head_file):
    broken = copy.deepcopy(head_file)
    broken["graphs"][0]["values"]["chunk_logsumexp"]["placements"] = ["R"]
    found = hca.verify(HeadLoss(VOCAB), broken, _inputs(), raise_on_failure=False).problems
    assert any(p.rule == "move source" and "chunk_logsumexp" in str(p) for p in found), found


def test_a_file_without_the_expansion_is_not_expanded():
    """A vocabulary split in the model section but no chunk_logsumexp in the graph: the call stays."""
    graphs = []
    gm = torch.fx.symbolic_trace(lambda x, t: F.cross_entropy(x, t))
    graphs.append((gm, {}, []))
    data = {"mesh": {"shape": [2]}, "model": {"parameters": {"w": {"shape": [8, 4], "placements": ["S(0)"]}}}}
    assert vocabulary.expand(graphs, {**data, "graphs": [{"values": {}}]}) == 0
    assert any(n.target is F.cross_entropy for n in gm.graph.nodes)


@pytest.mark.parametrize("padding_idx", [None, 2, 6, -1])
@pytest.mark.parametrize("world", [2, 3])
def test_a_lookup_in_a_table_cut_by_rows_sums_to_the_whole_lookup(padding_idx, world):
    """`pieces.lookup` on each rank (rows as torch.chunk cuts them, 7 rows over 2 or 3 ranks) summed
    is the one-device lookup, its gradient too; the padding row gets no gradient on the rank holding it."""
    from torch_hca.verify import pieces as P

    torch.manual_seed(0)
    table = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 2, 6], [3, 6, 1]])
    mesh = P.Mesh([world], list(range(world)))
    parts = [p.detach().requires_grad_() for p in torch.chunk(table.detach(), world)]
    kwargs = {"padding_idx": padding_idx}
    got = sum(P.lookup(F.embedding, (ids, parts[r]), kwargs, ["S(0)"], mesh, r, 7) for r in range(world))
    want = F.embedding(ids, table, padding_idx)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    cot = torch.randn_like(want)
    (got * cot).sum().backward()
    (want * cot).sum().backward()
    torch.testing.assert_close(torch.cat([p.grad for p in parts]), table.grad, rtol=1e-12, atol=1e-12)
