"""Work run on every rank by tests/test_eager_calls.py: a sharded module called outside torch.compile.

Plain module, importable by the spawned ranks; no pytest here. An eager call runs the
user's forward over DTensors (docs/huggingface.md, "Evaluate and generate"): DTensor
chooses the collectives, the plain tensors the forward makes are taken as replicated.
"""

from __future__ import annotations

import contextlib
import os
import copy
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_hca as hca

import model_zoo
from dist_cases import full, local_piece, rel_err
from zoo_cases import grad_errors

VOCAB = 64
FUNCOL = (
    "all_reduce",
    "all_gather_single",
    "all_gather_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
)


@contextlib.contextmanager
def collectives_called():
    """The functional collectives DTensor calls while active, by name. (A dispatch mode does not
    see them: DTensor runs them inside its own dispatch, under the mode's handler.)"""
    calls: dict[str, int] = {}

    def counting(name, original):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in FUNCOL:
            stack.enter_context(mock.patch.object(funcol, name, counting(name, getattr(funcol, name))))
        yield calls


def zoo_eager(model_names: list[str], plan_names: list[str]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per zoo model and plan: a training-mode eager forward and backward (output and every
    gradient against one device), then ``eval()`` under ``no_grad`` (output against one device,
    and the collectives it ran)."""
    world_size = dist.get_world_size()
    results = {}
    for name in model_names:
        for plan_name in plan_names:
            if not model_zoo.has_plan(name, plan_name, world_size):
                continue
            torch.manual_seed(0)
            ref, make_inputs, loss_fn = model_zoo.build(name)
            spec = model_zoo.plan_spec(name, plan_name, world_size, ref)
            mesh = hca.init_mesh(spec.mesh_shape, spec.mesh_names)
            model = hca.sharded(spec.plan, mesh=mesh, inputs=spec.inputs, outputs=spec.outputs)(copy.deepcopy(ref))
            xs = make_inputs(model_zoo.BATCH)
            local = tuple(local_piece(x, mesh, spec.inputs) for x in xs)

            out = full(model(*local), mesh, spec.outputs)
            loss_fn(out, xs).backward()
            ref_out = ref(*xs)
            loss_fn(ref_out, xs).backward()
            rel, whole = grad_errors(model, ref)
            result = {
                "train_out_err": rel_err(out.detach(), ref_out.detach()),
                "grad_errs": {n: e for n, e in rel.items() if not model_zoo.zero_gradient(name, n)},
                "zero_grad_abs_errs": {n: whole[n] for n in rel if model_zoo.zero_gradient(name, n)},
            }
            model.eval()
            ref.eval()
            with torch.no_grad(), collectives_called() as calls:
                local_out = model(*local)
            with torch.no_grad():
                result["eval_out_err"] = rel_err(full(local_out, mesh, spec.outputs), ref(*xs))
            result["eval_collectives"] = calls
            results[(name, plan_name)] = result
    return results


# ----------------------------------------------------------------------------- Hugging Face generate


def causal_lm(name: str) -> torch.nn.Module:
    """A small Hugging Face causal LM with its KV cache on (``use_cache``), in eval mode."""
    import transformers as T

    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=1, attn_implementation="sdpa")
    gqa = dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    if name == "gpt2":
        config = T.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common
        )
        return T.GPT2LMHeadModel(config).eval()
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**gqa, **common)).eval()
    if name == "mistral":  # a sliding window shorter than the sequence: an explicit 4-D attention mask
        return T.MistralForCausalLM(T.MistralConfig(**gqa, sliding_window=8, **common)).eval()
    if name == "mixtral":  # mixture of experts: 4 experts, 2 a token, HF's default (grouped) kernel
        config = T.MixtralConfig(**gqa, num_local_experts=4, num_experts_per_tok=2, **common)
        return T.MixtralForCausalLM(config).eval()
    raise KeyError(name)


def _megatron(name: str) -> dict:
    if name == "mixtral":  # Megatron attention, the experts replicated (tests/test_moe.py stores them split)
        return {"model.layers.*.self_attn.[qkv]_proj.*": Shard(0), "model.layers.*.self_attn.o_proj.weight": Shard(1)}
    zoo_name = "gpt2" if name == "gpt2" else "llama"  # Mistral's parameter names are Llama's
    return {pattern.removeprefix("hf."): layout for pattern, layout in model_zoo.MEGATRON[zoo_name].items()}


def hf_generate(model_names: list[str], plan_names: list[str], new_tokens: int = 8) -> dict[tuple[str, str], dict]:
    """Per model and plan ("dp": batch split, parameters replicated; "megatron"): the logits of an
    eval forward, greedy ``generate`` and sampled ``generate`` (same seed) of the sharded model,
    each against one device on the same rows; greedy again through the ``torch.compile`` wrapper."""
    hca.init_mesh()
    rank = dist.get_rank()
    results = {}
    for name in model_names:
        for plan_name in plan_names:
            torch.manual_seed(0)
            ref = causal_lm(name)
            if plan_name == "dp":
                model = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(copy.deepcopy(ref))
            else:
                model = hca.sharded(_megatron(name), inputs=Replicate(), outputs=Replicate())(copy.deepcopy(ref))
            ids = torch.randint(2, VOCAB, (4, 8))
            rows = ids.chunk(dist.get_world_size())[rank] if plan_name == "dp" else ids
            greedy = dict(max_new_tokens=new_tokens, do_sample=False)
            sampled = dict(max_new_tokens=new_tokens, do_sample=True, top_k=0)
            with torch.no_grad():
                result = {"logits_err": rel_err(model(input_ids=rows).logits, ref(input_ids=rows).logits)}
                tokens, ref_tokens = model.generate(rows, **greedy), ref.generate(rows, **greedy)
                result["greedy_same"] = torch.equal(tokens, ref_tokens)
                result["new_tokens"] = tokens.shape[1] - rows.shape[1]
                torch.manual_seed(5)
                tokens = model.generate(rows, **sampled)
                torch.manual_seed(5)
                result["sampled_same"] = torch.equal(tokens, ref.generate(rows, **sampled))
                compiled = torch.compile(model, backend="hca")
                result["compiled_greedy_same"] = torch.equal(compiled.generate(rows, **greedy), ref_tokens)
            results[(name, plan_name)] = result
    return results


def hf_save_and_load(directory: str) -> dict[str, Any]:
    """A Megatron-sharded GPT-2 after one SGD step: ``save_pretrained`` on every rank, then
    ``from_pretrained`` on one device and into a DP-sharded model: logits against the trained one."""
    import transformers as T

    hca.init_mesh()
    torch.manual_seed(0)
    model = hca.sharded(_megatron("gpt2"), inputs=Replicate(), outputs=Replicate())(causal_lm("gpt2"))
    ids = torch.randint(2, VOCAB, (4, 8))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.eval()
    model.save_pretrained(directory)
    files = sorted(os.listdir(directory))
    one_device = T.GPT2LMHeadModel.from_pretrained(directory).eval()
    resharded = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(T.GPT2LMHeadModel.from_pretrained(directory))
    rows = ids.chunk(dist.get_world_size())[dist.get_rank()]
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        return {
            "files": files,
            "one_device_err": rel_err(one_device(input_ids=ids).logits, trained),
            "resharded_err": rel_err(
                resharded.eval()(input_ids=rows).logits, trained.chunk(dist.get_world_size())[dist.get_rank()]
            ),
        }


def eager_dropout(same_seed: bool) -> dict[str, Any]:
    """A data-parallel MLP with dropout called eagerly in training mode, every rank seeded the same
    (or by its rank): its rows against one device's, or the `CheckError` it raised."""
    hca.init_mesh()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 4))
    model = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(copy.deepcopy(ref))
    x = torch.randn(8, 8)
    rank = dist.get_rank()
    torch.manual_seed(5 if same_seed else 5 + rank)
    try:
        got = model(x.chunk(dist.get_world_size())[rank])
    except hca.CheckError as e:
        return {"error": str(e)}
    torch.manual_seed(5)
    return {"err": rel_err(got, ref(x).chunk(dist.get_world_size())[rank])}


