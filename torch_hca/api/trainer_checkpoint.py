"""`hca.Trainer`'s checkpoints: what Trainer writes, plus the sharded state `hca.save` keeps.

    checkpoint-N/
      model.safetensors, config.json   the whole model (save_pretrained: a gather, rank 0 writes);
                                       loads with from_pretrained on one device
      hca_state/LATEST, v00000001/     hca.save(model, optimizer): every rank's pieces of the
                                       parameters and of the optimizer's state (momentum, moments)
      scheduler.pt                     the LR scheduler's state (plain numbers; rank 0 writes)
      rng_state_<rank>.pth             each rank's generators (Trainer's own)
      trainer_state.json               the step, the log history (Trainer's own; rank 0 writes)

Trainer writes its files one after another and publishes nothing; ``hca_state`` is published
atomically (docs/checkpoints.md). Resuming checks, before reading any tensor, that the
checkpoint is whole and was written by this many ranks under this plan, then loads the
parameters and the optimizer's state with `hca.load` (every rank its own pieces, no gather).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from torch_hca.api.checkpoint import CheckpointError, _describe, _find, _layout_text, load, on_rank0, save

HCA_STATE = "hca_state"
SCHEDULER = "scheduler.pt"  # transformers' SCHEDULER_NAME
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME


def _optimizer(trainer: Any) -> torch.optim.Optimizer:
    """The torch optimizer itself: accelerate wraps it (AcceleratedOptimizer), DCP reads the one inside."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def save_state(trainer: Any, output_dir: str) -> None:
    """Every rank: the parameters' and optimizer's pieces (hca.save); rank 0: the scheduler's state."""
    save(trainer.model, _optimizer(trainer), os.path.join(output_dir, HCA_STATE), keep=1)
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))


def _from_weights(model: Any, checkpoint: str) -> str:
    name = type(model).__name__
    return (
        f"or start a new run from its weights: hca.sharded(plan, ...)({name}.from_pretrained({checkpoint!r})) "
        "(the optimizer's state starts over)"
    )


def _whole(checkpoint: str, world: int, what: str, start_over: str) -> dict:
    """Rank 0: the published hca_state and its manifest, and Trainer's own files, all present."""
    if not os.path.isdir(os.path.join(checkpoint, HCA_STATE)):
        raise CheckpointError(
            f"{what}: {checkpoint} has no {HCA_STATE}/ (the optimizer's state): it was written with "
            "save_only_model=True, or not by hca.Trainer, so resuming would start the optimizer and the LR "
            f"schedule over; resume from a checkpoint hca.Trainer wrote without save_only_model, {start_over}"
        )
    found = _find(os.path.join(checkpoint, HCA_STATE), what)
    saved_world = found["manifest"]["world_size"]
    if saved_world != world:
        raise CheckpointError(
            f"{what}: {checkpoint} was written by {saved_world} ranks and this run has {world}; resume it "
            f"with {saved_world} ranks (each rank's batches, generators and pieces of the state are its own), "
            + start_over
        )
    rng = ["rng_state.pth"] if world <= 1 else [f"rng_state_{r}.pth" for r in range(world)]
    missing = [f for f in (TRAINER_STATE, SCHEDULER, *rng) if not os.path.isfile(os.path.join(checkpoint, f))]
    if missing:
        raise CheckpointError(
            f"{what}: {checkpoint} is incomplete: it lacks {missing} (Trainer was stopped while writing it); "
            "resume from the checkpoint before it"
        )
    return found


def _check_plan(model: Any, manifest: dict, what: str, start_over: str) -> None:
    saved, here = manifest["parameters"], _describe(model)
    for name in sorted(set(saved) & set(here)):
        if saved[name]["layout"] != here[name]["layout"]:
            raise CheckpointError(
                f"{what}: parameter {name!r} was saved laid out as {_layout_text(saved[name]['layout'])} and is "
                f"{_layout_text(here[name]['layout'])} here: the checkpoint is of another plan; resume with the "
                f"plan it was trained under, {start_over}"
            )


def resumable_state(model: Any, checkpoint: str, reshard: bool = False) -> str:
    """The checkpoint's hca_state version to load, checked against this world and (unless `reshard`:
    hca.load moves the pieces to this plan's layout) this model's plan."""
    what = f"hca.Trainer: resume_from_checkpoint={checkpoint!r}"
    world = dist.get_world_size() if dist.is_initialized() else 1
    start_over = _from_weights(model, checkpoint)
    found = on_rank0(lambda: _whole(checkpoint, world, what, start_over), what)
    if not reshard:
        into_this_plan = "or pass hca.Trainer(..., reshard=True) to load it into this plan's layout, "
        _check_plan(model, found["manifest"], what, into_this_plan + start_over)
    return found["dir"]


def load_model(model: Any, checkpoint: str, reshard: bool = False) -> None:
    """Every rank: the parameters, each rank its own pieces, from the checkpoint's hca_state."""
    load(model, None, resumable_state(model, checkpoint, reshard), reshard=reshard)


def load_state(trainer: Any, checkpoint: str, reshard: bool = False) -> None:
    """Every rank: the parameters and the optimizer's state (hca.load), then the scheduler's."""
    load(trainer.model, _optimizer(trainer), resumable_state(trainer.model, checkpoint, reshard), reshard=reshard)
    scheduler = torch.load(os.path.join(checkpoint, SCHEDULER), map_location="cpu", weights_only=True)
    trainer.lr_scheduler.load_state_dict(scheduler)
