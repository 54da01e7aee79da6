"""Work run on every rank by tests/test_staging.py: collectives staged through host buffers.

Plain module, importable by the spawned ranks; no pytest here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_hca as hca
from torch_hca.runtime import staging

import zoo_cases

hca_ops = torch.ops.hca


def staged_ops_match_gloo(cap_bytes: int) -> dict:
    """Each staged op against the same collective run by gloo directly, on this rank's random
    data, with buffers of `cap_bytes` (small: a payload takes several slices). Returns the
    largest difference per op and the staging counts."""
    hca.init_mesh()
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    staging.reset(cap_bytes)
    torch.manual_seed(rank)
    x = torch.randn(6 * n, 5)
    diffs = {}

    def close(name, staged, direct):
        diffs[name] = (staged - direct).abs().max().item() if staged.shape == direct.shape else float("inf")

    for op in ("sum", "avg", "max"):
        close(f"all_reduce {op}", hca_ops.staged_all_reduce(x, op, group), funcol.all_reduce(x, op, group).wait())
    close("all_gather", hca_ops.staged_all_gather(x, n, group), funcol.all_gather_single(x, 0, group).wait())
    close(
        "reduce_scatter",
        hca_ops.staged_reduce_scatter(x, "sum", n, group),
        funcol.all_reduce(x, "sum", group).wait()[rank * 6 : (rank + 1) * 6],
    )
    close("broadcast", hca_ops.staged_broadcast(x, 1, group), funcol.broadcast(x, 1, group).wait())
    ins = [1 + (rank + r) % 3 for r in range(n)]  # rows this rank sends to each rank
    outs = [1 + (r + rank) % 3 for r in range(n)]  # rows each rank sends here
    y = x[: sum(ins)]
    close("all_to_all", hca_ops.staged_all_to_all(y, outs, ins, group), funcol.all_to_all_single(y, outs, ins, group))
    stats = staging.stats()
    result = {"diffs": diffs, "collectives": dict(stats.collectives), "allocations": stats.allocations}
    result["to_host"], result["from_host"] = stats.bytes_to_host, stats.bytes_from_host
    staging.reset(64)  # smaller than every rank's all_to_all: each goes through memory of its own
    y3, outs3, ins3 = torch.cat([y, y, y]), [3 * k for k in outs], [3 * k for k in ins]  # 120 bytes or more
    close(
        "all_to_all oversize",
        hca_ops.staged_all_to_all(y3, outs3, ins3, group),
        funcol.all_to_all_single(y3, outs3, ins3, group),
    )
    result["oversize"], result["allocations_at_64"] = staging.stats().oversize, staging.stats().allocations
    staging.reset(staging.DEFAULT_CAP_BYTES)
    return result


def zoo_staged(model_name: str, plan_name: str, cap_bytes: int = 4096, extra: dict | None = None) -> dict:
    """`zoo_cases.zoo_parity` with every collective staged (option staging="on"), plus what went
    through the buffers in the last step and the report's bytes for one step."""
    staging.reset(cap_bytes)
    options = {**zoo_cases.backend_options(), "staging": "on", **(extra or {})}
    result = zoo_cases.zoo_parity(model_name, plan_name, steps=2, options=options)
    stats = staging.stats()
    result["staged"] = dict(stats.collectives)
    result["staged_to_host"], result["allocations"] = stats.bytes_to_host, stats.allocations
    result["staged_from_host"], result["oversize"] = stats.bytes_from_host, stats.oversize
    staging.reset(staging.DEFAULT_CAP_BYTES)
    return result
