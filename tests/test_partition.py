"""torch_hca/compiler/partition.py: the copies of forward collectives AOTAutograd's partition leaves
in the backward, read by nothing, leave it with the ops that fed them; what is read stays."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torch_hca.compiler.partition import without_unread_collectives

GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _backward(read_gather: bool) -> fx.GraphModule:
    """x, w -> x * 2, beside a copy of the forward's x @ w gathered over 2 ranks (its result read
    by a view and nothing else, as the partition leaves it), and, if `read_gather`, returned too."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    gathered = g.call_function(WAIT, (g.call_function(GATHER, (mm, 2, "0")),))
    view = g.call_function(torch.ops.aten.view.default, (gathered, [-1]))
    doubled = g.call_function(operator.mul, (x, 2))
    g.output((doubled, view) if read_gather else (doubled,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_an_unread_collective_and_what_fed_it_leave_the_backward():
    gm = _backward(read_gather=False)
    assert without_unread_collectives(gm) == ["all_gather_into_tensor_default", "wait_tensor_default"]
    left = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert left == [operator.mul]  # the matmul and the view went with the gather
    x = torch.randn(3, 4)
    assert torch.equal(gm(x, torch.randn(4, 5))[0], x * 2)


def test_a_read_collective_stays():
    gm = _backward(read_gather=True)
    assert without_unread_collectives(gm) == []
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(GATHER) == 1
