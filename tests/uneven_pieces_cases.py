"""Work run on every rank by tests/test_uneven_pieces.py: GPT-2 (tiny, 1,025-token vocabulary) on
Megatron storage with its tied table cut by rows that do not divide (torch.chunk's pieces: 513 : 512
at 2 ranks, 257 : 256 : 256 : 256 at 4), the loss in the module, against one device.
Plain module, importable by the spawned ranks; no pytest here."""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import torch_hca as hca
from torch_hca.tools.real_models import MEGATRON, LossOf

VOCAB = 1025
PLAN = {**MEGATRON["gpt2_small"], "hf.transformer.wte.weight": Shard(0)}


def gpt2(vocab: int = VOCAB) -> LossOf:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=64, n_head=4, n_layer=2, vocab_size=vocab, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LossOf(GPT2LMHeadModel(config))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.full_tensor() if isinstance(a, DTensor) else a
    return ((a.detach().double() - b.detach().double()).norm() / max(b.detach().double().norm().item(), 1e-30)).item()


def _errs(model, ref, what: str) -> dict[str, float]:
    pairs = zip(model.named_parameters(), ref.named_parameters())
    return {n: _rel(p.grad if what == "grad" else p, q.grad if what == "grad" else q) for (n, p), (_, q) in pairs}


def _two_sgd_steps(model, ref, loss, ref_loss) -> dict:
    """2 SGD steps of `model` (its loss `loss()`) beside `ref` (`ref_loss()`): each step's loss error,
    the first step's gradient errors, the parameters' errors after both."""
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    out: dict = {"loss_errs": []}
    for step in range(2):
        value, ref_value = loss(), ref_loss()
        value.backward()
        ref_value.backward()
        out["loss_errs"].append(abs(value.item() - ref_value.item()) / abs(ref_value.item()))
        if step == 0:
            out["grad_errs"] = _errs(model, ref, "grad")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out["param_errs"] = _errs(model, ref, "param")
    return out


def train_two_steps() -> dict:
    """Loss, gradients and parameters after 2 SGD steps against one device; the collectives; the
    table's piece on this rank; a save and load of the uneven table (hca.save / hca.load)."""
    torch._dynamo.reset()
    hca.init_mesh()
    ref = gpt2()
    model = hca.sharded(PLAN, inputs=Replicate(), outputs=Replicate())(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca", options={"check": True, "strict": True}, dynamic=False)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    out = _two_sgd_steps(model, ref, lambda: compiled(ids), lambda: ref(ids))
    table = dict(model.named_parameters())["hf.transformer.wte.weight"]
    out["table_piece"] = tuple(table.to_local().shape)
    report = hca.report(compiled)
    out["collectives"] = [(c.direction, c.kind, c.bytes) for c in report.collectives]
    out["line"] = report.parallelism()
    out["saved_err"] = _saved_and_loaded(model, ref)
    return out


def _saved_and_loaded(model, ref) -> float:
    """Save the trained model, load it into a fresh one of the same storage: the worst parameter error."""
    root = [tempfile.mkdtemp(prefix="hca-uneven-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    hca.save(model, None, os.path.join(root[0], "ckpt"))
    fresh = hca.sharded(PLAN, inputs=Replicate(), outputs=Replicate())(gpt2())
    hca.load(fresh, None, os.path.join(root[0], "ckpt"))
    return max(_errs(fresh, ref, "param").values())


def logits_returned() -> dict:
    """The logits returned replicated, the loss taken outside: the head's uneven pieces gathered
    (DTensor's padded all_gather). Logits and gradients against one device; the collectives."""
    from torch_hca.tools.real_models import LogitsOf

    torch._dynamo.reset()
    hca.init_mesh()
    ref = LogitsOf(gpt2().hf)
    model = hca.sharded(PLAN, inputs=Replicate(), outputs=Replicate())(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca", options={"check": True, "strict": True}, dynamic=False)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    logits, ref_logits = compiled(ids), ref(ids)
    logits.pow(2).mean().backward()
    ref_logits.pow(2).mean().backward()
    report = hca.report(compiled)
    return {
        "logits_err": _rel(logits, ref_logits),
        "grad_errs": _errs(model, ref, "grad"),
        "collectives": [(c.direction, c.kind, c.bytes) for c in report.collectives],
    }


def megatron_mlp(hidden: int) -> dict:
    """`zoo.MLP(16, hidden)` on Megatron storage (fc1 by rows, fc2 by columns) where `hidden` does not
    divide by the ranks: each rank's hidden units are torch.chunk's piece. 2 SGD steps against one
    device; the collectives; the hidden pieces."""
    from torch_hca.tools import zoo

    torch._dynamo.reset()
    hca.init_mesh()
    torch.manual_seed(0)
    ref = zoo.MLP(16, hidden)
    model = hca.sharded(zoo.MEGATRON_MLP)(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca", options={"check": True, "strict": True}, dynamic=False)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    out: dict = {}
    for step in range(2):
        y, ref_y = compiled(x), ref(x)
        y.pow(2).sum().backward()
        ref_y.pow(2).sum().backward()
        if step == 0:
            out["out_err"], out["grad_errs"] = _rel(y, ref_y), _errs(model, ref, "grad")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out["param_errs"] = _errs(model, ref, "param")
    out["hidden_piece"] = model.fc1.weight.to_local().shape[0]
    out["collectives"] = [(c.direction, c.kind, c.bytes) for c in hca.report(compiled).collectives]
    return out


def zoo_llama_odd_vocabulary(vocab: int = 65) -> dict:
    """The zoo's Llama (GQA, RMSNorm, SwiGLU, untied head) with a `vocab`-token vocabulary on
    Megatron storage plus its embedding and head cut by rows (torch.chunk's pieces), the logits
    returned (gathered padded) and the loss outside: 2 SGD steps against one device."""
    import model_zoo

    torch._dynamo.reset()
    hca.init_mesh()
    saved, model_zoo.VOCAB = model_zoo.VOCAB, vocab
    try:
        torch.manual_seed(0)
        ref, make_inputs, loss_of = model_zoo.llama()
        inputs = make_inputs(4)
    finally:
        model_zoo.VOCAB = saved
    plan = {**model_zoo.MEGATRON["llama"], "hf.model.embed_tokens.weight": Shard(0), "hf.lm_head.weight": Shard(0)}
    model = hca.sharded(plan, inputs=Replicate(), outputs=Replicate())(copy.deepcopy(ref))
    compiled = torch.compile(model, backend="hca", options={"check": True, "strict": True}, dynamic=False)
    out = _two_sgd_steps(model, ref, lambda: loss_of(compiled(*inputs), inputs), lambda: loss_of(ref(*inputs), inputs))
    out["pieces"] = tuple(dict(model.named_parameters())["hf.lm_head.weight"].to_local().shape)
    out["collectives"] = [(c.direction, c.kind, c.bytes) for c in hca.report(compiled).collectives]
    return out
