"""The op-family table (torch_hca/spmd/op_families.py) is the one answer to "is this a view?",
"is this a matmul?" and "how many FLOPs?": the timeline, the schedule pass and the emitter agree."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_hca.report.timeline import op_seconds
from torch_hca.spmd import events
from torch_hca.spmd.cost_model import DEFAULTS
from torch_hca.spmd.op_families import ATEN_MATMULS, TORCH_MATMULS, TORCH_VIEWS, is_view_op, torch_flops

aten = torch.ops.aten


def _program(x, w):
    y = torch.mm(x, w)
    z = aten._unsafe_view.default(y, [2, 4, 8])  # what a matmul's reshape decomposes to
    v = z.view(8, 8).t().transpose(0, 1).expand(8, 8)
    return (v * 2).relu().sum()


def _graph():
    return make_fx(_program)(torch.randn(8, 16), torch.randn(16, 8)).graph


def test_every_view_is_free_on_the_timeline_and_late_for_the_schedule():
    costs = DEFAULTS["gloo"]
    nodes = [n for n in _graph().nodes if n.op == "call_function"]
    views = [n for n in nodes if is_view_op(n.target)]
    assert {n.target for n in views} >= {
        aten._unsafe_view.default,
        aten.view.default,
        aten.t.default,
        aten.transpose.int,
        aten.expand.default,
    }
    for n in views:
        assert op_seconds(n, costs) == 0.0, n.format_node()
        assert events.is_view(n), n.format_node()


def test_compute_is_charged_and_not_a_view():
    costs = DEFAULTS["gloo"]
    compute = [
        n
        for n in _graph().nodes
        if n.op == "call_function"
        and n.target in (aten.mm.default, aten.mul.Tensor, aten.relu.default, aten.sum.default)
    ]
    assert len(compute) == 4
    for n in compute:
        assert not is_view_op(n.target) and not events.is_view(n)
        assert op_seconds(n, costs) > 0.0, n.format_node()
    mm = next(n for n in compute if n.target in ATEN_MATMULS)
    assert op_seconds(mm, costs) > op_seconds(next(n for n in compute if n.target is aten.relu.default), costs)


def test_the_traced_program_families():
    assert torch_flops(torch.matmul, [(8, 16), (16, 8)], 8 * 8) == 2 * 8 * 8 * 16
    # HF GPT-2's Conv1D: addmm(bias, x, w), as a function or the bias's method; the added term is first
    assert torch_flops(torch.addmm, [(24,), (8, 16), (16, 24)], 8 * 24) == 2 * 8 * 24 * 16
    assert torch_flops("addmm", [(24,), (8, 16), (16, 24)], 8 * 24) == 2 * 8 * 24 * 16
    sdpa = torch.nn.functional.scaled_dot_product_attention  # q (2, 4, 6, 8) against 10 keys
    assert torch_flops(sdpa, [(2, 4, 6, 8), (2, 4, 10, 8), (2, 4, 10, 8)], 2 * 4 * 6 * 8) == 4 * 2 * 4 * 6 * 8 * 10
    assert torch_flops("view", [(8, 16)], 128) == 0.0
    assert torch_flops(torch.relu, [(8, 16)], 128) == 128.0
    assert torch.nn.functional.linear in TORCH_MATMULS and "reshape" in TORCH_VIEWS


def test_layout_text_reads_back_what_layout_str_writes():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from torch_hca.spmd.placements import layout_str, layout_texts, letter, text_letter

    layout = (Shard(1), Replicate(), Partial())
    texts = layout_texts(layout_str(layout))
    assert texts == ["S(1)", "R", "P(sum)"]
    assert [text_letter(t) for t in texts] == [letter(p) for p in layout]
    assert layout_texts("-") is None and layout_texts(None) is None
