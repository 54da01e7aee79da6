"""Work run on every rank of a `LocalWorld` by the distributed tests.

Each function builds the same model twice from one seed: a single-device
reference and a sharded copy compiled with backend "hca", runs both on the
same global data, and returns what the tests assert on (errors relative to the
reference, the collectives the report lists). Plain module, importable by the
spawned ranks; no pytest here.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import torch_hca as hca
from torch_hca.tools import zoo
from torch_hca.spmd.collective_nodes import CollectiveCounter


@contextlib.contextmanager
def fake_world(world_size: int = 4):
    """A fake process group of `world_size` ranks and its 1-D mesh (yielded), for graph-only checks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch_hca.runtime.mesh import reset_current_mesh

    torch._dynamo.reset()
    reset_current_mesh()  # also clears DTensor's sharding cache (see _torch_private)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield hca.init_mesh()
    finally:
        dist.destroy_process_group()
        reset_current_mesh()
        torch._dynamo.reset()


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    plan: dict
    mesh: Callable[[int], tuple]  # world size -> (shape, names)
    inputs: Any
    outputs: Any
    x_shape: tuple[int, ...]
    grad_reduction: str = "eager"
    options: dict | None = None  # backend options the case compiles with


class NormMLP(nn.Module):
    """x + mlp(norm(x)): the region sequence parallelism shards."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = zoo.MLP(dim, hidden)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


ONE_D = lambda ws: ((ws,), ("tp",))
TWO_D = lambda ws: ((ws // 2, 2), ("dp", "tp"))

CASES = {
    # Weights much larger than a microbatch's activations, as in real tensor parallelism:
    # the layout solver's optimum is then Megatron (with tiny weights it gathers them).
    "mlp": Case(lambda: zoo.MLP(64, 256), zoo.MEGATRON_MLP, ONE_D, Replicate(), Replicate(), (8, 64)),
    "dp": Case(lambda: zoo.DeepMLP(16, 4), {}, lambda ws: ((ws,), ("dp",)), Shard(0), Shard(0), (8, 16)),
    # 12 layers, 24 parameter tensors: the data-parallel bucketing case (tests/test_schedule_pass.py).
    "dp12": Case(lambda: zoo.DeepMLP(16, 12), {}, lambda ws: ((ws,), ("dp",)), Shard(0), Shard(0), (8, 16)),
    "dp_deferred": Case(
        lambda: zoo.DeepMLP(16, 4), {}, lambda ws: ((ws,), ("dp",)), Shard(0), Shard(0), (8, 16), "deferred"
    ),
    "2d": Case(
        lambda: zoo.MLP(64, 256),
        zoo.two_d(zoo.MEGATRON_MLP),
        TWO_D,
        (Shard(0), Replicate()),
        (Shard(0), Replicate()),
        (8, 64),
    ),
    "block": Case(
        lambda: zoo.TransformerBlock(128, 4, 512), zoo.TP_BLOCK, ONE_D, Replicate(), Replicate(), (2, 6, 128)
    ),
    # Storage only; the layout solver picks the pattern (tests/test_layout_solver.py shows it).
    # FSDP: weights stored Shard(0), more batch rows than weights: gather the weights.
    "fsdp": Case(
        lambda: zoo.DeepMLP(16, 4), {"*": Shard(0)}, lambda ws: ((ws,), ("dp",)), Shard(0), Shard(0), (64, 16)
    ),
    # Sequence parallel: Megatron storage, activation memory costed.
    "sp": Case(
        lambda: nn.Sequential(NormMLP(128, 512), NormMLP(128, 512)),
        {"*.mlp.fc1.*": Shard(0), "*.mlp.fc2.weight": Shard(1)},
        ONE_D,
        Replicate(),
        Replicate(),
        (2, 16, 128),
        options={"memory_weight": 1e-7},
    ),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def full(t: torch.Tensor, mesh, layout) -> torch.Tensor:
    """The global tensor a rank's local output piece belongs to."""
    layout = (layout,) if not isinstance(layout, tuple) else layout
    return DTensor.from_local(t, mesh, layout, run_check=False).full_tensor()


def local_piece(x: torch.Tensor, mesh, layout) -> torch.Tensor:
    layout = (layout,) if not isinstance(layout, tuple) else layout
    return distribute_tensor(x, mesh, layout).to_local()


