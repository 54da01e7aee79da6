"""`hca.Trainer`: Hugging Face's ``transformers.Trainer`` for a model sharded with `hca.sharded`.

A subclass, changing five things and patching nothing:

- **No DDP.** The model's parameters are DTensors and the data parallelism is the plan's, so
  accelerate must not wrap the model. The subclass answers True to Trainer's own question
  ``is_distributed_loading_by_transformers`` ("the model owns its placement and gradient
  reduction", what transformers asks of a model sharded at load time): Trainer then prepares
  the model for evaluation only (no DDP), leaves its device alone, and every rank joins
  ``_save``, so that the model's ``save_pretrained`` (torch_hca/api/pretrained.py: a gather,
  every rank calls it) runs on every rank and rank 0 writes.
- **Compiled forward.** ``compute_loss`` calls ``torch.compile(model, backend="hca")`` in
  place of the model: training steps and evaluation losses run the compiled program; other
  calls (``prediction_step`` without labels, ``generate``) are eager calls of the sharded model.
- **Each rank its rows.** Under torchrun or `hca.run`, Trainer's dataloader already gives
  each rank its own batch of ``per_device_train_batch_size`` rows (accelerate shards the batch
  sampler); the plan must say so: ``inputs=Shard(0)``, ``outputs=Shard(0)`` on every mesh dim.
- **The global batch's loss.** ``model_accepts_loss_kwargs`` is False, so Trainer passes no
  ``num_items_in_batch`` and does not multiply the loss by the world size (its correction for
  DDP's averaging): the model's loss (``labels=``) is a 0-d result, the global batch's mean as
  one device computes it. A loss Trainer computes from the logits (``compute_loss_func``,
  label smoothing) is one rank's, combined as DDP would under ``loss_reduction="mean"``.
- **Checkpoints that resume.** Trainer's optimizer file would be one rank's ``torch.save`` of
  DTensors; the subclass's ``_save_optimizer_and_scheduler`` writes the parameters' and the
  optimizer's pieces with `hca.save` instead (every rank enters it), and its
  ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler`` read them back with `hca.load`
  (torch_hca/api/trainer_checkpoint.py). Trainer's own RNG files and trainer state are kept
  (resumed at another world size, every rank takes rank 0's generators).

transformers is imported here, and this module only when ``hca.Trainer`` is first used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import Shard

from torch_hca.api import trainer_checkpoint
from torch_hca.errors import OptionsError, PlanError, UnsupportedError
from torch_hca.compiler.plan_layouts import grad_scale
from torch_hca.spmd.shares import UnevenShard

_FIX = (
    "shard it for data parallelism first: model = hca.sharded(plan, inputs=Shard(0), outputs=Shard(0), "
    'loss_reduction="mean")(model)'
)


def _check_model(model: Any) -> None:
    """The model Trainer gets: an `hca.sharded` module whose batch is cut by rows, as Trainer feeds it."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise UnsupportedError(
            "hca.Trainer: model is what torch.compile returned; pass the sharded model itself "
            "(hca.Trainer compiles its forward with backend='hca')"
        )
    spec = getattr(model, "_hca_spec", None)
    if spec is None:
        raise PlanError(f"hca.Trainer: this {type(model).__name__} is not sharded by torch_hca; {_FIX}")
    if spec.per_argument:
        raise UnsupportedError(
            "hca.Trainer: the plan gives inputs= per positional argument, but Trainer passes every "
            "tensor by keyword; give one layout for all: inputs=Shard(0)"
        )

    def by_rows(layout) -> bool:
        return all(isinstance(p, Shard) and not isinstance(p, UnevenShard) and p.dim == 0 for p in layout)

    for what, layout in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        if not by_rows(layout):
            raise UnsupportedError(
                f"hca.Trainer: the plan has {what}={layout!r}, but Trainer's dataloader gives each rank its own "
                f"rows of the batch, equal in number; use {what}=Shard(0) on every mesh dim (a batch "
                "every rank must see whole, or cut by shares, needs your own loop: docs/huggingface.md)"
            )
    ranks = spec.mesh.mesh.flatten().tolist()
    if ranks != list(range(len(ranks))):
        raise UnsupportedError(
            f"hca.Trainer: the mesh orders the ranks {ranks}; Trainer gives rank r the r-th rows of the batch, "
            "so the mesh must list the ranks in order (hca.init_mesh does)"
        )
    if spec.grad_scale != grad_scale("mean", spec.mesh, spec.outputs):
        raise PlanError(
            'hca.Trainer: the model is sharded with loss_reduction="sum"; Trainer\'s losses are means over '
            'each rank\'s rows, combined as DDP averages them: shard with loss_reduction="mean"'
        )


def _check_args(args: Any) -> None:
    """TrainingArguments whose compile settings would compile the model a second time."""
    backend = getattr(args, "torch_compile_backend", None)
    if getattr(args, "torch_compile", False) or backend is not None:
        raise OptionsError(
            "hca.Trainer: leave TrainingArguments' torch_compile and torch_compile_backend unset; "
            "hca.Trainer compiles the model with backend='hca' itself"
        )


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for an `hca.sharded` model: no DDP, forward compiled with ``backend="hca"``.

    ``hca_options`` is passed to ``torch.compile(..., options=)`` (docs/api.md, backend options).
    ``reshard=True`` resumes a checkpoint written under another plan or by another number of ranks
    (with as many rows a step): `hca.load` moves the parameters' and the optimizer's pieces to
    this model's layout and world.
    Every rank constructs it and calls ``train()`` (``resume_from_checkpoint=`` one of its checkpoints
    included), ``evaluate()`` and ``save_model()``.
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *rest: Any,
        hca_options: dict | None = None,
        reshard: bool = False,
        **kwargs,
    ):
        _check_model(model)
        self.hca_reshard = bool(reshard)
        if args is None:  # Trainer's own default
            args = transformers.TrainingArguments(output_dir="tmp_trainer")
        _check_args(args)
        # Trainer refuses optimizer checkpoints for any model that owns its sharding (its own files
        # cannot resume one); hca.Trainer writes and reads them with hca.save / hca.load, so that
        # check is passed with save_only_model set for the duration of __init__, then restored.
        model_only = args.save_only_model
        args.save_only_model = True
        try:
            super().__init__(model, args, *rest, **kwargs)
        finally:
            args.save_only_model = model_only
        # The model computes its loss whole (a 0-d result): no token count from Trainer, no x world size.
        self.model_accepts_loss_kwargs = False
        self.hca_compiled = torch.compile(self.model, backend="hca", options=dict(hca_options or {}))

    # Trainer asks this of the model (a model sharded at load time answers True) and sets it in
    # __init__; for an hca-sharded model the answer is always yes, whatever it is set to.
    @property
    def is_distributed_loading_by_transformers(self) -> bool:
        return True

    @is_distributed_loading_by_transformers.setter
    def is_distributed_loading_by_transformers(self, value: bool) -> None:
        pass

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model is self.model or model is self.model_wrapped:
            model = self.hca_compiled
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    # Checkpoints: every rank enters these (Trainer's _save_checkpoint calls them outside its
    # should_save); hca.save / hca.load write and read each rank's pieces (trainer_checkpoint.py).
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        trainer_checkpoint.save_state(self, output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        trainer_checkpoint.load_model(self, self.model if model is None else model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            trainer_checkpoint.load_state(self, checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            trainer_checkpoint.load_rng_state(self, checkpoint, super()._load_rng_state)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=state_dict)
        if dist.is_initialized():
            dist.barrier()  # the non-writers return before rank 0 has written the rest (args, tokenizer)
