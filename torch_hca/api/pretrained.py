"""Hugging Face's ``save_pretrained`` on a sharded model: the whole model, written once.

A sharded model's parameters are DTensors, which ``safetensors`` cannot read. Every rank
calls ``model.save_pretrained(path)``, as with an unsharded model under torchrun: the full
state dict is gathered (a collective, so every rank must call it) and rank 0 writes it with
the model's own ``save_pretrained``. What it writes loads with ``from_pretrained`` on one
device, or into a sharded model with `hca.sharded` (docs/huggingface.md).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torch_hca.api.checkpoint import on_rank0


def whole_model_save(save_pretrained: Callable[..., Any]) -> Callable[..., Any]:
    """`save_pretrained` (the class's own) made to write the gathered, full state dict from rank 0."""

    @functools.wraps(save_pretrained)
    def save_whole(self, save_directory, *args, state_dict=None, **kwargs):
        if state_dict is not None:  # the caller gathered it: saved as the class saves it, on this rank
            return save_pretrained(self, save_directory, *args, state_dict=state_dict, **kwargs)
        # full_state_dict gathers every DTensor (every rank takes part); cpu_offload keeps it on rank 0.
        state_dict = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        def write() -> dict:
            save_pretrained(self, save_directory, *args, state_dict=state_dict, **kwargs)
            return {}

        on_rank0(write, f"save_pretrained({str(save_directory)!r})")
        if dist.is_initialized():
            dist.barrier()  # nobody reads the directory before rank 0 has written it

    return save_whole
