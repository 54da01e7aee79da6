"""Rank functions for tests/test_loss_reduction.py: a training loop ported from DDP.

Each rank computes a loss on its own piece of the output, outside the
compiled module, as under DDP. hca, DDP and one device see the same data.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import torch_hca as hca


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def ddp_style_step(loss_reduction: str, compiled: bool = True) -> dict[str, Any]:
    """Gradient relative errors of hca (DDP-style loop) against DDP and against one device."""
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = hca.init_mesh()
    ref = _net()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(ref))
    model = hca.sharded({}, mesh=mesh, inputs=Shard(0), outputs=Shard(0), loss_reduction=loss_reduction)(
        copy.deepcopy(ref)
    )
    run = torch.compile(model, backend="hca", options={"check": True}) if compiled else model
    torch.manual_seed(1)
    x, y = torch.randn(4 * world, 16), torch.randn(4 * world, 8)
    mine = slice(4 * rank, 4 * (rank + 1))
    F.mse_loss(run(x[mine]), y[mine]).backward()  # per-rank loss: the mean over this rank's rows
    F.mse_loss(ddp(x[mine]), y[mine]).backward()  # DDP averages the ranks' gradients
    F.mse_loss(ref(x), y).backward()  # one device: the mean over the whole batch
    ddp_grads = dict(ddp.module.named_parameters())
    ref_grads = dict(ref.named_parameters())

    def err(a, b):
        return ((a - b).norm() / b.norm()).item()

    hca_grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    counts = hca.report(run).collective_counts() if compiled else None
    return {
        "collectives": counts,
        "vs_ddp": max(err(g, ddp_grads[n].grad) for n, g in hca_grads.items()),
        "vs_one_device": max(err(g, ref_grads[n].grad) for n, g in hca_grads.items()),
        "ratio_to_ddp": [round((g.norm() / ddp_grads[n].grad.norm()).item(), 4) for n, g in hca_grads.items()],
    }


def hf_labels_step(compiled: bool = True) -> dict[str, Any]:
    """HF GPT-2 called as HF users call it: every tensor by keyword, ``labels=`` for the loss,
    under ``outputs=Shard(0)`` and ``loss_reduction="mean"`` (how DDP users write it). The 0-d
    loss comes back whole on every rank; its gradients against one device's on the global batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = hca.init_mesh()
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(
        GPT2Config(
            n_layer=1,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            attn_implementation="sdpa",
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    model = hca.sharded({}, mesh=mesh, inputs=Shard(0), outputs=Shard(0), loss_reduction="mean")(copy.deepcopy(ref))
    run = torch.compile(model, backend="hca", options={"check": True}) if compiled else model
    ids = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(1))
    mine = ids.chunk(world)[rank]
    out = run(input_ids=mine, labels=mine)
    out.loss.backward()
    one = ref(input_ids=ids, labels=ids)
    one.loss.backward()
    ref_grads = dict(ref.named_parameters())

    def err(a, b):
        return ((a - b).norm() / b.norm()).item()

    return {
        "loss_shape": tuple(out.loss.shape),
        "loss_err": abs(out.loss.item() - one.loss.item()) / abs(one.loss.item()),
        "logits_shape": tuple(out.logits.shape),
        "grad_err": max(err(p.grad.full_tensor(), ref_grads[n].grad) for n, p in model.named_parameters()),
        "collectives": hca.report(run).collective_counts() if compiled else None,
    }
