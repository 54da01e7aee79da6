"""The bench's real-size models: GPT-2 small and a 125M Llama (Hugging Face configs), their Megatron
storage plans for hca and the per-block plans torch's ``parallelize_module`` takes (`bench_real`)."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn
from torch.distributed.tensor import Shard

from . import zoo

SEQ = 64


# Megatron storage: GPT-2's Conv1D weights are [in, out], so column-parallel c_attn / c_fc are Shard(1)
# (bias Shard(0)), row-parallel c_proj Shard(0); Llama's q, k, v, gate, up Shard(0), o, down Shard(1). The
# embeddings and heads vocabulary-parallel (Shard(0)): GPT-2's tied 50,257 rows as torch.chunk cuts them
# (25,129 : 25,128 at 2 ranks, read only as stored: torch_hca/spmd/chunks.py), so its loss belongs in the
# module (`LossOf`, as the bench runs it). Norms replicated.
MEGATRON = {
    "gpt2_small": {
        "hf.transformer.h.*.attn.c_attn.weight": Shard(1),
        "hf.transformer.h.*.attn.c_attn.bias": Shard(0),
        "hf.transformer.h.*.attn.c_proj.weight": Shard(0),
        "hf.transformer.h.*.mlp.c_fc.weight": Shard(1),
        "hf.transformer.h.*.mlp.c_fc.bias": Shard(0),
        "hf.transformer.h.*.mlp.c_proj.weight": Shard(0),
        "hf.transformer.wte.weight": Shard(0),  # tied to the head
    },
    "llama_100m": {
        "hf.model.layers.*.self_attn.[qkv]_proj.weight": Shard(0),
        "hf.model.layers.*.self_attn.o_proj.weight": Shard(1),
        "hf.model.layers.*.mlp.gate_proj.weight": Shard(0),
        "hf.model.layers.*.mlp.up_proj.weight": Shard(0),
        "hf.model.layers.*.mlp.down_proj.weight": Shard(1),
        "hf.model.embed_tokens.weight": Shard(0),  # vocabulary-parallel
        "hf.lm_head.weight": Shard(0),
    },
}
# parallelize_module's plan per block (module names under the block), as torchtitan writes it.
EXPERT_BLOCK = {
    "gpt2_small": {"attn.c_attn": "col", "attn.c_proj": "row", "mlp.c_fc": "col", "mlp.c_proj": "row"},
    "llama_100m": {
        "self_attn.q_proj": "col",
        "self_attn.k_proj": "col",
        "self_attn.v_proj": "col",
        "self_attn.o_proj": "row",
        "mlp.gate_proj": "col",
        "mlp.up_proj": "col",
        "mlp.down_proj": "row",
    },
}


class LogitsOf(nn.Module):
    """``forward(ids)``: ``hf(input_ids=ids).logits``: a plain tensor out, not a ``ModelOutput``
    (why a wrapper: tests/model_zoo.py). Every parameter name starts with ``hf.``."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, ids):
        return self.hf(input_ids=ids, return_dict=True).logits


class LossOf(LogitsOf):
    """``forward(ids)``: the next-token loss of `hf`'s logits (`zoo.lm_loss`), inside the module, so
    that a compiled program computes it where the logits lie (vocabulary-parallel under Megatron
    storage) instead of gathering them. Parameter names as `LogitsOf`'s."""

    def forward(self, ids):
        return zoo.lm_loss(super().forward(ids), ids)


def gpt2_small(tiny: bool = False, seq: int = SEQ, layers: int | None = None) -> nn.Module:
    """GPT-2 small as released (or tiny); `layers` keeps its width, heads and vocabulary with fewer blocks."""
    from transformers import GPT2Config, GPT2LMHeadModel

    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa")
    # (the default ids lie outside a tiny vocabulary)
    tiny_size = dict(n_embd=64, n_head=4, vocab_size=128, n_positions=max(seq, 64), bos_token_id=0, eos_token_id=0)
    size = {**(tiny_size if tiny else {}), "n_layer": layers or (2 if tiny else 12)}
    return LogitsOf(GPT2LMHeadModel(GPT2Config(**size, **no_dropout)))


def llama_100m(tiny: bool = False, seq: int = SEQ) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    size = (
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=128,
        )
        if tiny
        else dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=2048,
            vocab_size=32000,
        )
    )
    return LogitsOf(
        LlamaForCausalLM(
            LlamaConfig(
                **size,
                max_position_embeddings=max(seq, 2048 if not tiny else 64),
                tie_word_embeddings=False,
                use_cache=False,
                attention_dropout=0.0,
                attn_implementation="sdpa",
            )
        )
    )


BUILD: dict[str, Callable[..., nn.Module]] = {"gpt2_small": gpt2_small, "llama_100m": llama_100m}
