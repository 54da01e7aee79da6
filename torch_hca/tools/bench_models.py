"""The bench's models and contestants: what `python -m torch_hca bench` trains, and how
each contestant builds its copy of a model (`torch_hca.tools.bench` has the overview).

A `Spec` is a model with its storage plan, batches and loss; `applies` says which
contestants run on it; `build` makes one contestant; `analytic_min` is the bytes per
step of the model's textbook strategy, which the tables compare against.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from torch_hca.api.plan import sharded
from torch_hca.api.sharded_forward import trace_over_dtensor
from ..spmd.collective_kinds import Kind, bytes_per_rank
from . import zoo

CONTESTANTS = (
    "hca",
    "hca_inductor",
    "hca_tune",
    "hca_noschedule",
    "hca_dtensor_layout",
    "hca_dp",
    "hca_dp_replicated",
    "dtensor_eager",
    "dtensor_inductor",
    "expert",
    "expert_inductor",
    "ddp",
    "fsdp2",
    "single_inductor",
)
MODELS = ("mlp", "block", "lm", "tt", "dp", "dp512", "fsdp")
LR = 1e-3
# The other layouts hca could have chosen on the plan's storage, each compiled by hca: `regret` is
# hca's step over the fastest. The expert plans' storage is hca's plan on every tensor-parallel model
# (a test checks), so "the expert storage under layout='dtensor'" is hca_dtensor_layout, not another
# contestant. hca_dp_replicated changes the storage (every parameter whole on every rank), which the
# plan does not give: it is shown for reference, not counted in the regret.
ALTERNATIVES = ("hca_dtensor_layout", "hca_dp")
# hca's contestants: (storage plan or None for the spec's, batch split, backend options).
_HCA = {
    "hca": (None, None, {}),
    "hca_inductor": (None, None, {"inner": "inductor"}),
    "hca_tune": (None, None, {"layout": "tune"}),  # the layout chosen by the clock on the first call
    "hca_noschedule": (None, None, {"schedule": False}),
    "hca_dtensor_layout": (None, None, {"layout": "dtensor"}),
    "hca_dp": (None, True, {}),  # data parallel on the plan's storage: weights gathered as needed
    "hca_dp_replicated": ({}, True, {}),  # plain data parallel: the model replicated
}
# The contestant each kind of model is measured against by hand (besides DTensor).
_EXPERT = {"tp": "expert", "dp": "ddp", "fsdp": "fsdp2"}
_SCHEDULE_KINDS = ("dp", "fsdp")
# Is tensor parallelism faster than one device, and than the expert plan under Inductor? Asked on
# torch's test Transformer (each Inductor compile costs the smoke test ~10 s per model).
_ONE_DEVICE_QUESTION = ("expert_inductor", "single_inductor")
_DTENSOR_RUN = ("dtensor_eager", "dtensor_inductor")  # DTensor runs the forward as written


def _square_loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # "tp", "dp" or "fsdp": the contestants that apply and the analytic minimum
    build: Callable[[], nn.Module]
    plan: dict
    batch: Callable[[torch.Generator], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _square_loss
    # The full batch's loss from the losses of its row shards: "sum" (their sum),
    # "mean" (their mean, equal shards), or None (a batch split is not the same training).
    split_loss: str | None = "sum"
    # Whether DTensor runs the model's forward as written (dtensor_eager and dtensor_inductor need
    # every value made in forward to be a DTensor; hca's layout="dtensor" makes them so).
    dtensor_runs: bool = True

    def rows(self) -> int:
        return self.batch(torch.Generator().manual_seed(0)).shape[0]


def _randn(*shape):
    return lambda g: torch.randn(shape, generator=g)


def specs(tiny: bool = False) -> dict[str, Spec]:
    """The bench models: full size, or tiny ones for a smoke test."""
    d, h, b = (16, 32, 8) if tiny else (256, 1024, 32)
    lm = (
        dict(vocab=64, dim=32, heads=4, hidden=64, layers=1)
        if tiny
        else dict(vocab=512, dim=128, heads=4, hidden=512, layers=4)
    )
    bs, seq = (2, 8) if tiny else (8, 64)
    depth = 3 if tiny else 12  # the dp and fsdp models' layers
    wide, wide_rows = (d, b) if tiny else (512, 64)  # dp512's width and batch
    tt = (
        dict(layers=1, vocab=64, seq=8, dim=16, heads=4)
        if tiny
        else dict(layers=4, vocab=512, seq=64, dim=256, heads=8)
    )
    return {
        "mlp": Spec("mlp", "tp", lambda: zoo.MLP(d, h), zoo.MEGATRON_MLP, _randn(b, d)),
        "block": Spec(
            "block",
            "tp",
            lambda: zoo.TransformerBlock(d, 4 if tiny else 8, h),
            zoo.TP_BLOCK,
            _randn(max(bs // 2, 2), seq, d),
        ),  # at least 2 rows: hca_dp splits them
        "lm": Spec(
            "lm",
            "tp",
            lambda: zoo.TinyLM(**lm),
            zoo.TP_LM,
            lambda g: torch.randint(0, lm["vocab"], (bs, seq), generator=g),
            zoo.lm_loss,
            "mean",
        ),
        # torch's own test Transformer, stored as its `Transformer.parallelize` stores it.
        "tt": Spec(
            "tt",
            "tp",
            lambda: zoo.torch_transformer(**tt),
            zoo.TP_TEST_TRANSFORMER,
            lambda g: torch.randint(0, tt["vocab"], (bs, tt["seq"]), generator=g),
            zoo.lm_loss,
            "mean",
            # forward's `pos = torch.arange(...)` is a plain tensor into the sharded position
            # embedding: DTensor raises "got mixed torch.Tensor and DTensor" (docs/bench.md).
            dtensor_runs=False,
        ),
        # Enough rows that data parallelism beats gathering the batch and replicating the
        # work (with few rows the layout solver would rather gather: docs/layout.md).
        "dp": Spec("dp", "dp", lambda: zoo.DeepMLP(d, depth), {}, _randn(16 * b, d)),
        # 24 tensors of Linear(512, 512) at 64 rows: reducing the gradients sends more bytes than
        # moving the activations would, in fewer collectives (the layout solver must weigh both).
        "dp512": Spec("dp512", "dp", lambda: zoo.DeepMLP(wide, depth), {}, _randn(wide_rows, wide)),
        # A batch larger than a layer's weights, so gathering the weights (FSDP) is the
        # cheaper layout; with fewer rows the layout solver gathers activations instead.
        "fsdp": Spec("fsdp", "fsdp", lambda: zoo.DeepMLP(d, depth), zoo.FSDP_PLAN, _randn(16 * b, d)),
    }


def applies(spec: Spec, contestant: str, world_size: int = 2) -> bool:
    if contestant in _ONE_DEVICE_QUESTION:
        return spec.name == "tt"
    if contestant in _DTENSOR_RUN:
        return spec.dtensor_runs
    if contestant in _EXPERT.values():
        return _EXPERT[spec.kind] == contestant
    splits = spec.split_loss is not None and spec.rows() % world_size == 0
    if contestant == "hca_dp":  # on the dp and fsdp models (batch split already) it is hca itself
        return spec.kind == "tp" and splits
    if contestant == "hca_dp_replicated":  # on the data-parallel model it is hca itself
        return spec.kind != "dp" and splits
    return contestant != "hca_noschedule" or spec.kind in _SCHEDULE_KINDS


# ------------------------------------------------------------ expert plans


def _local_heads_forward(self, x):
    """zoo.Attention's forward as a tensor-parallel trainer writes it: local heads, -1 widths."""
    b, s, d = x.shape
    hd = d // self.global_heads
    split = lambda t: t.view(b, s, -1, hd).transpose(1, 2)
    q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.wo(y.transpose(1, 2).reshape(b, s, -1))


