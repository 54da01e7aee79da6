"""Rank functions for tests/test_trainer.py: `hca.Trainer` against the same steps on one device.

The collator records which rows each rank was given, so the one-device loop replays exactly
the global batches Trainer made (rank 0's rows, then rank 1's, ...), whatever its sampler did.
"""

from __future__ import annotations

import copy
import gc
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import torch_hca as hca

STEPS = 4
SAVE_AT = 2  # Trainer writes checkpoint-2 and checkpoint-4; the resumed run starts from checkpoint-2
ROWS = 2  # per_device_train_batch_size
LR = 0.1
MOMENTUM = 0.9  # optimizer state a checkpoint must carry for the resumed run to continue exactly
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
        optim_args=f"momentum={MOMENTUM}",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        remove_unused_columns=False,  # the collator reads "row"
        use_cpu=True,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def _one_device(ref, ids: torch.Tensor, batches: list[list[int]]) -> list[float]:
    """Trainer's step on one device: the model's loss, clipped to norm 1 (Trainer's default), SGD with momentum."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _shared_dir() -> str:
    out = [tempfile.mkdtemp(prefix="hca_trainer_")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(out)
    return out[0]


def _logged(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


_RUNS: dict[str, dict[str, Any]] = {}  # this rank process's uninterrupted run, shared by the tests that use it


def _uninterrupted(hca_options: dict) -> dict[str, Any]:
    """STEPS Trainer steps of a data-parallel GPT-2 (checkpoints at SAVE_AT and STEPS) and the same on one device."""
    key = repr(sorted(hca_options.items()))
    if key in _RUNS:
        return _RUNS[key]
    torch._dynamo.reset()
    threads = torch.get_num_threads()  # accelerate may set its own for CPU ranks: give the world back its own
    world = dist.get_world_size()
    mesh = hca.init_mesh()
    ref = _gpt2()
    model = hca.sharded({}, mesh=mesh, inputs=Shard(0), outputs=Shard(0), loss_reduction="mean")(copy.deepcopy(ref))
    ids = torch.randint(0, 128, (8 * ROWS * world, 16), generator=torch.Generator().manual_seed(1))
    evals = torch.randint(0, 128, (ROWS * world, 16), generator=torch.Generator().manual_seed(2))
    out = _shared_dir()
    collator = _RecordingCollator()
    try:
        trainer = hca.Trainer(
            model=model,
            args=_args(out),
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
    with torch.no_grad():
        eval_loss = ref(input_ids=evals, labels=evals).loss.item()
    _RUNS[key] = {
        "out": out,
        "ids": ids,
        "rows": mine,
        "global_batches": global_batches,
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "reference": {n: p.detach().clone() for n, p in ref.named_parameters()},
        "losses": losses,
        "logged": _logged(trainer),
        "eval_loss": evaluated["eval_loss"],
        "reference_eval_loss": eval_loss,
        "wrapped": type(trainer.model_wrapped).__name__,
        "collectives": trained_with,
    }
    return _RUNS[key]


def train_like_one_device(hca_options: dict) -> dict[str, Any]:
    """STEPS Trainer steps of a data-parallel GPT-2; parameters, logged losses and the checkpoint vs one device."""
    import transformers

    run = _uninterrupted(hca_options)
    expected = run["reference"]
    errs = {n: _rel(p, expected[n]) for n, p in run["params"].items()}
    saved_err = None
    if dist.get_rank() == 0:  # the checkpoint Trainer wrote (every rank joined the gather), loaded on one device
        saved = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(run["out"], f"checkpoint-{STEPS}"))
        saved_err = max(_rel(p.detach(), expected[n]) for n, p in saved.named_parameters())
    logged, losses = run["logged"], run["losses"]
    return {
        "rows": run["rows"],
        "global_batches": run["global_batches"],
        "param_err": max(errs.values()),
        "param_errs": errs,
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(logged, losses)),
        "logged": logged,
        "saved_err": saved_err,
        "eval_err": abs(run["eval_loss"] - run["reference_eval_loss"]) / run["reference_eval_loss"],
        "wrapped": run["wrapped"],
        "collectives": run["collectives"],
        "is_subclass": issubclass(hca.Trainer, transformers.Trainer),
    }


def _resuming_trainer(run: dict, plan: dict, collator=None, rows: int = ROWS, **trainer_options):
    mesh = hca.init_mesh()
    model = hca.sharded(plan, mesh=mesh, inputs=Shard(0), outputs=Shard(0), loss_reduction="mean")(_gpt2())
    return hca.Trainer(
        model=model,
        args=_args(_shared_dir(), per_device_train_batch_size=rows),
        train_dataset=_Rows(run["ids"]),
        data_collator=collator or _RecordingCollator(),
        **trainer_options,
    )


def _refused(trainer, checkpoint: str) -> str:
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except hca.HCAError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _damaged_copies(checkpoint: str) -> dict[str, str]:
    """Rank 0 writes, every rank gets: checkpoint-2 without its hca_state, and one whose manifest says 4 ranks."""
    import json
    import shutil

    paths = [None, None]
    if dist.get_rank() == 0:
        root = tempfile.mkdtemp(prefix="hca_trainer_bad_")
        paths = [os.path.join(root, "model-only"), os.path.join(root, "four-ranks")]
        shutil.copytree(checkpoint, paths[0], ignore=shutil.ignore_patterns("hca_state"))
        shutil.copytree(checkpoint, paths[1])
        state = os.path.join(paths[1], "hca_state")
        with open(os.path.join(state, "LATEST")) as f:
            manifest_file = os.path.join(state, f.read().strip(), "hca.json")
        with open(manifest_file) as f:
            manifest = json.load(f)
        manifest["world_size"] = 4
        with open(manifest_file, "w") as f:
            json.dump(manifest, f)
    dist.broadcast_object_list(paths)
    return {"model only": paths[0], "four ranks": paths[1]}


def resume_like_uninterrupted(hca_options: dict) -> dict[str, Any]:
    """A fresh model and Trainer resumed from checkpoint-SAVE_AT to STEPS vs the uninterrupted run; then
    the refusals of checkpoints that cannot resume, and the same resume without the optimizer's state."""
    run = _uninterrupted(hca_options)
    checkpoint = os.path.join(run["out"], f"checkpoint-{SAVE_AT}")
    # A resumed run starts in a new process, with Dynamo's memory empty: without this reset the
    # new model's mesh index, another int than the first run's, is traced as a symbol.
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    collator = _RecordingCollator()
    refused = {}
    try:
        trainer = _resuming_trainer(run, {}, collator)
        trainer.train(resume_from_checkpoint=checkpoint)
        resumed = {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}
        logged, step = _logged(trainer), trainer.state.global_step
        for name, path in _damaged_copies(checkpoint).items():
            refused[name] = _refused(trainer, path)
        other_plan = _resuming_trainer(run, {"transformer.h.*.mlp.c_fc.weight": Shard(1)})
        refused["another plan"] = _refused(other_plan, checkpoint)
        # The control: the same resume, the optimizer's state not loaded (momentum starts from zero).
        trainer.optimizer = None  # Trainer makes a fresh one
        trainer._load_optimizer_and_scheduler = lambda checkpoint: None
        trainer.train(resume_from_checkpoint=checkpoint)
        forgetful = {n: p.full_tensor().detach() for n, p in trainer.model.named_parameters()}
        # The same checkpoint loaded into that plan (reshard=True): it trains on as if never stopped.
        # A resume in a new process starts with nothing of the runs before it: the trainers above
        # (their compiled code, their pending work) are dropped and the ranks meet before the new
        # mesh, as they would in a fresh job. (Once, on CI, a rank crashed in gloo inside this
        # resume's clip_grad_norm with the earlier trainers still alive; not reproduced since.)
        del trainer, other_plan
        gc.collect()
        dist.barrier()
        torch._dynamo.reset()
        resharded = _resuming_trainer(run, {"transformer.h.*.mlp.c_fc.weight": Shard(1)}, reshard=True)
        resharded.train(resume_from_checkpoint=checkpoint)
        resharded_params = {n: p.full_tensor().detach().clone() for n, p in resharded.model.named_parameters()}
        resharded_layout = str(dict(resharded.model.named_parameters())["transformer.h.0.mlp.c_fc.weight"].placements)
        resharded_collectives = {d: hca.report(resharded.model).collective_counts(d) for d in ("forward", "backward")}
    finally:
        torch.set_num_threads(threads)
    return {
        "batches": collator.batches,
        "rows": run["rows"],
        "param_err": max(_rel(p, run["params"][n]) for n, p in resumed.items()),
        "reference_err": max(_rel(p, run["reference"][n]) for n, p in resumed.items()),
        "logged": logged,
        "uninterrupted_logged": run["logged"],
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(logged, run["logged"])),
        "step": step,
        "refused": refused,
        "forgetful_err": max(_rel(p, run["params"][n]) for n, p in forgetful.items()),
        "resharded_err": max(_rel(p, run["params"][n]) for n, p in resharded_params.items()),
        "resharded_layout": resharded_layout,
        "resharded_collectives": resharded_collectives,
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
            "torch_compile",
            dp(inputs=Shard(0), outputs=Shard(0), loss_reduction="mean"),
            torch_compile=True,
        )
    finally:
        torch.set_num_threads(threads)
    return found


