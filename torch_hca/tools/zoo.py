"""Small models and the plans that shard them: used by the demo, examples, tests and bench.

Each model is an ordinary `nn.Module`; each plan is what a user would pass
to `hca.sharded`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


# Megatron: fc1 column-parallel (output features split), fc2 row-parallel.
MEGATRON_MLP = {"fc1.*": Shard(0), "fc2.weight": Shard(1)}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, dim: int = 16, heads: int = 4, hidden: int = 32):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


# Heads split across ranks (q, k, v column-parallel, o row-parallel), MLP Megatron.
TP_BLOCK = {
    "attn.wq.weight": Shard(0),
    "attn.wk.weight": Shard(0),
    "attn.wv.weight": Shard(0),
    "attn.wo.weight": Shard(1),
    "mlp.fc1.*": Shard(0),
    "mlp.fc2.weight": Shard(1),
}


class DeepMLP(nn.Module):
    """`depth` Linear+ReLU layers: the data-parallel example."""

    def __init__(self, dim: int = 16, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def two_d(plan: dict) -> dict:
    """A 1-D tensor-parallel plan lifted to a (dp, tp) mesh: replicated over dp."""
    return {k: (Replicate(), v) for k, v in plan.items()}


class TinyLM(nn.Module):
    """A small decoder-only language model: token embedding, `layers` pre-norm
    `TransformerBlock`s, a final LayerNorm and a linear LM head.

    ``forward(ids)`` maps token ids ``[batch, seq]`` to next-token logits
    ``[batch, seq, vocab]``; causal attention is the only position signal
    (no positional embedding). Train it with `lm_loss`.
    """

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class GPT(nn.Module):
    """A GPT-style language model written as one would for one device.

    Learned positions from ``torch.arange`` inside ``forward``, causal
    attention, and the output projection tied to the token embedding (one
    parameter read twice): what a sharded front end must handle without help.
    """

    def __init__(
        self, vocab: int = 64, dim: int = 32, heads: int = 4, hidden: int = 64, layers: int = 2, max_len: int = 64
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids):
        positions = torch.arange(ids.size(1), device=ids.device)
        x = self.embed(ids) + self.pos(positions)[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# Every block as TP_BLOCK; embedding, norms and LM head replicated.
TP_LM = {f"blocks.*.{name}": placement for name, placement in TP_BLOCK.items()}

# GPT: every block Megatron, embeddings (tied to the head) and norms replicated.
TP_GPT = TP_LM

# torch's own DTensor test model (`common_dtensor.Transformer`) stored as its
# `Transformer.parallelize(model, mesh, use_seq_parallel=False)` stores it: the token and
# position embeddings RowwiseParallel (weight Shard(0)), wq/wk/wv and w1 ColwiseParallel
# (weight and bias Shard(0)), wo and w2 RowwiseParallel (weight Shard(1), bias replicated),
# the output ColwiseParallel (weight Shard(0): the tied token embedding's weight, so the
# one entry covers both; named_parameters lists it once).
TP_TEST_TRANSFORMER = {
    "tok_embeddings.weight": Shard(0),
    "pos_embeddings.weight": Shard(0),
    "layers.*.attention.w[qkv].weight": Shard(0),
    "layers.*.attention.wo.weight": Shard(1),
    "layers.*.feed_forward.w1.*": Shard(0),
    "layers.*.feed_forward.w2.weight": Shard(1),
}


def torch_transformer(layers: int = 4, vocab: int = 512, seq: int = 64, dim: int = 256, heads: int = 8) -> nn.Module:
    """torch's DTensor test Transformer (learned positions, causal attention, LayerNorm,
    GELU MLP, output tied to the token embedding), no dropout."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    return Transformer(
        ModelArgs(
            n_layers=layers,
            vocab_size=vocab,
            max_seq_len=seq,
            dim=dim,
            n_heads=heads,
            dropout_p=0.0,
            use_attn_mask=True,
            weight_tying=True,
        )
    )


# FSDP-style storage: every parameter split on its first dimension (use with
# a batch split the same way, `inputs=Shard(0)`).
FSDP_PLAN = {"*": Shard(0)}