def _sequence_parallel_block(prefix: str) -> dict:
    """Megatron sequence parallel: norms on sequence shards, all-gather in, reduce-scatter out."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # DTensors in (use_local_output=False, as torchtitan writes it): the q, k and v input
    # gradients then sum as one Partial and are reduce-scattered once.
    gather = lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        f"{prefix}norm1": SequenceParallel(),
        f"{prefix}attn": gather(),
        f"{prefix}attn.wq": ColwiseParallel(),
        f"{prefix}attn.wk": ColwiseParallel(),
        f"{prefix}attn.wv": ColwiseParallel(),
        f"{prefix}attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        f"{prefix}norm2": SequenceParallel(),
        f"{prefix}mlp": gather(),
        f"{prefix}mlp.fc1": ColwiseParallel(),
        f"{prefix}mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _expert(model: nn.Module, spec: Spec, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if spec.name == "mlp":
        return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if spec.name == "tt":  # the model's own plan, attention on local tensors and heads
        return type(model).parallelize(model, mesh, use_seq_parallel=False, local_output_for_attn=True)
    for m in model.modules():
        if isinstance(m, zoo.Attention):
            m.global_heads = m.heads
            m.forward = types.MethodType(_local_heads_forward, m)
    if spec.name == "block":  # replicated [b, s, d] in and out, sequence shards inside
        parallelize_module(
            model,
            mesh,
            PrepareModuleInputOutput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_input=True,
                output_layouts=(Shard(1),),
                desired_output_layouts=(Replicate(),),
            ),
        )
        return parallelize_module(model, mesh, _sequence_parallel_block(""))
    return parallelize_module(
        model,
        mesh,
        {  # lm: embedding and head replicated, as TP_LM
            "embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            **_sequence_parallel_block("blocks.*."),
            "norm": SequenceParallel(),
            "head": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        },
    )


def _fsdp2(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# ------------------------------------------------------------ one contestant, built


@dataclass(frozen=True)
class Built:
    model: nn.Module  # whose parameters train
    run: Callable  # what runs the forward
    scale: float  # the loss scale that trains the same thing as one device on the full batch
    split: bool  # whether each rank gets its rows of the batch
    loss_inside: bool = False  # `run` returns the loss itself (computed in the compiled module)


def build(spec: Spec, contestant: str, ref: nn.Module, mesh, costs: dict, hca_options: dict | None = None) -> Built:
    """`contestant` on a copy of `ref`; `costs`: the cost model's figures for hca's contestants,
    `hca_options`: backend options added to theirs (``bench --hca-options``; a cost model there
    overrides single figures of `costs`)."""
    base, n = copy.deepcopy(ref), mesh.size()
    if contestant in _HCA or contestant in ("dtensor_eager", "dtensor_inductor"):
        plan, split, options = _HCA.get(contestant, (None, None, {}))
        split = spec.kind != "tp" if split is None else split
        io = Shard(0) if split else Replicate()
        model = sharded(spec.plan if plan is None else plan, mesh=mesh, inputs=io, outputs=io)(base)
        if contestant == "dtensor_inductor":
            run = torch.compile(trace_over_dtensor(model))
        elif contestant == "dtensor_eager":
            run = model
        else:
            extra = dict(hca_options or {})
            costs = {**costs, **extra.pop("cost_model", {})}
            run = torch.compile(
                model, backend="hca", options={**extra, **options, **({"cost_model": costs} if costs else {})}
            )
        # Each rank's loss covers its rows; hca sums the ranks' gradients.
        return Built(model, run, 1.0 / n if split and spec.split_loss == "mean" else 1.0, split)
    if contestant in ("expert", "expert_inductor"):
        model = _expert(base, spec, mesh)
        return Built(model, model if contestant == "expert" else torch.compile(model), 1.0, False)
    if contestant == "single_inductor":  # one device's program on the full batch, on every rank: no communication
        return Built(base, torch.compile(base), 1.0, False)
    # DDP and FSDP2 average gradients over ranks; each rank's loss sums its rows.
    if contestant == "ddp":
        model = nn.parallel.DistributedDataParallel(base)
        return Built(model, model, float(n), True)
    if contestant == "fsdp2":
        model = _fsdp2(base, mesh)
        return Built(model, model, float(n), True)
    raise ValueError(f"unknown contestant {contestant!r}; choose from {', '.join(CONTESTANTS)}")


# ------------------------------------------------------------ analytic minimum


def analytic_min(spec: Spec, ref: nn.Module, x: torch.Tensor, n: int) -> tuple[float, str]:
    params = sum(p.numel() * p.element_size() for p in ref.parameters())
    if spec.kind == "dp":
        return bytes_per_rank(Kind.ALL_REDUCE, params, n), "one all-reduce of all gradients"
    if spec.kind == "fsdp":
        return (
            bytes_per_rank(Kind.ALL_GATHER, params, n) + bytes_per_rank(Kind.REDUCE_SCATTER, params, n),
            "all-gather every parameter once + reduce-scatter every gradient",
        )
    if spec.name == "mlp":
        # The input takes no gradient and nothing upstream has parameters: backward needs no collective.
        out = x.numel() * x.element_size()
        return (
            bytes_per_rank(Kind.ALL_REDUCE, out, n),
            "1 all-reduce of the output (fwd); bwd needs none: input has no grad",
        )
    if spec.name == "tt":
        # Transformer.parallelize's program: the row-parallel embeddings' all-reduces (tokens
        # [b,s,d], positions [s,d]) and the Megatron blocks' as below, plus the output's
        # all-gather of the logits and the all-reduce of its input gradient.
        b, s = x.shape
        d, vocab, layers = ref.model_args.dim, ref.model_args.vocab_size, len(ref.layers)
        act = b * s * d * 4
        total = (
            (4 * layers + 2) * bytes_per_rank(Kind.ALL_REDUCE, act, n)
            + bytes_per_rank(Kind.ALL_REDUCE, s * d * 4, n)
            + bytes_per_rank(Kind.ALL_GATHER, b * s * vocab * 4, n)
        )
        return total, (
            f"{layers} layers x 2 sub-blocks x (1 fwd + 1 bwd) all-reduce of [b,s,d], the embeddings' "
            "all-reduces, the logits' all-gather and the output's input-gradient all-reduce"
        )
    blocks = len(ref.blocks) if spec.name == "lm" else 1
    act = x.numel() * 4 * (ref.embed.embedding_dim if spec.name == "lm" else 1)
    # Per block: attention and MLP each one all-reduce of [b,s,d] forward and one backward
    # (the norms, and the embedding in the LM, upstream need the input gradient).
    return (
        4 * blocks * bytes_per_rank(Kind.ALL_REDUCE, act, n),
        f"{blocks} block(s) x 2 sub-blocks x (1 fwd + 1 bwd) all-reduce of [b,s,d] (or reduce-scatter + all-gather)",
    )
