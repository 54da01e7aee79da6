"""Attention as one op with its own sharding rule: the rule DTensor lacks on CPU.

DTensor has no sharding rule for the CPU flash kernel behind
``F.scaled_dot_product_attention``, and its math path flattens (batch, heads)
into one dim that a (dp, tp) mesh cannot shard. The lift pass replaces every
``scaled_dot_product_attention`` of the logical program with ``hca::attention``
(forward and backward each one custom op), whose rule is the one attention
obeys: split the batch, or the heads (grouped-query heads split with their
key/value group), or the queries (then key and value gradients are partial
sums). Masks ([L, S], [b, 1, L, S], [b, h, L, S], ...) follow the dims they
broadcast over.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

import torch_hca._torch_private as _torch_private
from torch_hca.errors import UnsupportedError


def _scores(q, k, mask, causal: int, scale: float, groups: int):
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


def _math(q, k, v, mask, causal: int, scale: float, groups: int):
    p = torch.softmax(_scores(q, k, mask, causal, scale, groups), dim=-1)
    if groups > 1:
        v = v.repeat_interleave(groups, dim=-3)
    return torch.matmul(p, v)


# ----------------------------------------------------------------------------- the fused CPU kernel
# What F.scaled_dot_product_attention runs on one CPU: 2-4x faster than the math above, and the
# single-device program's own numbers. Other devices and shapes keep the math.


def _fusable(q, mask) -> bool:
    return (
        q.device.type == "cpu"
        and q.dim() == 4
        and q.dtype in (torch.float32, torch.float64)
        and (mask is None or mask.dim() in (2, 4))
    )


def _expand(t, groups: int):
    return t.repeat_interleave(groups, dim=-3) if groups > 1 else t


def _additive(mask, dtype):
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _fused(q, k, v, mask, causal: int, scale: float, groups: int):
    """(output, logsumexp, mask as the kernel takes it, k and v with one head per query head)."""
    k, v, mask = _expand(k, groups), _expand(v, groups), _additive(mask, q.dtype)
    out, lse = _torch_private.cpu_flash_attention(q, k, v, mask, bool(causal), scale)
    return out, lse, mask, k, v


@torch.library.custom_op("hca::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: int, scale: float, groups: int
) -> torch.Tensor:
    if _fusable(q, mask):
        return _fused(q, k, v, mask, causal, scale, groups)[0].contiguous()
    return _math(q, k, v, mask, causal, scale, groups).contiguous()  # the strides the fake promises


@attention.register_fake
def _(q, k, v, mask, causal, scale, groups):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("hca::attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: int,
    scale: float,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _fusable(q, mask):  # the forward again for its logsumexp (cheaper than keeping [b, h, L] alive)
        out, lse, fmask, kx, vx = _fused(q, k, v, mask, causal, scale, groups)
        dq, dk, dv = _torch_private.cpu_flash_attention_backward(
            grad.contiguous(), q, kx, vx, out, lse, fmask, bool(causal), scale
        )
        if groups > 1:
            fold = lambda t: t.unflatten(-3, (t.size(-3) // groups, groups)).sum(dim=-3)
            dk, dv = fold(dk), fold(dv)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()
    # Below autograd here: the softmax-attention adjoint written out.
    kx = k.repeat_interleave(groups, dim=-3) if groups > 1 else k
    vx = v.repeat_interleave(groups, dim=-3) if groups > 1 else v
    p = torch.softmax(_scores(q, k, mask, causal, scale, groups), dim=-1)
    dv = torch.matmul(p.transpose(-2, -1), grad)
    dp = torch.matmul(grad, vx.transpose(-2, -1))
    ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, kx) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    if groups > 1:  # query head j reads key/value head j // groups
        fold = lambda t: t.unflatten(-3, (t.size(-3) // groups, groups)).sum(dim=-3)
        dk, dv = fold(dk), fold(dv)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward.register_fake
def _(grad, q, k, v, mask, causal, scale, groups):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real ones


# The matmul FLOPs of the kernels, as torch counts scaled_dot_product_attention's (grouped-query
# heads included; the backward recomputes the scores): without them, the cost model's timeline
# would count one FLOP per output element for a step's attention.
@register_flop_formula(torch.ops.hca.attention)
def _attention_flops(q, k, v, *_, out_shape=None, **__) -> int:
    return sdpa_flop_count(q, k, v)


@register_flop_formula(torch.ops.hca.attention_backward)
def _attention_backward_flops(grad, q, k, v, *_, out_shape=None, **__) -> int:
    return sdpa_backward_flop_count(grad, q, k, v)


def _backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors if ctx.has_mask else (*ctx.saved_tensors, None)
    gq, gk, gv = attention_backward(grad, q, k, v, mask, ctx.causal, ctx.scale, ctx.groups)
    return gq, gk, gv, None, None, None, None


def _setup(ctx, inputs, output):
    q, k, v, mask, ctx.causal, ctx.scale, ctx.groups = inputs
    ctx.has_mask = mask is not None
    ctx.save_for_backward(q, k, v, *([mask] if mask is not None else []))


attention.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- the sharding rule (one mesh dim)


def _mask_placement(mask, dim_from_end: int, p):
    """How a mask follows q's placement `p` on a dim counted from the end (broadcast dims: replicated)."""
    if mask is None:
        return None
    d = mask.ndim - dim_from_end
    if d < 0 or mask.shape[d] == 1:
        return Replicate()
    return Shard(d)


