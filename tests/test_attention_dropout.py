"""Attention dropout is refused the same way under every plan (issue 29, item 7).

Before, whether GPT-2's default ``attn_pdrop=0.1`` was refused depended on where attention's
inputs were placed: on DTensors ``hca::attention`` refused it; on plain inputs every rank ran
the attention whole with its own generator, unchecked. The lift pass now refuses it on the
logical program, before any op runs (`torch_hca.compiler.attention.refuse_dropout`).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_hca as hca
import model_zoo
from torch_hca.runtime.mesh import reset_current_mesh

MESSAGE = (
    r"scaled_dot_product_attention with dropout_p=0\.1: attention dropout is not supported, under any plan .*"
    r"Fix: set the model's attention dropout to 0\.0 .*GPT2Config\(attn_pdrop=0\.0\).*"
    r"\(node \w+; source: .*scaled_dot_product_attention"
)


def _gpt2_with_attention_dropout():
    torch.manual_seed(0)
    model, make_inputs, _ = model_zoo.gpt2()
    for m in model.modules():
        if hasattr(m, "attn_dropout"):
            m.attn_dropout.p = 0.1  # as GPT2Config's default attn_pdrop builds it
    return model, make_inputs


def _compile_and_train(plan_name: str, world_size: int) -> str:
    model, make_inputs = _gpt2_with_attention_dropout()
    spec = model_zoo.plan_spec("gpt2", plan_name, world_size, model)
    reset_current_mesh()
    mesh = hca.init_mesh(spec.mesh_shape, spec.mesh_names)
    rows = model_zoo.BATCH // world_size if spec.inputs == hca.Shard(0) else model_zoo.BATCH
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:  # the solver's trace refuses it already under the solved plan
        plan = spec.plan if spec.plan is not None else hca.plan(model, make_inputs(model_zoo.BATCH), mesh)
        sharded = hca.sharded(plan, mesh=mesh, inputs=spec.inputs, outputs=spec.outputs)(model)
        torch.compile(sharded, backend="hca")(*make_inputs(rows)).sum().backward()
    return _unwrapped(info.value)


def _unwrapped(error: BaseException) -> str:
    """The backend's error, out of Dynamo's BackendCompilerFailed: an UnsupportedError."""
    error = getattr(error, "inner_exception", error)
    assert isinstance(error, hca.UnsupportedError), repr(error)
    return str(error)


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_gpt2_attention_dropout_is_refused_alike_under_every_plan(fake_pg):
    messages = {plan: _compile_and_train(plan, 2) for plan in ("dp", "megatron", "fsdp", "auto")}
    for plan, message in messages.items():
        assert re.search(MESSAGE, message), (plan, message)
    assert len(set(messages.values())) == 1, messages  # one message, whatever the plan


class _PlainAttention(nn.Module):
    """Attention over a plain tensor made inside the forward (no DTensor reaches it): before,
    every rank ran it whole, each drawing its own mask."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        q = torch.ones(2, 2, 4, 8) * 0.5
        return self.fc(x) + F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).sum()


@pytest.mark.parametrize("fake_pg", [2], indirect=True)
def test_attention_dropout_on_plain_inputs_is_refused(fake_pg):
    compiled = torch.compile(hca.sharded({})(_PlainAttention()), backend="hca")
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, 8)).sum().backward()
    assert re.search(MESSAGE, _unwrapped(info.value)), str(info.value)