def loss_of(out: torch.Tensor) -> torch.Tensor:
    # Non-linear in the output so every gradient is non-trivial. With sharded
    # outputs each rank sums its own piece: the ranks' losses add up to the global one.
    return (out * out).sum()


def setup(case: Case, options: dict | None = None, seed: int = 0, dynamic: bool | None = None):
    torch._dynamo.reset()
    shape, names = case.mesh(dist.get_world_size())
    mesh = hca.init_mesh(shape, names)
    torch.manual_seed(seed)
    ref = case.make()
    model = hca.sharded(
        case.plan,
        mesh=mesh,
        inputs=case.inputs,
        outputs=case.outputs,
        grad_reduction=case.grad_reduction,
    )(copy.deepcopy(ref))
    # Strict in tests: an implicit redistribution or an unexplained backward collective fails.
    options = {"strict": True, "check": True, **(case.options or {}), **(options or {})}
    compiled = torch.compile(model, backend="hca", options=options, dynamic=dynamic)
    return mesh, ref, model, compiled


def grad_errors(model: nn.Module, ref: nn.Module) -> dict[str, float]:
    refs = dict(ref.named_parameters())
    return {n: rel_err(p.grad.full_tensor(), refs[n].grad) for n, p in model.named_parameters()}


def parity(case_name: str, steps: int = 3, options: dict | None = None) -> dict[str, Any]:
    """Outputs, gradients and `steps` Adam steps against a single-device run."""
    case = CASES[case_name]
    mesh, ref, model, compiled = setup(case, options)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    result: dict[str, Any] = {}
    for step in range(steps):
        x = torch.randn(case.x_shape)
        out = compiled(local_piece(x, mesh, case.inputs))
        ref_out = ref(x)
        loss_of(out).backward()
        loss_of(ref_out).backward()
        if step == 0:
            result["out_err"] = rel_err(full(out, mesh, case.outputs), ref_out)
            result["grad_errs"] = grad_errors(model, ref)
            result["grad_placements"] = {n: str(p.grad.placements) for n, p in model.named_parameters()}
            result["partial_gradients"] = [g["parameter"] for g in hca.report(compiled).partial_gradients()]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    refs = dict(ref.named_parameters())
    result["param_errs"] = {n: rel_err(p.full_tensor(), refs[n]) for n, p in model.named_parameters()}
    rep = hca.report(compiled)
    result["forward"] = rep.collective_counts("forward")
    result["backward"] = rep.collective_counts("backward")
    result["bytes"] = {d: sum(c.bytes for c in rep.collectives if c.direction == d) for d in ("forward", "backward")}
    result["buckets"] = {  # (collectives merged, bytes) per bucket the schedule pass made
        d: [(len(b["members"]), b["bytes"]) for g in rep.graphs for b in g.schedules.get(d, {}).get("buckets", [])]
        for d in ("forward", "backward")
    }
    result["implicit"] = [m for g in rep.graphs for m in g.implicit_redistributions]
    result["graphs"] = len(rep.graphs)
    result["strategy_json"] = rep.to_json()
    return result


class TwoStage(nn.Module):
    """Two MLPs with a graph break between them; returns two tensors."""

    def __init__(self):
        super().__init__()
        self.a = zoo.MLP()
        self.b = zoo.MLP()

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y), y * 2


TWO_STAGE_PLAN = {"a.fc1.*": Shard(0), "a.fc2.weight": Shard(1), "b.fc1.*": Shard(0), "b.fc2.weight": Shard(1)}


def graph_break_two_outputs(options: dict | None = None) -> dict[str, Any]:
    case = Case(TwoStage, TWO_STAGE_PLAN, ONE_D, Replicate(), Replicate(), (8, 16))
    _, ref, model, compiled = setup(case, options)
    torch._dynamo.utils.counters.clear()
    x = torch.randn(8, 16)
    out, twice = compiled(x)
    ref_out, ref_twice = ref(x)
    (loss_of(out) + loss_of(twice)).backward()
    (loss_of(ref_out) + loss_of(ref_twice)).backward()
    rep = hca.report(compiled)
    return {
        "out_err": max(rel_err(out, ref_out), rel_err(twice, ref_twice)),
        "grad_err": max(grad_errors(model, ref).values()),
        "graphs": len(rep.graphs),
        "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        "forward": rep.collective_counts("forward"),
        "tuning": [g.tuning for g in rep.graphs],
    }