def _rules(q, k, v, mask, causal, backward: bool):
    R, P = Replicate(), Partial()
    rules = []
    tail = [None, None, None]  # causal, scale, groups
    nd = q.ndim
    # Split the batch, or the heads (dims counted from the end: [..., b, h, L, E]).
    for from_end in (4, 3) if nd >= 4 else (3,):
        d = nd - from_end
        s = Shard(d)
        m = _mask_placement(mask, from_end, s)
        if backward:
            rules.append(([s, s, s], [s, s, s, s, m, *tail]))
        else:
            rules.append(([s], [s, s, s, m, *tail]))
    if not causal:  # split the queries: keys and values whole; their gradients partial sums
        s = Shard(nd - 2)
        m = _mask_placement(mask, 2, s)
        if backward:
            rules.append(([s, P, P], [s, s, R, R, m, *tail]))
        else:
            rules.append(([s], [s, R, R, m, *tail]))
    full = None if mask is None else R
    rules.append(([R, R, R], [R, R, R, R, full, *tail]) if backward else ([R], [R, R, R, full, *tail]))
    return rules


@register_sharding(torch.ops.hca.attention.default)
def _attention_rule(q, k, v, mask, causal, scale, groups):
    return _rules(q, k, v, mask, causal, backward=False)


@register_sharding(torch.ops.hca.attention_backward.default)
def _attention_backward_rule(grad, q, k, v, mask, causal, scale, groups):
    return _rules(q, k, v, mask, causal, backward=True)


def runs_in_place(args: tuple, kwargs: dict, layout_of: Callable[[Any], tuple | None]) -> bool:
    """Whether ``sdpa(*args, **kwargs)`` runs under `_rules` without DTensor moving data on its
    own, each tensor argument read in ``layout_of(tensor)`` (one placement per mesh dim; None: not
    a DTensor input, left free).

    DTensor builds an op's rule on several mesh dims as the product of its rule on one, so each
    mesh dim's part must be one of `_rules`' reads. The layout solver asks this before probing:
    attention's inputs combine into hundreds of layouts of which a handful run (500 probes of
    about 12 ms for HF GPT-2's attention). It only ever rules a combination out; where it cannot
    tell (a learned mask takes the op-by-op path, a causal flag that is not a bool) it says True.
    """
    try:
        bound = inspect.signature(sdpa).bind(*args, **kwargs).arguments
    except TypeError:
        return True
    q, k, v, mask = (bound.get(name) for name in ("q", "k", "v", "attn_mask"))
    causal = bound.get("is_causal", False)
    if not isinstance(causal, bool) or getattr(mask, "requires_grad", False):
        return True
    reads = [layout_of(t) if isinstance(t, torch.Tensor) else None for t in (q, k, v, mask)]
    dims = next((len(r) for r in reads if r is not None), 0)
    allowed = [rule[:4] for _, rule in _rules(q, k, v, mask, causal, backward=False)]
    return all(
        any(all(r is None or r[dim] == want for r, want in zip(reads, rule)) for rule in allowed) for dim in range(dims)
    )


# ----------------------------------------------------------------------------- attention dropout, refused

SDPA = {torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def dropout_refused(p, where: str = "") -> UnsupportedError:
    """The one refusal of attention dropout: the lift pass's (any plan) and eager calls'."""
    return UnsupportedError(
        f"scaled_dot_product_attention with dropout_p={p}: attention dropout is not supported, under any plan "
        "(data parallel, Megatron, FSDP-style or solved) nor in eager calls of a sharded module: each rank would draw "
        "a mask of its own, not its piece of one device's. Fix: set the model's attention dropout to 0.0 when you "
        "build it: GPT2Config(attn_pdrop=0.0) or from_pretrained(..., attn_pdrop=0.0) (GPT-2), attention_dropout=0.0 "
        "(Llama, Mistral, Qwen2, BART), attention_probs_dropout_prob=0.0 (BERT, ViT); on a built GPT-2, "
        "module.attn_dropout.p = 0.0 in every attention module. Hidden dropout (resid_pdrop, embd_pdrop, "
        f"hidden_dropout_prob) is supported as one device draws it{where}"
    )


def refuse_dropout(graph) -> None:
    """Refuse attention dropout in a sharded module's logical program before anything runs, wherever its
    inputs are placed: on plain inputs every rank would run it whole with its own generator, unchecked."""
    from torch_hca.compiler.layout.candidates import source_line  # the layout package imports this module

    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SDPA:
            continue
        try:
            p = inspect.signature(sdpa).bind(*node.args, **node.kwargs).arguments.get("dropout_p", 0.0)
        except TypeError:
            continue  # a call the op itself will refuse
        if not isinstance(p, (int, float)) or p:  # a traced value may be anything
            raise dropout_refused(p, f" (node {node.name}; source: {source_line(node)})")


# ----------------------------------------------------------------------------- the entry the lift pass calls


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` of the logical program, as ``hca::attention``."""
    if dropout_p:
        raise dropout_refused(dropout_p)
    if q.dim() < 3:
        raise UnsupportedError(
            f"scaled_dot_product_attention on a {q.dim()}-D query; give [..., L, E] with a batch dim"
        )
    heads, kv_heads = q.size(-3), k.size(-3)
    if heads != kv_heads and (heads % kv_heads or not enable_gqa and q.dim() < 3):
        raise UnsupportedError(
            f"scaled_dot_product_attention: {heads} query heads and {kv_heads} key/value heads; "
            "grouped-query attention needs the first to be a multiple of the second"
        )
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    if attn_mask is not None and attn_mask.requires_grad:
        # A learned bias (T5-style): the plain math, which DTensor shards op by op.
        return _math(q, k, v, attn_mask, int(bool(is_causal)), scale, heads // kv_heads)
    return attention(q, k, v, attn_mask, int(bool(is_causal)), scale, heads // kv_heads)
