"""Rank functions for tests/test_agreement.py: ranks that disagree on what SPMD says they share.

Each case returns what it saw instead of raising, so the world of ranks
survives for the next case; every rank must see the same thing (all raise or
none), else the ones that did not would wait in a collective.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import torch_hca as hca


class Net(nn.Module):
    """Two linears, a buffer, a Python scalar and a flag a rank may flip."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.register_buffer("shift", torch.zeros(dim))
        self.flip = False

    def forward(self, x, scale=1.0):
        y = self.fc2(torch.relu(self.fc1(x))) * scale + self.shift
        return -y if self.flip else y


MEGATRON = {"fc1.*": Shard(0), "fc2.weight": Shard(1)}


def _step(compiled, x, *extra) -> None:
    out = compiled(x, *extra)
    (out * out).sum().backward()


def _case(name: str, mode: str) -> tuple[nn.Module, Any, list[tuple]]:
    """The model and, per call, the arguments this rank passes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    inputs: Any = Replicate()
    shape, names = (world,), None
    calls = [(x,)]
    model = Net()
    # Data parallel: no collective in forward, so the forward runs while the check's posts
    # arrive, and the check raises before its output is returned.
    data_parallel = name.startswith("dp_")
    name = name.removeprefix("dp_")
    if data_parallel:
        inputs = Shard(0)
        x = x[rank * 8 // world : (rank + 1) * 8 // world]
        calls = [(x,)]
    if name == "replicate_batch":
        calls = [(x[: 8 if rank == 0 else 6],)]
    elif name == "replicate_values":
        calls = [(x + rank,)]
    elif name == "nan_on_one_rank":
        y = x.clone()
        if rank == world - 1:
            y[0, 0] = float("nan")
        calls = [(y,)]
    elif name == "python_scalar":
        calls = [(x, 0.5 + rank)]
    elif name == "branch":
        model.flip = rank == 1
    elif name == "buffer":
        pass  # changed after sharding below
    elif name == "second_call_values":
        calls = [(x,), (x + (0.25 if rank == 1 else 0.0),)]
    elif name == "sharded_pieces_differ":
        inputs = Shard(0)
        calls = [(x[rank * 8 // world : (rank + 1) * 8 // world] + rank,)]
    elif name in ("mesh2d_same_dp_differs", "mesh2d_dp_pieces_differ"):
        shape, names = (2, world // 2), ("dp", "tp")
        inputs = (Shard(0), Replicate())
        dp = rank // (world // 2)
        piece = x[dp * 4 : (dp + 1) * 4]
        if name == "mesh2d_same_dp_differs":
            piece = piece + (1.0 if rank == 1 else 0.0)  # rank 1 shares dp coordinate 0 with rank 0
        calls = [(piece + dp,)]
    else:
        raise ValueError(name)
    mesh = hca.init_mesh(shape, names)
    plan = {} if data_parallel else MEGATRON if mesh.ndim == 1 else {k: (Replicate(), v) for k, v in MEGATRON.items()}
    model = hca.sharded(plan, mesh=mesh, inputs=inputs)(model)
    if name == "buffer" and rank == 1:
        model.shift.add_(1.0)
    return model, {"input_check": mode}, calls


def disagreement(name: str, mode: str = "values") -> dict[str, Any]:
    """Run the case's calls; report the first `CheckError` (message, call index) or none."""
    torch._dynamo.reset()
    model, options, calls = _case(name, mode)
    compiled = torch.compile(model, backend="hca", options=options)
    for i, args in enumerate(calls):
        try:
            _step(compiled, *args)
        except hca.CheckError as e:
            return {"raised": True, "call": i, "message": str(e)}
    return {"raised": False, "call": None, "message": None}


def check_cost(mode: str, steps: int = 30) -> dict[str, float]:
    """Median seconds of one compiled step, and of the input check alone, under `mode`."""
    from torch_hca.compiler.checks.agreement import InputAgreement  # noqa: F401  (the class the pipeline wraps)

    torch._dynamo.reset()
    mesh = hca.init_mesh()
    torch.manual_seed(0)
    model = hca.sharded(MEGATRON, mesh=mesh)(Net(256))
    compiled = torch.compile(model, backend="hca", options={"input_check": mode})
    x = torch.randn(64, 256)
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        _step(compiled, x)
        times.append(time.perf_counter() - t)
    times = sorted(times[5:])
    return {"step_s": times[len(times) // 2]}


def divergent_plans() -> dict[str, Any]:
    """Rank 1 shards fc1.weight on another dimension: each rank's hca.sharded raises, in seconds."""
    rank = dist.get_rank()
    mesh = hca.init_mesh()
    plan = {"fc1.weight": Shard(1 if rank == 1 else 0), "fc1.bias": Shard(0), "fc2.weight": Shard(1)}
    start = time.perf_counter()
    try:
        hca.sharded(plan, mesh=mesh)(Net())
    except hca.PlanError as e:
        return {"raised": True, "message": str(e), "seconds": time.perf_counter() - start}
    return {"raised": False, "message": None, "seconds": time.perf_counter() - start}


def solver_choices_apart() -> dict[str, Any]:
    """Rank 1's solver returns another program than rank 0's, as HiGHS may for optima of equal
    cost (here: rank 1 solves under a cost model where bytes are dear and compute free, so it
    gathers the tiny batch where rank 0 splits the rows). Every rank must still emit one
    program, rank 0's. What it ran, or the error it raised."""
    import dataclasses

    from torch_hca.compiler.layout import solver as layout_solver
    from torch_hca.compiler.layout.move_costs import Costs

    mesh = hca.init_mesh()
    rank = dist.get_rank()
    solve = layout_solver.solve
    if rank == 1:

        def apart(ops, costs, **kwargs):
            model = dataclasses.replace(costs.model, flops_per_s=1e15, bytes_per_s=1e3, launch_s=0.0)
            return solve(ops, Costs(costs.mesh, model), **kwargs)

        layout_solver.solve = apart
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = hca.sharded({}, mesh=mesh, inputs=Shard(0), outputs=Shard(0))(Net())
        compiled = torch.compile(model, backend="hca", options={"check": True})
        x = torch.randn(8, 16).chunk(dist.get_world_size())[rank]
        compiled(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        layout_solver.solve = solve
    rep = hca.report(compiled)
    return {
        "forward": rep.collective_counts("forward"),
        "backward": rep.collective_counts("backward"),
        "status": rep.graph.layout.status,
        "refinement": rep.graph.refinement,
    }
