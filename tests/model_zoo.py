"""A zoo of models nobody on the team wrote, and the plans the zoo tests shard them with.

Test-only code, importable by the spawned ranks (no pytest here). Every model is
built from a config (no downloads) at tiny sizes so that one single-device
forward + backward takes milliseconds, and every dimension a plan shards divides
by 4 (world sizes 2 and 4 and the (2, 2) mesh): hidden sizes, heads, kv heads,
intermediate sizes, vocabularies, global batch (4 or 8), sequence length (16).

``build(name) -> (model, make_inputs, loss_fn)``:

* ``model``: an ordinary ``nn.Module``; ``model(*inputs)`` returns one tensor.
* ``make_inputs(batch_global)``: a tuple of global input tensors, drawn from
  torch's global RNG (every rank draws the same ones after the same seed).
* ``loss_fn(outputs, inputs)``: a scalar, from the *global* (logical) outputs
  and the global inputs.

Hugging Face models are wrapped in `LogitsOf`, whose ``forward(*tensors)`` calls
the HF model with keyword arguments and returns ``.logits`` only. Why a wrapper
and not the HF model itself:

* ``hca.sharded`` converts each positional tensor argument and each tensor in the
  result; a plain tensor out keeps the ``ModelOutput`` (a dict subclass that
  transformers registers as a pytree node) and its ``None`` fields away from the
  plan's output conversion and from the loss.
* ``hca.sharded`` on an instance swaps its class for a subclass with a wrapped
  ``forward``; doing that to a tiny wrapper rather than to a ``PreTrainedModel``
  keeps HF's class-keyed machinery (``_can_record_outputs``, auto-class lookups)
  out of it.
* the wrapper passes the HF arguments by name, so the same positional order
  (``input_ids, attention_mask, token_type_ids``) holds whatever HF's signature.

Its cost: every HF parameter name starts with ``hf.``. ``use_cache=False`` is set
in the configs (GPT-2 and Llama would otherwise build a ``DynamicCache`` object
in training forwards; it is not returned by `LogitsOf`, but tracing it is wasted
work and a pytree hazard).

Plans per model (``plan_spec(model_name, plan_name, world_size, model)``):

* ``dp``: ``{}`` on a 1-D mesh named "dp", inputs and outputs ``Shard(0)``.
* ``megatron``: a hand Megatron plan on a 1-D mesh "tp", inputs and outputs
  ``Replicate()`` (`MEGATRON`; none for the convnet).
* ``fsdp``: every parameter ``Shard(0)`` where its dim 0 divides by the world
  size, else ``Replicate()``; inputs and outputs ``Shard(0)`` (`fsdp_plan`).
* ``auto``: ``hca.plan(model, example_inputs, mesh)`` at run time (``plan=None``
  here), inputs and outputs ``Shard(0)``: each rank loads its own part of the batch
  and the solver chooses every parameter's storage.
* ``2d``: ``torch_hca.tools.zoo.two_d(MEGATRON[name])`` on a (dp=2, tp=2) mesh at world
  size 4, inputs and outputs ``(Shard(0), Replicate())``.
"""

from __future__ import annotations

import fnmatch
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from torch_hca.tools import zoo

VOCAB = 64
SEQ = 16
BATCH = 8  # global batch of every model (divides by 4, and by 2 on the (2, 2) mesh's dp)

Built = tuple[nn.Module, Callable[[int], tuple], Callable[[torch.Tensor, tuple], torch.Tensor]]


class LogitsOf(nn.Module):
    """``forward(*tensors)``: ``hf(**dict(zip(arg_names, tensors))).logits``."""

    def __init__(self, hf: nn.Module, arg_names: tuple[str, ...]):
        super().__init__()
        self.hf = hf
        self.arg_names = arg_names

    def forward(self, *tensors):
        return self.hf(**dict(zip(self.arg_names, tensors)), return_dict=True).logits


# ----------------------------------------------------------------------------- losses


