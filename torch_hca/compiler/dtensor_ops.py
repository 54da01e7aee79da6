"""Functions the passes insert into the DTensor program.

They are plain Python over DTensors, so the rewritten program stays
printable, runs eagerly (the reference) and traces through AOTAutograd.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.utils._pytree import tree_leaves, tree_map

from torch_hca._torch_private import redistribute_to_partial
from torch_hca.compiler import attention as attention_ops
from torch_hca.errors import UnsupportedError
from torch_hca.compiler.logical import ScaleGrad, contiguous_stride, mesh_of


def redistribute(x: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    """An explicit placement change chosen by the layout pass."""
    if any(p.is_partial() and p != q for p, q in zip(placements, x.placements)):
        if any(p.is_partial() and q.is_shard() for p, q in zip(placements, x.placements)):
            # DTensor has no S -> P: gather first (what the layout solver costs it as).
            x = x.redistribute(
                x.device_mesh,
                [Replicate() if p.is_partial() and q.is_shard() else q for p, q in zip(placements, x.placements)],
            )
        return redistribute_to_partial(x, placements)
    return x.redistribute(x.device_mesh, placements)


def from_local(local: torch.Tensor, mesh: int, placements: tuple[Placement, ...], shape: list[int]) -> DTensor:
    """A forward argument (this rank's piece) as the DTensor it belongs to: the input's stated layout."""
    return DTensor.from_local(
        local, mesh_of(mesh), placements, run_check=False, shape=torch.Size(shape), stride=contiguous_stride(shape)
    )


def replicate(t: torch.Tensor, mesh: int) -> DTensor:
    """A value made in the graph (a mask, an ``arange``, a buffer): every rank makes the same one."""
    m = mesh_of(mesh)
    return DTensor.from_local(t, m, (Replicate(),) * m.ndim, run_check=False)


def weighted_sum(x: DTensor, mesh_dim: int, weight: float) -> DTensor:
    """A partial mean over ranks holding uneven shares, as the partial sum it is: this rank's
    piece times `weight`, its share of the rows (`torch_hca.compiler.checks.uneven`).

    DTensor's ``Partial("avg")`` averages the ranks' pieces, right when every rank holds as
    many rows; with shares the whole's mean weighs each rank's partial mean by its rows. With
    the all-reduce DTensor then issues, this is the move table's weighted all-reduce
    (`Kind.WEIGHTED_ALL_REDUCE`, whose adjoint tests/test_collective_table.py checks).
    Backward, DTensor hands a partial sum's pieces the whole cotangent split n ways (its
    Replicate -> Partial divides); each summand's cotangent is the whole: ScaleGrad undoes it.
    """
    placements = list(x.placements)
    placements[mesh_dim] = Partial("sum")
    local = ScaleGrad.apply(x.to_local() * weight, float(x.device_mesh.size(mesh_dim)))
    return DTensor.from_local(local, x.device_mesh, placements, run_check=False, shape=x.shape, stride=x.stride())


def to_output(x: DTensor, placements: tuple[Placement, ...], grad_scale: float = 1.0) -> torch.Tensor:
    """A result as this rank's piece in the layout the caller receives (its cotangent times `grad_scale`)."""
    local = x.redistribute(x.device_mesh, placements).to_local(grad_placements=placements)
    return local if grad_scale == 1.0 else ScaleGrad.apply(local, grad_scale)


