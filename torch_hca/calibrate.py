"""`hca.calibrate`: measure the cost model's figures on the cluster at hand.

The layout solver and the timeline use `torch_hca.cost_model.CostModel`; its
defaults are rough. This measures, on the current process group and device:

  * latency: an all_gather and an all_reduce of 4 bytes, whose difference
    separates the per-round ``alpha_s`` from the per-call ``launch_s``
    (ring rounds: n-1 against 2(n-1));
  * bandwidth: an all_reduce of 4 MiB, less the latency, over its ring wire bytes;
  * compute: a 512x512x512 fp32 matmul; memory: a 16 MiB copy.

Ranks measure different numbers, and the solver must make the same choice on
every rank, so rank 0's figures are broadcast and every rank returns them.
Use the result as ``options={"cost_model": hca.calibrate()}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .collective_kinds import RULES, Kind
from .errors import MeshError
from .mesh import current_mesh

FIELDS = ("launch_s", "alpha_s", "bytes_per_s", "flops_per_s", "memory_bytes_per_s")


def _best_s(fn: Callable[[], None], repeats: int) -> float:
    """The fastest of `repeats` runs after three warm-ups.

    The fastest, not the median: on a shared machine the slow runs measure the
    other jobs (one median-of-7 launch latency came out 13x the usual here).
    """
    for _ in range(3):  # first-call set-up (connections, allocations) is not what a step pays
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def calibrate(repeats: int = 20) -> dict[str, float]:
    """Cost-model figures measured on the world's process group (rank 0's, on every rank)."""
    if not dist.is_initialized():
        raise MeshError("hca.calibrate(): no process group; call hca.init_mesh() first (or run under hca.launch)")
    mesh = current_mesh()
    device = torch.device(mesh.device_type if mesh is not None else "cpu")
    n = dist.get_world_size()
    tiny = torch.ones(1, device=device)
    big = torch.ones(2 ** 20, device=device)  # 4 MiB of fp32
    out = torch.empty(n, device=device)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    def timed(op) -> float:
        def run():
            op()
            sync()
        dist.barrier()
        return _best_s(run, repeats)

    gather_s = timed(lambda: dist.all_gather_into_tensor(out, tiny))
    reduce_s = timed(lambda: dist.all_reduce(tiny))
    big_s = timed(lambda: dist.all_reduce(big))
    a = torch.randn(512, 512, device=device)
    matmul_s = timed(lambda: a @ a)
    src, dst = torch.randn(2 ** 22, device=device), torch.empty(2 ** 22, device=device)
    copy_s = timed(lambda: dst.copy_(src))

    alpha = max(reduce_s - gather_s, 0.0) / max(n - 1, 1)
    launch = max(gather_s - alpha * (n - 1), 0.0)
    wire = RULES[Kind.ALL_REDUCE].wire_bytes(big.numel() * 4, n)
    figures = torch.tensor([
        launch, alpha,
        wire / max(big_s - reduce_s, 1e-9),
        2 * 512 ** 3 / matmul_s,
        2 * src.numel() * 4 / copy_s,  # read and write
    ], dtype=torch.float64, device=device)
    dist.broadcast(figures, src=0)
    return dict(zip(FIELDS, (float(x) for x in figures.tolist())))