def inference_and_batch_sizes(case_name: str, dynamic: bool | None) -> dict[str, Any]:
    """no_grad inference, then training at two batch sizes."""
    case = CASES[case_name]
    mesh, ref, model, compiled = setup(case, dynamic=dynamic)
    result: dict[str, Any] = {}
    x = torch.randn(2, *case.x_shape[1:])
    with torch.no_grad():
        out = compiled(x)
    result["inference_err"] = rel_err(out, ref(x))
    result["inference_graph"] = hca.report(compiled).graph.inference
    result["inference_requires_grad"] = out.requires_grad
    for batch in (2, 3):
        x = torch.randn(batch, *case.x_shape[1:])
        model.zero_grad()
        ref.zero_grad()
        out = compiled(x)
        loss_of(out).backward()
        loss_of(ref(x)).backward()
        result[f"out_err_{batch}"] = rel_err(out, ref(x))
        result[f"grad_err_{batch}"] = max(grad_errors(model, ref).values())
    result["graphs"] = len(hca.report(compiled).graphs)
    return result


def rows_as_views(case_name: str) -> dict[str, Any]:
    """Each rank passes its rows of the global batch as a view (``x.chunk(n)[rank]``, at a
    storage offset on every rank but rank 0), then a smaller last batch: Dynamo recompiles with
    a dynamic batch size and passes the offset as a graph input on those ranks alone."""
    case = CASES[case_name]
    _, ref, model, compiled = setup(case)
    n, rank = dist.get_world_size(), dist.get_rank()
    result: dict[str, Any] = {"graphs": []}
    for batch in (4 * n, 3 * n):
        x = torch.randn(batch, *case.x_shape[1:])  # the same on every rank: the seed is
        model.zero_grad()
        ref.zero_grad()
        out = compiled(x.chunk(n)[rank])
        loss_of(out).backward()
        loss_of(ref(x)).backward()
        result[f"out_err_{batch // n}"] = rel_err(out, ref(x).chunk(n)[rank])
        result[f"grad_err_{batch // n}"] = max(grad_errors(model, ref).values())
        g = hca.report(compiled).graph
        result["graphs"].append(
            {"index": g.index, "collectives": sorted((c.direction, c.kind, str(c.bytes)) for c in g.collectives)}
        )
    result["table"] = hca.report(compiled).table()  # symbolic byte counts in the dynamic graph's rows
    return result