def dropout(x: DTensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> DTensor:
    """``F.dropout`` of a DTensor as one device draws it (torch_hca.compiler.randomness).

    Every rank draws the whole noise tensor from its default generator, as ``F.dropout``
    does on one CPU (``bernoulli_(1 - p)``, then ``div_(1 - p)``), and multiplies its piece
    of `x` by its piece of it: a shard keeps its slice (no communication), a partial sum
    the whole (the mask is linear). The lift pass makes an in-place dropout out of place.
    """
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    noise = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    mesh = x.device_mesh
    pieces = tuple(q if q.is_shard() else Replicate() for q in x.placements)
    noise = DTensor.from_local(noise, mesh, (Replicate(),) * mesh.ndim, run_check=False).redistribute(mesh, pieces)
    return x * noise


# Callables `run_local` may name (FX arguments stay printable as strings).
LOCAL_FUNCTIONS: dict[str, Any] = {}


def local_function(fn) -> str:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    LOCAL_FUNCTIONS.setdefault(name, fn)
    return name


def run_local(kind: str, target: str, item: int | None, *args, **kwargs):
    """An op DTensor has no sharding rule for, run replicated: every rank computes it whole.

    ``kind`` is "method" (``target`` a tensor method name) or "function" (a
    name registered by `local_function`); ``item`` picks one result of an op
    that returns several.
    """
    mesh = next(a.device_mesh for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor))
    full = (Replicate(),) * mesh.ndim
    unwrap = lambda a: a.redistribute(mesh, full).to_local() if isinstance(a, DTensor) else a
    args, kwargs = tree_map(unwrap, (args, kwargs))
    out = (
        getattr(args[0], target)(*args[1:], **kwargs) if kind == "method" else LOCAL_FUNCTIONS[target](*args, **kwargs)
    )
    if item is not None:
        out = out[item]
    wrap = lambda t: DTensor.from_local(t, mesh, full, run_check=False) if isinstance(t, torch.Tensor) else t
    return tree_map(wrap, out)


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` written with ops DTensor has sharding rules for.

    DTensor has no rule for the CPU flash kernel, and its math path mixes a
    plain causal mask with DTensors; here the mask is a replicated DTensor.
    """
    if dropout_p:
        raise attention_ops.dropout_refused(dropout_p)
    # Attention is not linear in q, k or v: a partial sum among them is summed first.
    q, k, v = (_gathered(t, keep=lambda p: not p.is_partial()) for t in (q, k, v))
    if _splits_only_batch_or_heads(q, k, v):
        return _attention_per_piece(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if enable_gqa and k.size(-3) != q.size(-3):
        k, v = _repeat_kv(k, q.size(-3)), _repeat_kv(v, q.size(-3))
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if q.dim() == 4:
        # Heads first, then one flat batch of (head, batch) pairs for bmm: DTensor
        # can flatten (sharded heads, batch) under a symbolic batch size, but not
        # the (batch, sharded heads) that matmul's own broadcasting flattens.
        h, b, lq = q.size(1), q.size(0), q.size(2)
        flat = lambda t: t.transpose(0, 1).reshape(h * b, t.size(2), t.size(3))
        if attn_mask is not None and attn_mask.dim() == 4:  # (batch or 1, heads or 1, lq, lk): laid out as q is
            attn_mask = replicated_like(attn_mask, q).expand(b, h, lq, k.size(2))
            if isinstance(q, DTensor):  # a replicated mask is sliced where q is split: no communication
                attn_mask = attn_mask.redistribute(q.device_mesh, q.placements)
            attn_mask = flat(attn_mask)
        out = _attention(flat(q), flat(k), flat(v), attn_mask, is_causal, scale)
        return out.view(h, b, lq, v.size(3)).transpose(0, 1)
    return _attention(q, k, v, attn_mask, is_causal, scale)


def _splits_only_batch_or_heads(q, k, v) -> bool:
    """q, k and v are 4-D DTensors laid out alike, each mesh dim replicating them or splitting
    the batch or the heads (whole query groups of each kv head, under GQA)."""
    if q.dim() != 4 or not all(isinstance(t, DTensor) for t in (q, k, v)):
        return False
    if not (q.placements == k.placements == v.placements and q.device_mesh == k.device_mesh == v.device_mesh):
        return False
    for mesh_dim, p in enumerate(q.placements):
        if type(p) is Shard and p.dim == 1 and k.size(1) % q.device_mesh.size(mesh_dim):
            return False  # kv heads that do not split as the query heads do
        if not (isinstance(p, Replicate) or type(p) is Shard and p.dim in (0, 1)):
            return False
    return True


def _attention_per_piece(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    """Attention of each rank's (batch, heads) piece by the local kernel: no (batch, head) pair
    looks at another, so no communication; the mask is sliced as q is."""
    mesh, placements = q.device_mesh, q.placements
    mask = attn_mask
    if mask is not None:
        whole = replicated_like(mask, q).expand(q.size(0), q.size(1), q.size(2), k.size(2))
        mask = whole.redistribute(mesh, placements).to_local()
    out = F.scaled_dot_product_attention(
        q.to_local(),
        k.to_local(),
        v.to_local(),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    shape = (q.size(0), q.size(1), q.size(2), v.size(3))
    return DTensor.from_local(
        out, mesh, placements, run_check=False, shape=torch.Size(shape), stride=contiguous_stride(shape)
    )


def cat(tensors, dim: int = 0, *, out=None):
    """`torch.cat` without the legacy empty 1-D pieces it skips (a KV cache's first keys are
    ``torch.tensor([])``): DTensor would lay such a piece out like the others and fail."""
    kept = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]
    return torch.cat(kept or list(tensors), dim, out=out) if out is not None else torch.cat(kept or list(tensors), dim)


def convolution(conv):
    """`conv` (``F.conv1d``/``2d``/``3d``) with a weight and bias stored split (an FSDP-style plan)
    gathered first, as FSDP gathers them, and an input split other than over its batch gathered:
    DTensor's convolution rule assumes those replicated."""

    def gathered(input, weight, bias=None, *args, **kwargs):
        input = _gathered(input, keep=lambda p: p.is_shard(0))
        weight, bias = _gathered(weight), _gathered(bias)
        return conv(input, weight, bias, *args, **kwargs)

    return gathered


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """``F.batch_norm`` with a weight and bias stored split over channels gathered first: DTensor
    would split the channels of the input and of copies of the running statistics, and the
    module's own buffers would miss the update. With the running statistics (``eval()``) it is
    elementwise, written so: DTensor's rule would gather a batch that is split."""
    weight, bias = _gathered(weight), _gathered(bias)
    if training or running_mean is None:
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    per_channel = lambda t: t.view((1, -1) + (1,) * (input.dim() - 2))
    out = (input - per_channel(running_mean)) * per_channel(torch.rsqrt(running_var + eps))
    out = out * per_channel(weight) if weight is not None else out
    return out + per_channel(bias) if bias is not None else out


def _gathered(t, keep=lambda p: False):
    """`t` with each placement that is not replicated (or kept) made replicated."""
    if not isinstance(t, DTensor) or all(p.is_replicate() or keep(p) for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [p if p.is_replicate() or keep(p) else Replicate() for p in t.placements])


def _repeat_kv(t, heads: int):
    """Each of `t`'s kv heads once per query head of its group, as SDPA's ``enable_gqa`` reads them:
    an unsqueeze, expand and flatten, which DTensor keeps split over heads."""
    kv_heads = t.size(-3)
    if heads % kv_heads:
        raise UnsupportedError(
            f"scaled_dot_product_attention(enable_gqa=True): {heads} query heads do not divide into {kv_heads} kv heads"
        )
    shape = t.shape[:-3] + (kv_heads, heads // kv_heads) + t.shape[-2:]
    return t.unsqueeze(-3).expand(shape).flatten(-4, -3)


def _attention(q, k, v, attn_mask, is_causal: bool, scale: float):
    scores = torch.bmm(q, k.transpose(-2, -1)) * scale if q.dim() == 3 else torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~replicated_like(keep, scores), float("-inf"))
    if attn_mask is not None:
        mask = replicated_like(attn_mask, scores)
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v) if probs.dim() == 3 else torch.matmul(probs, v)


def replicated_like(t: torch.Tensor, ref) -> torch.Tensor:
    """A plain tensor as a replicated DTensor on `ref`'s mesh (plain if `ref` is)."""
    if not isinstance(ref, DTensor) or isinstance(t, DTensor):
        return t
    mesh = ref.device_mesh
    return DTensor.from_local(t.to(ref.device), mesh, (Replicate(),) * mesh.ndim, run_check=False)


class _EagerGradient(torch.autograd.Function):
    """Identity forward; backward sums a partial gradient back to the parameter's layout.

    The cotangent of a replicated parameter used by a split batch is partial
    (docs/theory.md, section 1: E_R* = Q_P). Under the eager role that sum happens
    here, inside the backward graph, as one collective per parameter.
    """

    @staticmethod
    def forward(ctx, p: DTensor) -> DTensor:
        ctx.placements = tuple(p.placements)
        return p  # no copy, no view: only the backward matters

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.placements:
            return grad.redistribute(grad.device_mesh, ctx.placements)
        return grad


def reduce_gradient_eagerly(p: DTensor) -> DTensor:
    """A parameter read whose gradient is reduced inside backward (the eager role)."""
    return _EagerGradient.apply(p)


class _SumCotangent(torch.autograd.Function):
    """Identity forward; backward sums the cotangent over the mesh dims `dims` where it arrives partial."""

    @staticmethod
    def forward(ctx, x: DTensor, dims: tuple[int, ...]) -> DTensor:
        ctx.dims = dims
        return x

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return grad, None
        summed = tuple(Replicate() if d in ctx.dims and p.is_partial() else p for d, p in enumerate(grad.placements))
        return (grad.redistribute(grad.device_mesh, summed) if summed != tuple(grad.placements) else grad), None


def reduce_cotangent(x: DTensor, dims: tuple[int, ...]) -> DTensor:
    """A replicated activation read by column-parallel matmuls over mesh dims `dims`: its partial
    cotangent is summed there, once, before the backward of the ops that made it (Megatron's "f")."""
    return _SumCotangent.apply(x, dims)