# Ops DTensor has no sharding rule for (tests/test_eager_calls.py): one out of place, one in place.
@torch.library.custom_op("hca_tests::plus_one", mutates_args=())
def plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@plus_one.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("hca_tests::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@cube.register_fake
def _(x):
    return torch.empty_like(x)


def _cube_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 3 * x * x


cube.register_autograd(_cube_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


@torch.library.custom_op("hca_tests::add_one_", mutates_args=("x",))
def add_one_(x: torch.Tensor) -> None:
    x.add_(1)


class NoRule(torch.nn.Module):
    """A linear layer, then ops DTensor has no rule for: a custom op and `nonzero` (its result's
    shape depends on the data), or the custom op writing in place."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.lin, self.in_place = torch.nn.Linear(8, 8), in_place

    def forward(self, x):
        h = self.lin(x)
        if self.in_place:
            add_one_(h)
            return h
        return plus_one(h) * (h > 0).nonzero().shape[0]


def eager_no_rule(in_place: bool) -> dict[str, Any]:
    """`NoRule` called eagerly under data parallelism (batch split): its rows and the collectives
    DTensor ran against one device, or the `UnsupportedError` it raised."""
    hca.init_mesh()
    torch.manual_seed(0)
    ref = NoRule(in_place)
    model = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(copy.deepcopy(ref))
    x = torch.randn(8, 8)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with torch.no_grad(), collectives_called() as calls:
            got = model(x.chunk(world)[rank])
    except hca.UnsupportedError as e:
        return {"error": str(e)}
    with torch.no_grad():
        want = ref(x).chunk(world)[rank]
    return {"err": rel_err(got, want), "calls": dict(calls)}


class NoRuleToTrain(torch.nn.Module):
    """Two linear layers around a differentiable custom op DTensor has no rule for (`cube`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(cube(self.a(x)))


def eager_no_rule_training() -> dict[str, Any]:
    """`NoRuleToTrain` trained eagerly (outside torch.compile) under data parallelism, batch split:
    the op DTensor has no rule for runs whole on every rank (`rewrites`' fallback), so its gathered
    input's cotangent comes back to each rank's rows. Output and every gradient against one device on
    the whole batch (loss: the sum of the ranks' sums), and the collectives forward and backward ran."""
    hca.init_mesh()
    torch.manual_seed(0)
    ref = NoRuleToTrain()
    model = hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(copy.deepcopy(ref))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(4 * world, 8)
    with collectives_called() as forward:
        out = model(x.chunk(world)[rank])
    with collectives_called() as backward:
        out.sum().backward()
    want = ref(x)
    want.sum().backward()
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    grads = {n: whole(p.grad) for n, p in model.named_parameters()}
    return {
        "out_err": rel_err(out.to_local() if isinstance(out, DTensor) else out, want.chunk(world)[rank]),
        "out_type": type(out).__name__,
        "grad_placements": sorted({str(p.grad.placements) for p in model.parameters() if isinstance(p.grad, DTensor)}),
        "grad_err": max(rel_err(grads[n], q.grad) for n, q in ref.named_parameters()),
        "forward": dict(forward),
        "backward": dict(backward),
    }