def trainer_habits(case_name: str, max_norm: float = 0.5) -> dict[str, Any]:
    """A step as trainers write one: ``clip_grad_norm_`` over the DTensor gradients (of mixed
    placements under Megatron storage), then a forward under bf16 autocast; each against
    one device doing the same."""
    case = CASES[case_name]
    mesh, ref, model, compiled = setup(case)
    x = torch.randn(case.x_shape)
    loss_of(compiled(local_piece(x, mesh, case.inputs))).backward()
    loss_of(ref(x)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    result: dict[str, Any] = {
        "norm": ref_norm.item(),
        "norm_err": rel_err(norm, ref_norm),
        "clipped_grad_err": max(grad_errors(model, ref).values()),
    }
    model.zero_grad()
    ref.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(local_piece(x, mesh, case.inputs))
        ref_out = ref(x)
    loss_of(out.float()).backward()
    loss_of(ref_out.float()).backward()
    result.update(
        bf16_dtype=str(out.dtype),
        bf16_out_err=rel_err(full(out.float(), mesh, case.outputs), ref_out.float()),
        bf16_grad_err=max(grad_errors(model, ref).values()),
    )
    return result


def inner(name: str) -> dict[str, Any]:
    """One training step of the transformer block under options={"inner": name}."""
    case = CASES["mlp" if name == "inductor" else "block"]
    _, ref, model, compiled = setup(case, {"inner": name})
    x = torch.randn(case.x_shape)
    out = compiled(x)
    loss_of(out).backward()
    loss_of(ref(x)).backward()
    rep = hca.report(compiled)
    return {
        "out_err": rel_err(out, ref(x)),
        "grad_err": max(grad_errors(model, ref).values()),
        "has_c10d_graphs": rep.forward is not None,
        "dtensor_code": rep.dtensor_code,
    }


def accumulate(role: str, microbatches: int = 4) -> dict[str, Any]:
    """Gradient accumulation over `microbatches` under one gradient role, collectives counted."""
    case = dataclasses.replace(CASES["dp"], grad_reduction=role)
    mesh, ref, model, compiled = setup(case)
    xs = [torch.randn(case.x_shape) for _ in range(microbatches)]
    for x in xs:
        loss_of(compiled(local_piece(x, mesh, case.inputs))).backward()
    # Every run of the backward graph issues all of its collectives (no branches).
    per_backward = hca.report(compiled).collective_counts("backward")
    in_backward = {kind: n * microbatches for kind, n in per_backward.items()}
    before = sorted({str(p.grad.placements) for p in model.parameters()})
    with CollectiveCounter() as counter:  # eager code: the dispatcher sees every collective
        buckets = hca.reduce_gradients(model)
    for x in xs:
        loss_of(ref(x)).backward()
    return {
        "in_backward": in_backward,
        "in_reduce_gradients": counter.counts,
        "placements_before_reduce": before,
        "buckets": [(len(b.parameters), b.bytes) for b in buckets],
        "grad_err": max(grad_errors(model, ref).values()),
        "placements": sorted({str(p.grad.placements) for p in model.parameters()}),
        "parameters": sum(1 for _ in model.parameters()),
    }


class PerRankRows(nn.Module):
    """Megatron-style code written per rank: a partial product, summed, then this rank's rows."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x):
        partial = x @ self.w  # each rank's summand of the product
        # I, not R: each rank goes on to use the sum differently (its own rows).
        full = hca.collectives.all_reduce(partial, src="P", dst="I")
        return full.chunk(dist.get_world_size())[dist.get_rank()]


def per_rank_step(make: Callable[[], nn.Module], rows: int, options: dict, reference: Callable) -> dict[str, Any]:
    """One compiled step of per-rank code against one device; rank r's input is xs[r].

    ``reference(ref, xs)`` is what rank r's output should be on one device. Each
    parameter is replicated and every rank sees the whole loss, so the ranks'
    gradients are summands of the single-device gradient.
    """
    torch._dynamo.reset()
    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    xs = [torch.randn(rows, 16) for _ in range(n)]
    compiled = torch.compile(model, backend="hca", options=options)
    out = compiled(xs[rank])
    loss_of(out).backward()
    expected, full = reference(ref, xs)
    loss_of(full).backward()
    refs = dict(ref.named_parameters())
    grad_err = 0.0
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grad_err = max(grad_err, rel_err(g, refs[name].grad))
    rep = hca.report(compiled)
    return {
        "out_err": rel_err(out, expected),
        "grad_err": grad_err,
        "forward": rep.collective_counts("forward"),
        "backward": rep.collective_counts("backward"),
        "rules": [c.rule for c in rep.collectives if c.direction == "forward"],
    }


def rewritten_per_rank_code() -> dict[str, Any]:
    """all_reduce then this rank's chunk, compiled: the rewrite pass makes it one reduce_scatter."""
    n, rank = dist.get_world_size(), dist.get_rank()

    def reference(ref, xs):
        full = sum(x @ ref.w for x in xs)
        return full.chunk(n)[rank], full

    return per_rank_step(PerRankRows, 4 * n, {"strict": True, "rank_rewrites": True}, reference)


class TwoPartials(nn.Module):
    """Per-rank code that all-reduces two partial products and adds them."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = nn.Parameter(torch.randn(dim, dim))
        self.b = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x):
        ya = hca.collectives.all_reduce(x @ self.a, src="P", dst="R")
        yb = hca.collectives.all_reduce(x @ self.b, src="P", dst="R")
        return ya + yb


def rewritten_sum_of_all_reduces() -> dict[str, Any]:
    """all_reduce(a) + all_reduce(b) compiled with default options: one all_reduce of the sum."""

    def reference(ref, xs):
        full = sum(x @ ref.a for x in xs) + sum(x @ ref.b for x in xs)
        return full, full  # dst R: every rank holds the whole output and loss

    return per_rank_step(TwoPartials, 8, {"strict": True}, reference)


def divergent_batch_sizes() -> dict[str, Any]:
    """Ranks pass different local batch sizes to per-rank code with an all_reduce: caught before it runs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoPartials()
    compiled = torch.compile(model, backend="hca")
    x = torch.randn(8 if dist.get_rank() == 0 else 6, 16)
    compiled(x)
    return {}


def calibrated() -> dict[str, Any]:
    """hca.calibrate() on this rank, and whether the backend accepts its figures."""
    from torch_hca.compiler.options import Options

    hca.init_mesh()
    figures = hca.calibrate(repeats=3)
    Options.parse({"cost_model": figures})  # raises if a figure is not acceptable
    return figures


class OneConv(nn.Module):
    """A single replicated Conv2d: DTensor's rule for it accepts a partial weight and bias."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


def conv_data_parallel(trust_dtensor_conv_rule: bool, bf16: bool = False) -> dict[str, Any]:
    """A data-parallel conv against one device; optionally trusting DTensor's conv rule with
    Partial inputs (the solver then reads the weight and bias as summands and each rank
    computes conv(x, W/n) + b/n), to show the refinement check stops that program; `bf16`:
    both under bf16 autocast, where the check's tolerance is bf16's."""
    from torch_hca.compiler.layout import candidates as layout_candidates
    from torch_hca.errors import CheckError

    if trust_dtensor_conv_rule:
        layout_candidates.PARTIAL_OK.add("conv2d")
        layout_candidates.BATCH_SPLIT_ONLY.discard("conv2d")
    try:
        case = Case(OneConv, {}, lambda ws: ((ws,), ("dp",)), Shard(0), Shard(0), (4, 3, 8, 8))
        mesh, ref, model, compiled = setup(case)
        x = torch.randn(case.x_shape)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            try:
                out = compiled(local_piece(x, mesh, case.inputs))
            except CheckError as e:
                return {"check_error": str(e)}
            want = ref(x)
        reads = [list(row.reads) for g in hca.report(compiled).graphs for row in g.layout.values if row.reads]
        return {
            "out_err": rel_err(full(out.float(), mesh, case.outputs), want.float()),
            "reads": reads,
            "dtype": str(out.dtype),
        }
    finally:
        layout_candidates.PARTIAL_OK.discard("conv2d")
        layout_candidates.BATCH_SPLIT_ONLY.add("conv2d")


class TpAllReduce(nn.Module):
    """Per-rank code that all-reduces over the mesh's tp dimension only."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x):
        return hca.collectives.all_reduce(x @ self.a, src="P", dst="R", mesh_dim="tp")


def divergent_in_one_tp_group() -> dict[str, Any]:
    """On a (2, 2) mesh rank 0 passes 8 rows and rank 1 (its tp peer) 6; ranks 2 and 3 agree.

    Every rank must raise, not only the two in the disagreeing group."""
    torch._dynamo.reset()
    hca.init_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    compiled = torch.compile(TpAllReduce(), backend="hca")
    try:
        compiled(torch.randn(6 if dist.get_rank() == 1 else 8, 16))
    except hca.CheckError as e:
        return {"raised": True, "message": str(e)}
    return {"raised": False, "message": None}


def second_mesh_of_one_shape() -> list[bool]:
    """Two (2, 2) meshes made one after the other: is each one's matmul result on its own mesh?
    They compare equal (same shape and names) but own different process groups, and DTensor
    caches its sharding decisions under such equal specs."""
    out = []
    for _ in range(2):
        mesh = hca.init_mesh((2, 2), ("dp", "tp"))
        x = distribute_tensor(torch.ones(4, 4), mesh, (Shard(0), Replicate()))
        w = distribute_tensor(torch.ones(4, 4), mesh, (Replicate(), Shard(1)))
        out.append((x @ w).device_mesh is mesh)
    return out


def ddp_bucket_and_parameter_bytes() -> tuple[int, int]:
    """(`_torch_private.ddp_bucket_bytes` of a DDP module after one step, its parameters' bytes)."""
    from torch_hca._torch_private import ddp_bucket_bytes

    model = nn.parallel.DistributedDataParallel(zoo.DeepMLP(16, 3))
    model(torch.randn(2, 16)).sum().backward()
    return ddp_bucket_bytes(model), sum(p.numel() * p.element_size() for p in model.parameters())


def strategy_of_fsdp_block() -> dict:
    """`zoo.TransformerBlock` with every weight stored by rows (FSDP-style) and the batch split,
    compiled on real ranks (schedule on), one forward and backward, and its strategy file's content:
    with every rank's posted collective order in it (gathers and reductions of several sizes)."""
    import tempfile

    hca.init_mesh()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = hca.sharded({"*.weight": Shard(0)}, inputs=Shard(0), outputs=Shard(0))(zoo.TransformerBlock(64, 4, 128))
    c = torch.compile(model, backend="hca", options={"strict": True}, dynamic=False)
    c(torch.randn(4, 6, 64)).sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        return hca.report(c).save_strategy(f"{tmp}/s.json")
