"""The transpose pass on hand-made joint graphs: pairs, cotangent reductions, strict mode."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import torch_hca as hca
from torch_hca.options import Options
from torch_hca.passes.infra import PassContext
from torch_hca.passes.transpose import PARTNER, RULE, TransposePass
from torch_hca.report import GraphReport


def joint(fn, *shapes) -> fx.GraphModule:
    """A graph whose inputs are named like AOTAutograd's: primals, then tangents."""
    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for i, p in enumerate(placeholders):
        p.name = p.target = "tangents_1" if i == len(placeholders) - 1 else f"primals_{i + 1}"
    gm.recompile()
    return gm


def run(gm, strict=False):
    ctx = PassContext(Options(strict=strict), GraphReport(index=0, options=None))
    TransposePass().run(gm, ctx)
    return {n.name: (n.meta.get(PARTNER), n.meta.get(RULE)) for n in gm.graph.nodes if RULE in n.meta}


def test_all_gather_pairs_with_the_backward_reduce_scatter(fake_pg):
    group = dist.group.WORLD

    def fn(x, g):  # forward gathers x; backward scatters the cotangent g
        return funcol.all_gather_single(x, 0, group), funcol.reduce_scatter_single(g, "sum", 0, group)

    labels = run(joint(fn, (2, 3), (8, 3)))
    (fw,) = [k for k in labels if k.startswith("all_gather")]
    (bw,) = [k for k in labels if k.startswith("reduce_scatter")]
    assert labels[bw][0] == fw and labels[fw][0] == bw
    assert labels[bw][1].startswith("transpose of")


def test_backward_all_reduce_is_a_cotangent_reduction(fake_pg):
    labels = run(joint(lambda x, g: (x * 2, funcol.all_reduce(g, "sum", dist.group.WORLD)), (4,), (4,)))
    ((partner, rule),) = labels.values()
    assert partner is None and rule.startswith("cotangent reduction")


def test_strict_mode_rejects_an_unpaired_backward_collective(fake_pg):
    gm = joint(lambda x, g: (x * 2, funcol.reduce_scatter_single(g, "sum", 0, dist.group.WORLD)), (4,), (8,))
    assert "no forward partner" in next(iter(run(gm).values()))[1]
    gm = joint(lambda x, g: (x * 2, funcol.reduce_scatter_single(g, "sum", 0, dist.group.WORLD)), (4,), (8,))
    with pytest.raises(hca.CheckError, match="reduce_scatter .* transposes no forward collective"):
        run(gm, strict=True)