def lm_loss(logits: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """Next-token cross-entropy (causal LMs: gpt2, llama, test_transformer)."""
    return zoo.lm_loss(logits, inputs[0])


def mlm_loss(logits: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """BERT: cross-entropy of each real (unpadded) position's logits against its own token."""
    ids, mask = inputs[0], inputs[1]
    per_token = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
    keep = mask.flatten().to(per_token.dtype)
    return (per_token * keep).sum() / keep.sum()


def class_loss(logits: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """Image classifiers: cross-entropy against fixed labels (row i -> class i mod classes)."""
    labels = torch.arange(logits.shape[0]) % logits.shape[1]
    return F.cross_entropy(logits, labels)


def square_loss(out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    return (out * out).sum()


# ----------------------------------------------------------------------------- inputs


def token_inputs(batch: int) -> tuple:
    return (torch.randint(0, VOCAB, (batch, SEQ)),)


def bert_inputs(batch: int) -> tuple:
    """input_ids, attention_mask (row i ends in 2 * (i mod 3) padding zeros), token_type_ids."""
    ids = torch.randint(1, VOCAB, (batch, SEQ))
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    for i in range(batch):
        pad = 2 * (i % 3)
        if pad:
            mask[i, SEQ - pad :] = 0
            ids[i, SEQ - pad :] = 0  # pad_token_id
    types = torch.zeros(batch, SEQ, dtype=torch.long)
    types[:, SEQ // 2 :] = 1  # "sentence B" is the second half
    return ids, mask, types


def image_inputs(batch: int) -> tuple:
    return (torch.randn(batch, 3, 8, 8),)


def vector_inputs(batch: int) -> tuple:
    return (torch.randn(batch, 16),)


# ----------------------------------------------------------------------------- models


def gpt2(dropout: float = 0.0) -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,  # defaults (50256) lie outside the tiny vocabulary: HF warns
        attn_implementation="sdpa",
    )
    hf = GPT2LMHeadModel(config)
    assert hf.lm_head.weight is hf.transformer.wte.weight, "GPT-2's LM head should be tied to wte"
    return LogitsOf(hf, ("input_ids",)), token_inputs, lm_loss


def llama(layers: int = 2) -> Built:
    """Grouped-query attention with 8 query heads over 4 kv heads (head_dim 4), RoPE,
    RMSNorm, SwiGLU, untied head. Not 4 heads over 2 kv heads: the kv heads must divide
    by the tensor-parallel degree (4) or a Megatron shard of k_proj/v_proj would cut
    a kv head in half. `layers`: 2 in the zoo (tests/uneven_cases.py compiles 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )
    hf = LlamaForCausalLM(config)
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight
    return LogitsOf(hf, ("input_ids",)), token_inputs, lm_loss


def mixtral(experts_implementation: str | None = "eager") -> Built:
    """Mixture of experts (tests/test_moe.py; not in MODELS, for the suite's time): 4 experts, 2 a
    token, 1 layer, GQA (4 query heads over 2 kv heads). `experts_implementation="eager"`: HF's loop
    over the experts; None: HF's default (grouped) kernel."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation="sdpa",
        **({"experts_implementation": experts_implementation} if experts_implementation else {}),
    )
    return LogitsOf(MixtralForCausalLM(config), ("input_ids",)), token_inputs, lm_loss


def qwen2_moe() -> Built:
    """Qwen2-MoE (tests/test_moe.py): 4 routed experts, 2 a token, beside a gated shared expert; q, k,
    v biases; 1 layer, GQA; HF's default (grouped) experts kernel."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LogitsOf(Qwen2MoeForCausalLM(config), ("input_ids",)), token_inputs, lm_loss


def bert(dropout: float = 0.0) -> Built:
    """BertForMaskedLM: padding mask, token types, post-LN, the MLM head's decoder tied
    to the word embeddings (HF's default), and its bias tied to ``cls.predictions.bias``."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        type_vocab_size=2,
        pad_token_id=0,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    hf = BertForMaskedLM(config)
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight
    return LogitsOf(hf, ("input_ids", "attention_mask", "token_type_ids")), bert_inputs, mlm_loss


def test_transformer() -> Built:
    """torch's own DTensor test model: learned positions, causal SDPA, LayerNorm, GELU MLP,
    output tied to the token embeddings (ModelArgs' default ``weight_tying=True``)."""
    model = zoo.torch_transformer(layers=TT_LAYERS, vocab=VOCAB, seq=SEQ, dim=32, heads=4)
    assert model.output.weight is model.tok_embeddings.weight
    return model, token_inputs, lm_loss


TT_LAYERS = 2


def convnet() -> Built:
    model = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(3, 8, 3, padding=1),
            bn1=nn.BatchNorm2d(8),
            relu1=nn.ReLU(inplace=True),
            conv2=nn.Conv2d(8, 8, 3, padding=1),
            bn2=nn.BatchNorm2d(8),
            relu2=nn.ReLU(inplace=True),
            pool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            fc=nn.Linear(8, 4),
        )
    )
    return model, image_inputs, class_loss


def vit(dropout: float = 0.0) -> Built:
    """transformers' ViTForImageClassification: 8x8 images, 4x4 patches (4 patches + the
    class token = 5 positions, never sharded), 2 pre-LN layers, head on the class token."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=4,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return LogitsOf(ViTForImageClassification(config), ("pixel_values",)), image_inputs, class_loss


class InplaceMLP(nn.Module):
    """Linear, then in-place updates of the activation (mul_, add_, relu inplace), then Linear.

    The in-place ReLU comes last: its backward reads its own output, so a later
    in-place update of ``h`` would fail autograd's version check on one device too."""

    def __init__(self, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.fc1(x)
        h.mul_(0.5)
        h.add_(0.1)
        F.relu(h, inplace=True)
        return self.fc2(h)


def inplace_mlp() -> Built:
    return InplaceMLP(), vector_inputs, square_loss


MODELS: dict[str, Callable[[], Built]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "test_transformer": test_transformer,
    "convnet": convnet,
    "vit": vit,
    "inplace_mlp": inplace_mlp,
}


# The models whose hidden (not attention) dropout `build` can turn on: hca refuses attention
# dropout by name, and places every other dropout as one device draws it (torch_hca.compiler.randomness).
DROPOUT_MODELS = ("gpt2", "bert", "vit")


def build(name: str, dropout: float = 0.0) -> Built:
    """The model `name`, with its hidden dropout at `dropout` (only `DROPOUT_MODELS`)."""
    if dropout:
        return MODELS[name](dropout=dropout)
    return MODELS[name]()


# Parameters whose gradient is zero analytically, so that the single-device reference
# holds only fp32 rounding noise (norms 1e-13..1e-8 against a total of about 1): a
# relative error against noise means nothing, and Adam would turn the noise into
# whole-lr steps. The tests compare these against the model's total gradient (and
# parameter) norm instead (zoo_cases: "grad_abs_errs", "param_abs_errs").
ZERO_GRADIENT: dict[str, tuple[str, ...]] = {
    # Softmax is shift-invariant: q . (k + b) adds the same q . b to every key's score.
    "bert": ("hf.bert.encoder.layer.*.attention.self.key.bias",),
    "vit": ("hf.vit.layers.*.attention.k_proj.bias",),
    # Train-mode BatchNorm subtracts each channel's batch mean: a per-channel bias before it cancels.
    "convnet": ("conv1.bias", "conv2.bias"),
    # GPT-2's key bias is the middle third of the fused c_attn.bias, whose other two
    # thirds have real gradients: the tensor as a whole is compared relatively.
}


def zero_gradient(model_name: str, parameter: str) -> bool:
    return any(fnmatch.fnmatchcase(parameter, p) for p in ZERO_GRADIENT.get(model_name, ()))


# ----------------------------------------------------------------------------- plans

# Hand Megatron plans (1-D mesh "tp", inputs and outputs Replicate()). Column-parallel:
# nn.Linear weight and bias Shard(0) (output features); row-parallel: weight Shard(1),
# bias replicated. Names come from `model.named_parameters()` (listed in the report).
MEGATRON: dict[str, dict | None] = {
    # HF GPT-2 uses Conv1D, weight [in, out]: column-parallel is Shard(1), row-parallel
    # Shard(0). c_attn fuses q, k and v into one [32, 96] weight: its Shard(1) column
    # blocks are not whole heads (at 2 ranks rank 0 holds q and half of k), so GPT-2's
    # split(n_embd) of the fused output needs a redistribution a true Megatron layout
    # (q, k, v interleaved per rank) would not: no plain Shard expresses that layout.
    # Embeddings and the tied LM head stay replicated.
    "gpt2": {
        "hf.transformer.h.*.attn.c_attn.weight": Shard(1),
        "hf.transformer.h.*.attn.c_attn.bias": Shard(0),
        "hf.transformer.h.*.attn.c_proj.weight": Shard(0),
        "hf.transformer.h.*.mlp.c_fc.weight": Shard(1),
        "hf.transformer.h.*.mlp.c_fc.bias": Shard(0),
        "hf.transformer.h.*.mlp.c_proj.weight": Shard(0),
    },
    # 8 query heads, 4 kv heads: each rank holds whole query groups (q_proj rows and
    # the matching k_proj/v_proj rows) at 2 and 4 ranks.
    "llama": {
        "hf.model.layers.*.self_attn.[qkv]_proj.weight": Shard(0),
        "hf.model.layers.*.self_attn.o_proj.weight": Shard(1),
        "hf.model.layers.*.mlp.gate_proj.weight": Shard(0),
        "hf.model.layers.*.mlp.up_proj.weight": Shard(0),
        "hf.model.layers.*.mlp.down_proj.weight": Shard(1),
    },
    "bert": {
        "hf.bert.encoder.layer.*.attention.self.*": Shard(0),  # query, key, value: weight and bias
        "hf.bert.encoder.layer.*.attention.output.dense.weight": Shard(1),
        "hf.bert.encoder.layer.*.intermediate.dense.*": Shard(0),
        "hf.bert.encoder.layer.?.output.dense.weight": Shard(1),  # the MLP's down projection
    },
    "test_transformer": zoo.TP_TEST_TRANSFORMER,  # as Transformer.parallelize(use_seq_parallel=False)
    # No tensor parallelism for a 3-to-8-channel CNN: nothing to split that a user would.
    "convnet": None,
    "vit": {
        "hf.vit.layers.*.attention.[qkv]_proj.*": Shard(0),
        "hf.vit.layers.*.attention.o_proj.weight": Shard(1),
        "hf.vit.layers.*.mlp.fc1.*": Shard(0),
        "hf.vit.layers.*.mlp.fc2.weight": Shard(1),
    },
    "inplace_mlp": zoo.MEGATRON_MLP,
}

PLANS = ("dp", "megatron", "fsdp", "auto", "2d")


def fsdp_plan(model: nn.Module, world_size: int) -> dict:
    """Every parameter Shard(0) where its dim 0 divides by `world_size`, else Replicate()."""
    return {
        name: Shard(0) if p.dim() >= 1 and p.shape[0] % world_size == 0 else Replicate()
        for name, p in model.named_parameters()
    }


@dataclass(frozen=True)
class PlanSpec:
    """What `hca.sharded` takes, plus the mesh. ``plan=None``: `hca.plan` chooses it at run time."""

    plan: dict | None
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    inputs: Any
    outputs: Any


def has_plan(model_name: str, plan_name: str, world_size: int) -> bool:
    if plan_name in ("megatron", "2d") and MEGATRON[model_name] is None:
        return False
    if plan_name == "2d":
        return world_size == 4
    return True


def plan_spec(model_name: str, plan_name: str, world_size: int, model: nn.Module) -> PlanSpec:
    if not has_plan(model_name, plan_name, world_size):
        raise KeyError(f"no {plan_name!r} plan for {model_name!r} at world size {world_size}")
    one_d = lambda name: ((world_size,), (name,))
    if plan_name == "dp":
        return PlanSpec({}, *one_d("dp"), Shard(0), Shard(0))
    if plan_name == "megatron":
        return PlanSpec(MEGATRON[model_name], *one_d("tp"), Replicate(), Replicate())
    if plan_name == "fsdp":
        return PlanSpec(fsdp_plan(model, world_size), *one_d("dp"), Shard(0), Shard(0))
    if plan_name == "auto":
        return PlanSpec(None, *one_d("dp"), Shard(0), Shard(0))
    if plan_name == "2d":
        layout = (Shard(0), Replicate())
        return PlanSpec(zoo.two_d(MEGATRON[model_name]), (2, world_size // 2), ("dp", "tp"), layout, layout)
    raise KeyError(plan_name)


# ----------------------------------------------------------------------------- checks (no ranks)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter object (tied weights), each group sorted."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return sorted(sorted(names) for names in by_id.values() if len(names) > 1)


def plan_problems(model: nn.Module, spec: PlanSpec) -> list[str]:
    """Patterns that match nothing, shards that do not divide, layouts of the wrong length."""
    problems = []
    params = dict(model.named_parameters())
    sizes = spec.mesh_shape
    for pattern, value in (spec.plan or {}).items():
        hits = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            problems.append(f"{pattern!r} matches no parameter")
        layout = (
            value if isinstance(value, tuple) else (value,) * (1 if not isinstance(value, Replicate) else len(sizes))
        )
        if len(layout) != len(sizes):
            problems.append(f"{pattern!r}: {len(layout)} placements for a {len(sizes)}-D mesh")
            continue
        for name in hits:
            shape = params[name].shape
            for dim in range(len(shape)):
                ways = math.prod(sizes[i] for i, p in enumerate(layout) if isinstance(p, Shard) and p.dim == dim)
                if shape[dim] % ways:
                    problems.append(f"{name} {tuple(shape)}: dim {dim} does not divide over {ways} ranks")
            for p in layout:
                if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
                    problems.append(f"{name} {tuple(shape)}: no dim {p.dim}")
    return problems
