"""Work run on every rank by tests/test_moe.py: HF Mixtral and Qwen2-MoE (mixture of experts) compiled by hca
against one device. Plain module, importable by the spawned ranks; no pytest here."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import torch_hca as hca

import model_zoo
from dist_cases import full, rel_err

# Expert storage: each expert weight tensor ([experts, ...]) cut by experts over the ranks.
EXPERTS = {"hf.model.layers.*.mlp.experts.*": Shard(0)}
# Megatron attention: q, k, v (weights and biases) by heads, o by its input features.
ATTENTION = {
    "hf.model.layers.*.self_attn.[qkv]_proj.*": Shard(0),
    "hf.model.layers.*.self_attn.o_proj.weight": Shard(1),
}
# FSDP-style: attention, the routed experts and the shared expert stored split by their first dim
# (the router and the shared expert's 1-row gate stay replicated: a 1-row weight does not split).
FSDP = {"hf.model.layers.*.self_attn.*": Shard(0), **EXPERTS, "hf.model.layers.*.mlp.shared_expert.*": Shard(0)}
PLANS = {"dp": {}, "experts": EXPERTS, "attention": ATTENTION, "fsdp": FSDP}
BUILDERS = {
    "mixtral": model_zoo.mixtral,
    "mixtral_grouped": lambda: model_zoo.mixtral(experts_implementation=None),
    "qwen2_moe": model_zoo.qwen2_moe,
}


def mixtral_parity(plans: list[str], steps: int = 2, family: str = "mixtral") -> dict:
    """Per plan of `PLANS` (the batch split under each): outputs, every gradient and the parameters
    after `steps` SGD steps against one device, and the collectives of the compiled graphs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for plan in plans:
        torch._dynamo.reset()
        mesh = hca.init_mesh()
        torch.manual_seed(0)
        ref, _, _ = BUILDERS[family]()
        # Mixtral has no shared expert: its FSDP-style plan is the rest of FSDP's.
        layout = {k: v for k, v in PLANS[plan].items() if family == "qwen2_moe" or "shared_expert" not in k}
        model = hca.sharded(layout, mesh=mesh, inputs=Shard(0), outputs=Shard(0))(copy.deepcopy(ref))
        compiled = torch.compile(model, backend="hca")
        torch._dynamo.utils.counters.clear()
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        out_err, grad_errs = 0.0, {}
        for step in range(steps):
            torch.manual_seed(100 + step)  # one global batch, the same on every rank
            (ids,) = model_zoo.token_inputs(2 * world)
            local = ids.chunk(world)[rank]
            out = full(compiled(local), mesh, Shard(0))  # the whole batch's logits: one device's loss
            model_zoo.lm_loss(out, (ids,)).backward()
            ref_out = ref(ids)
            model_zoo.lm_loss(ref_out, (ids,)).backward()
            out_err = max(out_err, rel_err(out.detach(), ref_out.detach()))
            for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grad_errs[name] = max(grad_errs.get(name, 0.0), rel_err(g, q.grad))
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        rep = hca.report(compiled)
        results[plan] = {
            "out_err": out_err,
            "grad_errs": grad_errs,
            "param_errs": {
                n: rel_err(p.full_tensor().detach(), q.detach())
                for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
            },
            "experts": {n: str(p.placements) for n, p in model.named_parameters() if ".experts." in n},
            "forward": rep.collective_counts("forward"),
            "backward": rep.collective_counts("backward"),
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "break_reasons": sorted(
                {str(k).splitlines()[0][:160] for k in torch._dynamo.utils.counters["graph_break"]}
            ),
            "graphs": len(rep.graphs),
        }
    return results
