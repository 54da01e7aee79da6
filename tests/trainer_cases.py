"""Rank functions for tests/test_trainer.py: `hca.Trainer` against the same steps on one device.

The collator records which rows each rank was given, so the one-device loop replays exactly
the global batches Trainer made (rank 0's rows, then rank 1's, ...), whatever its sampler did.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import torch_hca as hca

STEPS = 3
ROWS = 2  # per_device_train_batch_size
LR = 0.1
# SGD, not AdamW: the key bias of attention has a zero gradient (softmax ignores a shift) that comes
# out as rounding noise, which Adam normalizes into steps of size lr, different on every program.


def _gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=128,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "row": i}


class _RecordingCollator:
    def __init__(self):
        self.batches: list[list[int]] = []

    def __call__(self, features: list[dict]) -> dict:
        self.batches.append([f["row"] for f in features])
        ids = torch.stack([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": ids.clone()}


def _args(output_dir: str, **overrides):
    import transformers

    kwargs = dict(
        output_dir=output_dir,
        report_to="none",
        max_steps=STEPS,
        per_device_train_batch_size=ROWS,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps",
        save_steps=STEPS,
        save_only_model=True,  # a checkpoint is the model, written by its save_pretrained
        remove_unused_columns=False,  # the collator reads "row"
        use_cpu=True,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def _one_device(ref, ids: torch.Tensor, batches: list[list[int]]) -> list[float]:
    """Trainer's step on one device: the model's loss, clipped to norm 1 (Trainer's default), SGD."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for rows in batches:
        x = ids[rows]
        loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_like_one_device(hca_options: dict) -> dict[str, Any]:
    """3 Trainer steps of a data-parallel GPT-2; parameters, logged losses and the checkpoint vs one device."""
    import transformers

    torch._dynamo.reset()
    threads = torch.get_num_threads()  # accelerate may set its own for CPU ranks: give the world back its own
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = hca.init_mesh()
    ref = _gpt2()
    model = hca.sharded({}, mesh=mesh, inputs=Shard(0), outputs=Shard(0), loss_reduction="mean")(copy.deepcopy(ref))
    ids = torch.randint(0, 128, (8 * ROWS * world, 16), generator=torch.Generator().manual_seed(1))
    evals = torch.randint(0, 128, (ROWS * world, 16), generator=torch.Generator().manual_seed(2))
    out = [tempfile.mkdtemp(prefix="hca_trainer_")] if rank == 0 else [None]
    dist.broadcast_object_list(out)
    collator = _RecordingCollator()
    try:
        trainer = hca.Trainer(
            model=model,
            args=_args(out[0]),
            train_dataset=_Rows(ids),
            eval_dataset=_Rows(evals),
            data_collator=collator,
            hca_options=hca_options,
        )
        trainer.train()
        trained_with = hca.report(model).collective_counts()  # the training graph's (evaluate compiles another)
        evaluated = trainer.evaluate()  # one batch of the eval rows, each rank its own, under no_grad
    finally:
        torch.set_num_threads(threads)
    mine = collator.batches[:STEPS]  # the dataloader may fetch one batch ahead
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    global_batches = [sum((everyone[r][k] for r in range(world)), []) for k in range(STEPS)]
    losses = _one_device(ref, ids, global_batches)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with torch.no_grad():
        eval_loss = ref(input_ids=evals, labels=evals).loss.item()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    expected = dict(ref.named_parameters())
    errs = {n: rel(p.full_tensor(), expected[n].detach()) for n, p in model.named_parameters()}
    param_err = max(errs.values())
    saved_err = None
    if rank == 0:  # the checkpoint Trainer wrote (every rank joined the gather), loaded on one device
        saved = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(out[0], f"checkpoint-{STEPS}"))
        saved_err = max(rel(p.detach(), expected[n].detach()) for n, p in saved.named_parameters())
    return {
        "rows": mine,
        "global_batches": global_batches,
        "param_err": param_err,
        "param_errs": errs,
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(logged, losses)),
        "logged": logged,
        "saved_err": saved_err,
        "eval_err": abs(evaluated["eval_loss"] - eval_loss) / eval_loss,
        "wrapped": type(trainer.model_wrapped).__name__,
        "collectives": trained_with,
        "is_subclass": issubclass(hca.Trainer, transformers.Trainer),
    }


def refusals() -> dict[str, str]:
    """What hca.Trainer refuses, before Trainer itself starts: each error's class and message."""
    mesh = hca.init_mesh()
    found = {}

    def attempt(name, make_model, **arg_overrides):
        try:
            hca.Trainer(model=make_model(), args=_args(tempfile.mkdtemp(), **arg_overrides))
        except hca.HCAError as e:
            found[name] = f"{type(e).__name__}: {e}"
        else:
            found[name] = "no error"

    def dp(**kw):
        return lambda: hca.sharded({}, mesh=mesh, **kw)(_gpt2())

    threads = torch.get_num_threads()
    try:
        attempt("unsharded", _gpt2)
        attempt("compiled", lambda: torch.compile(dp(inputs=Shard(0), outputs=Shard(0), loss_reduction="mean")()))
        attempt("replicated inputs", dp(inputs=Replicate(), outputs=Shard(0), loss_reduction="mean"))
        attempt("sum", dp(inputs=Shard(0), outputs=Shard(0)))
        attempt(
            "optimizer checkpoints",
            dp(inputs=Shard(0), outputs=Shard(0), loss_reduction="mean"),
            save_only_model=False,
        )
        try:
            hca.Trainer(model=dp(inputs=Shard(0), outputs=Shard(0), loss_reduction="mean")())
        except hca.HCAError as e:
            found["no args"] = f"{type(e).__name__}: {e}"
        attempt(
            "torch_compile",
            dp(inputs=Shard(0), outputs=Shard(0), loss_reduction="mean"),
            torch_compile=True,
        )
    finally:
        torch.set_num_threads(threads)
    return found
