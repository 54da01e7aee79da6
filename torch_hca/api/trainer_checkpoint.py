"""`hca.Trainer`'s checkpoints: what Trainer writes, plus the sharded state `hca.save` keeps.

    checkpoint-N/
      model.safetensors, config.json   the whole model (save_pretrained: a gather, rank 0 writes);
                                       loads with from_pretrained on one device
      hca_state/LATEST, v00000001/     hca.save(model, optimizer): every rank's pieces of the
                                       parameters and of the optimizer's state (momentum, moments)
      scheduler.pt                     the LR scheduler's state (plain numbers; rank 0 writes)
      hca_trainer.json                 the world size and the rows of one optimizer step (rank 0)
      rng_state_<rank>.pth             each rank's generators (Trainer's own)
      trainer_state.json               the step, the log history (Trainer's own; rank 0 writes)

Trainer writes its files one after another and publishes nothing; ``hca_state`` is published
atomically (docs/checkpoints.md). Resuming checks, before reading any tensor, that the
checkpoint is whole and was written by this many ranks under this plan, then loads the
parameters and the optimizer's state with `hca.load` (every rank its own pieces, no gather).

With ``reshard`` a checkpoint of another world size resumes too, if one optimizer step takes as
many rows (per-device rows x ranks x accumulation): Trainer then skips the batches already
trained and the global batches go on as before, and every rank takes rank 0's generators (under
torch_hca every rank's generators agree: torch_hca/compiler/randomness.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_hca.api.checkpoint import CheckpointError, _describe, _find, _layout_text, load, on_rank0, save

HCA_STATE = "hca_state"
SCHEDULER = "scheduler.pt"  # transformers' SCHEDULER_NAME
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
RUN = "hca_trainer.json"  # the world size and the rows of one optimizer step


def _optimizer(trainer: Any) -> torch.optim.Optimizer:
    """The torch optimizer itself: accelerate wraps it (AcceleratedOptimizer), DCP reads the one inside."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rows_per_step(args: Any) -> int:
    """The rows one optimizer step trains on, over all ranks."""
    return args.per_device_train_batch_size * _world() * args.gradient_accumulation_steps


def save_state(trainer: Any, output_dir: str) -> None:
    """Every rank: the parameters' and optimizer's pieces (hca.save); rank 0: the scheduler's state
    and the run's shape (what a resume at another world size checks)."""
    save(trainer.model, _optimizer(trainer), os.path.join(output_dir, HCA_STATE), keep=1)
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))
        with open(os.path.join(output_dir, RUN), "w") as f:
            json.dump({"world_size": _world(), "rows_per_step": rows_per_step(trainer.args)}, f)


def _from_weights(model: Any, checkpoint: str) -> str:
    name = type(model).__name__
    return (
        f"or start a new run from its weights: hca.sharded(plan, ...)({name}.from_pretrained({checkpoint!r})) "
        "(the optimizer's state starts over)"
    )


def _other_world(checkpoint: str, saved_world: int, rows: int, reshard: bool, what: str, start_over: str) -> None:
    """A checkpoint of `saved_world` ranks resumes on this world only resharded and with the same
    rows a step, so that the batches Trainer skips are the ones already trained."""
    world = _world()
    if not reshard:
        raise CheckpointError(
            f"{what}: {checkpoint} was written by {saved_world} ranks and this run has {world}; resume it "
            f"with {saved_world} ranks, or pass hca.Trainer(..., reshard=True) to load each rank's pieces of "
            f"the state into this world, {start_over}"
        )
    path = os.path.join(checkpoint, RUN)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{what}: {checkpoint} has no {RUN} (written by an earlier torch_hca), so the rows of its steps are "
            f"unknown; resume it with {saved_world} ranks, {start_over}"
        )
    with open(path) as f:
        saved_rows = json.load(f)["rows_per_step"]
    if saved_rows != rows:
        raise CheckpointError(
            f"{what}: {checkpoint}'s steps took {saved_rows} rows each ({saved_world} ranks) and this run's take "
            f"{rows} ({world} ranks x per_device_train_batch_size x gradient_accumulation_steps); Trainer would "
            f"skip the wrong batches: set per_device_train_batch_size (or the accumulation) so that a step takes "
            f"{saved_rows} rows, {start_over}"
        )