def checkpoint_for_another_world(hca_options: dict) -> dict[str, Any] | None:
    """Rank 0: what a resume at another world size needs of the uninterrupted run and its checkpoint."""
    run = _uninterrupted(hca_options)
    if dist.get_rank() != 0:
        return None
    keep = ("ids", "params", "logged", "global_batches")
    return {"checkpoint": os.path.join(run["out"], f"checkpoint-{SAVE_AT}"), **{k: run[k] for k in keep}}


def resume_at_another_world(run: dict[str, Any]) -> dict[str, Any]:
    """checkpoint-SAVE_AT of the 2-rank run resumed by this world (4 ranks, one row each: the same rows
    a step), resharded, to STEPS; then the refusals: no reshard, and another number of rows a step."""
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    rows = ROWS * 2 // dist.get_world_size()
    collator = _RecordingCollator()
    try:
        trainer = _resuming_trainer(run, {}, collator, reshard=True, rows=rows)
        trainer.train(resume_from_checkpoint=run["checkpoint"])
        params = {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}
        logged, step = _logged(trainer), trainer.state.global_step
        collectives = hca.report(trainer.model).collective_counts()
        refused = {
            "no reshard": _refused(_resuming_trainer(run, {}, rows=rows), run["checkpoint"]),
            "other rows": _refused(_resuming_trainer(run, {}, reshard=True, rows=ROWS), run["checkpoint"]),
        }
    finally:
        torch.set_num_threads(threads)
    mine = collator.batches[: STEPS - SAVE_AT]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {
        "global_batches": [sum((e[k] for e in everyone), []) for k in range(len(mine))],
        "param_err": max(_rel(p, run["params"][n]) for n, p in params.items()),
        "logged": logged,
        "step": step,
        "collectives": collectives,
        "refused": refused,
    }