def _whole(checkpoint: str, rows: int, reshard: bool, what: str, start_over: str) -> dict:
    """Rank 0: the published hca_state and its manifest, and Trainer's own files, all present."""
    if not os.path.isdir(os.path.join(checkpoint, HCA_STATE)):
        raise CheckpointError(
            f"{what}: {checkpoint} has no {HCA_STATE}/ (the optimizer's state): it was written with "
            "save_only_model=True, or not by hca.Trainer, so resuming would start the optimizer and the LR "
            f"schedule over; resume from a checkpoint hca.Trainer wrote without save_only_model, {start_over}"
        )
    found = _find(os.path.join(checkpoint, HCA_STATE), what)
    saved_world = found["manifest"]["world_size"]
    if saved_world != _world():
        _other_world(checkpoint, saved_world, rows, reshard, what, start_over)
    rng = ["rng_state.pth"] if saved_world <= 1 else [f"rng_state_{r}.pth" for r in range(saved_world)]
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


def resumable_state(model: Any, checkpoint: str, rows: int, reshard: bool = False) -> dict:
    """The checkpoint's hca_state (its directory and manifest), checked against this world, the
    rows of a step and (unless `reshard`: hca.load moves the pieces to this plan's layout) this
    model's plan."""
    what = f"hca.Trainer: resume_from_checkpoint={checkpoint!r}"
    start_over = _from_weights(model, checkpoint)
    found = on_rank0(lambda: _whole(checkpoint, rows, reshard, what, start_over), what)
    if not reshard:
        into_this_plan = "or pass hca.Trainer(..., reshard=True) to load it into this plan's layout, "
        _check_plan(model, found["manifest"], what, into_this_plan + start_over)
    return found


def _load(trainer: Any, model: Any, optimizer: Any, checkpoint: str) -> None:
    """Every rank: its pieces of `model`'s parameters (and `optimizer`'s state) from the checkpoint's
    hca_state, checked first; the world that wrote it is kept for the generators (`load_rng_state`)."""
    found = resumable_state(model, checkpoint, rows_per_step(trainer.args), trainer.hca_reshard)
    trainer.hca_saved_world = found["manifest"]["world_size"]
    load(model, optimizer, found["dir"], reshard=trainer.hca_reshard)


def load_model(trainer: Any, model: Any, checkpoint: str) -> None:
    """Every rank: the parameters, each rank its own pieces, from the checkpoint's hca_state."""
    _load(trainer, model, None, checkpoint)


def load_state(trainer: Any, checkpoint: str) -> None:
    """Every rank: the parameters and the optimizer's state (hca.load), then the scheduler's."""
    _load(trainer, trainer.model, _optimizer(trainer), checkpoint)
    scheduler = torch.load(os.path.join(checkpoint, SCHEDULER), map_location="cpu", weights_only=True)
    trainer.lr_scheduler.load_state_dict(scheduler)


def load_rng_state(trainer: Any, checkpoint: str, load_own: Callable[[str], None]) -> None:
    """Each rank's generators: its own file (`load_own`, Trainer's reader), or rank 0's where the
    checkpoint is of another world size (a new rank has no file; under torch_hca every rank's agree)."""
    saved = getattr(trainer, "hca_saved_world", _world())
    if saved == _world():
        load_own(checkpoint)
        return
    with tempfile.TemporaryDirectory(prefix="hca_rng_") as view:
        # Trainer reads rng_state_<this rank>.pth: show it rank 0's under that name.
        name = "rng_state.pth" if _world() <= 1 else f"rng_state_{dist.get_rank()}.pth"
        source = "rng_state.pth" if saved <= 1 else "rng_state_0.pth"
        os.symlink(os.path.abspath(os.path.join(checkpoint, source)), os.path.join(view, name))
        load_own(view)
