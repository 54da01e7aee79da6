"""`hca.calibrate`: measure the cost model's figures on the cluster at hand.

The layout solver and the timeline use `torch_hca.spmd.cost_model.CostModel`; its
defaults are rough. This measures, on the current process group and device:

  * latency and bandwidth: all_reduces of 64 KiB, 512 KiB and 4 MiB, the sizes a
    step's activations and gradient buckets have, and the line through their times
    by least squares against their ring wire bytes: its slope is ``bytes_per_s``,
    its intercept the per-call latency. (A 4-byte all_reduce, 0.5 ms on average on a
    2-core VM, would promise a latency that a step's collectives, 1.7-2.5 ms on average
    from 64 KiB to 512 KiB there, never see.) An all_gather and an all_reduce of 4 bytes, whose difference
    separates the per-round ``alpha_s`` from the per-call ``launch_s`` (ring rounds:
    n-1 against 2(n-1)). Every collective here is timed in turn with the others,
    2 x `repeats` rounds, each the mean of its fastest nine tenths;
  * ``sync_s``: the 4-byte all_gather issued right after a compute burst on
    every rank (median), less the same all_gather alone: inside a step the ranks
    arrive apart, and the first waits for the last;
  * the all_gather's and reduce_scatter's own rates: an all_gather into 4 MiB and a
    reduce_scatter of 4 MiB, run as the emitter runs them (a reduce_scatter on gloo:
    an all_reduce, this rank's rows copied out), less the latency, over their wire bytes;
  * compute: a training step of a small MLP (4 x Linear(256, 256) + ReLU on 256 rows,
    forward and backward: 11 matmuls' FLOPs over its median time, so the rate includes
    what a step pays besides the matmuls, on all ranks at once as in a step);
  * ``matmul_half_dim``: `x @ w` (`w` 512 x 512) at 16 and 256 rows, timed in turn: the h
    for which the rate ``d / (d + h)`` of the peak fits both (``flops_per_s`` is then the
    MLP step's rate over its 256-wide matmuls' share, ``256 / (256 + h)``);
  * ``contention``: a 4 MiB all_reduce issued asynchronously before enough MLP steps
    to outlast it, then waited: the time beyond the steps alone, over the all_reduce
    alone (the three timed in turn), between 0 (overlap hides the collective) and 1
    (the transport's threads take compute's cores: nothing hides);
  * memory: a 16 MiB copy; op_s: a tiny 12-layer MLP's training step through
    AOTAutograd, run op by op as the eager emitter runs it, per op (median);
  * ``call_s`` and ``param_s``: tiny MLPs of 6 and 24 layers (12 and 48 parameters)
    compiled by hca (replicated: no collective), their training steps timed in turn
    (gradients set to None first, as ``zero_grad()`` does), less their compiled
    graphs' own median calls, per graph; the line through the two against the
    parameter counts: its intercept is ``call_s`` (Dynamo's guards, the runtime
    wrappers, the input check), its slope ``param_s`` (each DTensor parameter
    unwrapped, its gradient wrapped and accumulated, Dynamo's guard on it).

Ranks measure different numbers, and the solver must make the same choice on
every rank, so rank 0's figures are broadcast and every rank returns them.
Use the result as ``options={"cost_model": hca.calibrate()}``, or cache it:

``hca.calibrate(cache=True)`` measures once per machine: it returns the figures
cached for (rank 0's host, world size, backend, torch version) when there are
some (`torch_hca.spmd.cost_model.cached_calibration`; rank 0 reads, every rank gets
its answer), else measures and stores them; ``refresh=True`` measures again.
The compiler starts from the cached figures by itself
(`torch_hca.spmd.cost_model.base_model`); ``python -m torch_hca calibrate`` fills the
cache from local gloo ranks.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from torch_hca.spmd.collective_kinds import RULES, Kind
from torch_hca.spmd.cost_model import CostModel, cached_calibration, scatter_runs_as_all_reduce, store_calibration
from torch_hca.errors import HCAError, MeshError
from torch_hca.runtime.mesh import current_mesh

# The figures, in the order they are broadcast: the cost model's fields.
FIELDS = tuple(f.name for f in dataclasses.fields(CostModel))


def _times(fn: Callable[[], None], repeats: int) -> list[float]:
    """Seconds of `repeats` runs of `fn`, after three warm-ups: first-call set-up
    (connections, allocations) is not what a step pays."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _typical_in_turn_s(fns: list[Callable[[], None]], repeats: int) -> list[float]:
    """The mean of the fastest nine tenths of `repeats` runs of each of `fns`, run in turn
    (after three warm-ups each).

    A step pays its collectives' mean, not their best: on a 2-core VM a 512 KiB gloo
    all_reduce took 0.45 ms at best, 2.5 ms in the median and the mean (40 runs), so
    the fastest run promised a fifth of what a step paid. The slowest tenth is dropped:
    on a shared machine a burst of other jobs can make one run 13x the usual. In turn,
    a slow or quiet spell of the machine falls on all of them alike, so the line through
    the all_reduces' sizes reads their difference, not the spell (run one after another,
    the intercept moved from 0.13 to 1.9 ms between calibrations here).
    """
    for fn in fns:
        for _ in range(3):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, kept in zip(fns, times):
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return [statistics.fmean(sorted(t)[:max(1, math.ceil(0.9 * len(t)))]) for t in times]


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    """The median of `repeats` runs: for compute, which a step pays at its typical speed, not its best."""
    return statistics.median(_times(fn, repeats))


def _after_compute_s(collective: Callable[[], None], compute: Callable[[], None], sync: Callable[[], None],
                     repeats: int) -> float:
    """The median time of `collective` issued right after `compute` on every rank (the
    compute untimed): what a collective in a training step pays, skew between ranks included."""
    times = []
    for _ in range(repeats + 1):
        compute()
        sync()
        start = time.perf_counter()
        collective()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _contention(step: Callable[[], None], step_s: float, start: Callable[[], dist.Work], start_s: float,
                sync: Callable[[], None], repeats: int) -> float:
    """The share of a collective's time compute loses while both run (see `_measure`): the
    collective `start()` returns (about `start_s` long), issued before runs of `step` (about
    `step_s` each) that outlast it, and waited."""
    k = max(1, math.ceil(start_s / step_s))
    steps = lambda: ([step() for _ in range(k)], sync())

    def both():
        work = start()
        steps()
        work.wait()
        sync()

    steps_s, comm_s, both_s = _typical_in_turn_s([steps, lambda: (start().wait(), sync()), both], repeats)
    return min(max((both_s - steps_s) / max(comm_s, 1e-9), 0.0), 1.0)


def _mlp_step(device: torch.device) -> tuple[Callable[[], None], float]:
    """A small MLP's forward and backward, and its matmul FLOPs: 4 forward, 4 weight-gradient
    and 3 input-gradient matmuls (the input takes no gradient) of 256 x 256 x 256."""
    layers = [torch.nn.Linear(256, 256, device=device) for _ in range(4)]
    x = torch.randn(256, 256, device=device)

    def step():
        y = x
        for layer in layers:
            y = torch.relu(layer(y))
        y.sum().backward()
    return step, 11 * 2 * 256 ** 3


def _op_s(device: torch.device, repeats: int) -> float:
    """Host seconds per op of a training step run as the eager emitter runs one: a 12-layer
    MLP on 2 x 4 tensors (compute is nothing) through AOTAutograd, its forward and backward
    FX graphs run op by op. The median step over their ops, so each op's share of the
    autograd engine and AOTAutograd's wrappers counts too (about twice a bare op's cost)."""
    from functorch.compile import aot_module, make_boxed_func

    ops = []

    def eager(gm, example_inputs):
        ops.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        return make_boxed_func(gm.forward)

    layers = [torch.nn.Linear(4, 4, device=device) for _ in range(12)]
    model = aot_module(torch.nn.Sequential(*(m for layer in layers for m in (layer, torch.nn.ReLU()))),
                       fw_compiler=eager, bw_compiler=eager)
    x = torch.randn(2, 4, device=device)
    step = lambda: model(x).sum().backward()
    step()  # compiles: forward and backward graphs
    return _median_s(step, max(repeats, 20)) / sum(ops)


def _host_s(figures: dict[str, float], device: torch.device, repeats: int) -> tuple[float, float]:
    """(call_s, param_s): host seconds per call of a compiled graph beyond its own run, and per
    DTensor parameter it reads. Two tiny MLPs compiled by hca, of 6 and 24 Linear(4, 4) layers
    (replicated parameters and input: no collective), their training steps (gradients set to
    None first, as ``zero_grad()`` does) timed in turn, each less its compiled forward's and
    backward's own median calls (`CompileReport.measured`; on a CUDA mesh, which does not time
    them, the timeline's estimate of the two under `figures`), per graph: the line through
    the two against their parameter counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    from torch_hca.api.plan import sharded
    from torch_hca.report.compile_report import report

    mesh = current_mesh() or init_device_mesh(device.type, (dist.get_world_size(),))
    x = torch.ones(2, 4, device=device)  # the same on every rank, as a Replicate() input must be
    steps, compiled = [], []
    for layers in (6, 24):
        model = torch.nn.Sequential(*(m for _ in range(layers)
                                      for m in (torch.nn.Linear(4, 4, device=device), torch.nn.ReLU())))
        c = torch.compile(sharded({}, mesh=mesh, inputs=Replicate(), outputs=Replicate())(model), backend="hca")

        def step(c=c, model=model):
            for p in model.parameters():
                p.grad = None
            c(x).sum().backward()

        step()  # compiles
        steps.append(step)
        compiled.append(c)
    measured = _typical_in_turn_s(steps, max(repeats, 20))
    per_graph, params = [], []
    for c, seconds in zip(compiled, measured):
        try:
            rep = report(c)
        except HCAError as e:  # Dynamo ran it uncompiled (its recompile limit for sharded modules, say)
            warnings.warn(f"hca.calibrate: call_s and param_s are 0: a probe module did not compile with hca ({e})",
                          stacklevel=3)
            return 0.0, 0.0
        try:
            inside = rep.measured().measured_s
        except HCAError:  # a CUDA mesh: its calls return before their kernels finish
            inside = rep.timeline(CostModel(**figures)).after.total_s
        graphs = sum(gm is not None for g in rep.graphs for gm in (g.forward, g.backward))
        per_graph.append(max(seconds - inside, 0.0) / max(graphs, 1))
        params.append(len(rep.graph.parameters))
    param_s = max((per_graph[1] - per_graph[0]) / max(params[1] - params[0], 1), 0.0)
    return max(per_graph[0] - param_s * params[0], 0.0), param_s


def calibrate(repeats: int = 20, *, cache: bool = False, refresh: bool = False) -> dict[str, float]:
    """Cost-model figures measured on the world's process group (rank 0's, on every rank).

    cache: use the figures cached for this host, world size, backend and torch
    version, or measure and cache them; refresh: measure and cache even so.
    """
    return cached_calibrate(repeats, refresh=refresh)[0] if cache or refresh else _measure(_checked(repeats))


def cached_calibrate(repeats: int = 20, refresh: bool = False) -> tuple[dict[str, float], bool]:
    """(figures, whether they came from the cache): the cached ones unless `refresh`, else
    measured and stored by rank 0. Rank 0 decides, so every rank takes the same branch."""
    _checked(repeats)
    figures = None if refresh else _rank0_cached()
    if figures is not None:
        return figures, True
    figures = _measure(repeats)
    if dist.get_rank() == 0:
        store_calibration(figures)
    return figures, False


def _checked(repeats) -> int:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise HCAError(f"hca.calibrate: repeats={repeats!r}; give a positive int (timed runs per figure, default 20)")
    if not dist.is_initialized():
        raise MeshError("hca.calibrate(): no process group; call hca.init_mesh() first (or run under hca.launch)")
    return repeats


def _device() -> torch.device:
    mesh = current_mesh()
    return torch.device(mesh.device_type if mesh is not None else "cpu")


def _rank0_cached() -> dict[str, float] | None:
    """Rank 0's cache entry for this world, on every rank (None on every rank when it has none)."""
    found = cached_calibration() if dist.get_rank() == 0 else None
    flat = torch.tensor([found is not None, *(found[k] if found else 0.0 for k in FIELDS)],
                        dtype=torch.float64, device=_device())
    dist.broadcast(flat, src=0)
    return dict(zip(FIELDS, flat[1:].tolist())) if flat[0] else None


def _measure(repeats: int) -> dict[str, float]:
    device = _device()
    n = dist.get_world_size()
    tiny = torch.ones(1, device=device)
    big = torch.ones(2 ** 20, device=device)  # 4 MiB of fp32
    out = torch.empty(n, device=device)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    sizes = (2 ** 14, 2 ** 17, big.numel())  # fp32 elements: 64 KiB, 512 KiB, 4 MiB
    piece = torch.empty(big.numel() // n, device=device)
    bucket = torch.zeros_like(big)  # the scatter sums it in place, again and again: zeros stay zeros
    collectives = [
        lambda: dist.all_gather_single(out, tiny),
        lambda: dist.all_reduce(tiny),
        *(lambda t=torch.ones(k, device=device): dist.all_reduce(t) for k in sizes),
        lambda: dist.all_gather_single(big, piece),
        lambda: _reduce_scatter_as_emitted(bucket, piece),
    ]
    dist.barrier()  # every rank runs them in the same turn: each call is matched on every rank
    gather_s, reduce_s, *reduce_times, big_gather_s, big_scatter_s = _typical_in_turn_s(
        [lambda op=op: (op(), sync()) for op in collectives], 2 * repeats)
    step, step_flops = _mlp_step(device)
    dist.barrier()
    step_s = _median_s(lambda: (step(), sync()), max(repeats // 2, 3))
    half_dim = _matmul_half_dim(device, sync, repeats)
    synced_s = _after_compute_s(lambda: dist.all_gather_single(out, tiny), step, sync, max(repeats // 2, 3))
    dist.barrier()
    contention = _contention(step, step_s, lambda: dist.all_reduce(bucket, async_op=True), reduce_times[-1],
                             sync, repeats)
    op_s = _op_s(device, repeats)
    src, dst = torch.randn(2 ** 22, device=device), torch.empty(2 ** 22, device=device)
    (copy_s,) = _typical_in_turn_s([lambda: (dst.copy_(src), sync())], repeats)

    alpha = max(reduce_s - gather_s, 0.0) / max(n - 1, 1)
    wires = [RULES[Kind.ALL_REDUCE].wire_bytes(4 * k, n) for k in sizes]
    seconds_per_byte, latency = _line(wires, reduce_times)
    if seconds_per_byte <= 0:  # noise hid the slope: the largest all_reduce, less the 4-byte one
        seconds_per_byte, latency = max(reduce_times[-1] - reduce_s, 1e-9) / wires[-1], reduce_s
    launch = max(latency - alpha * 2 * (n - 1), 0.0)
    # What the same collective costs right after compute, beyond its transfer: the ranks reach
    # it at different times, and the first waits for the last.
    sync = max(synced_s - gather_s, 0.0)

    def rate(kind: Kind, seconds: float) -> float:
        """Wire bytes per second of `kind` on 4 MiB, less the latency its ring rounds pay."""
        return RULES[kind].wire_bytes(big.numel() * 4, n) / max(seconds - launch - alpha * (n - 1), 1e-9)

    measured = {
        "launch_s": launch, "alpha_s": alpha,
        "bytes_per_s": 1.0 / seconds_per_byte,
        # The MLP's matmuls are 256 wide: its rate over their share of the large matmuls' rate.
        "flops_per_s": step_flops / step_s * (256 + half_dim) / 256, "matmul_half_dim": half_dim,
        "memory_bytes_per_s": 2 * src.numel() * 4 / copy_s,  # read and write
        "op_s": op_s, "sync_s": sync, "call_s": 0.0, "contention": contention,
        "gather_bytes_per_s": rate(Kind.ALL_GATHER, big_gather_s),
        "scatter_bytes_per_s": rate(Kind.REDUCE_SCATTER, big_scatter_s),
    }
    measured["call_s"], measured["param_s"] = _host_s(measured, device, repeats)
    figures = torch.tensor([measured[k] for k in FIELDS], dtype=torch.float64, device=device)
    dist.broadcast(figures, src=0)
    return dict(zip(FIELDS, (float(x) for x in figures.tolist())))


def _matmul_half_dim(device: torch.device, sync: Callable[[], None], repeats: int) -> float:
    """h of the cost model's matmul rate ``d / (d + h)``: `x @ w` (`w` 512 x 512) at 16 and at
    256 rows, timed in turn; 0 where the small one is no slower per FLOP (at most 256)."""
    w = torch.randn(512, 512, device=device)
    small, large = torch.randn(16, 512, device=device), torch.randn(256, 512, device=device)
    small_s, large_s = _typical_in_turn_s([lambda: (small @ w, sync()), lambda: (large @ w, sync())], 2 * repeats)
    q = (16 * large_s) / (256 * small_s)  # the rate at 16 rows over the rate at 256
    if q >= 1.0:
        return 0.0
    # q = (16 / (16 + h)) / (256 / (256 + h)), solved for h.
    return min(4096.0 * (1.0 - q) / max(256.0 * q - 16.0, 1e-9), 256.0)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points (xs[i], ys[i])."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return slope, mean_y - slope * mean_x


def _reduce_scatter_as_emitted(x: torch.Tensor, out: torch.Tensor) -> None:
    """Sum `x` over the world into this rank's rows `out`, as `backends.emit` runs a bucket's
    reduce_scatter: on gloo, an all_reduce in place and a copy of this rank's rows; elsewhere
    the transport's own (`x` then holds the sum)."""
    if scatter_runs_as_all_reduce(str(dist.get_backend()), x.device.type):
        start = dist.get_rank() * out.shape[0]
        dist.all_reduce(x)
        out.copy_(x[start:start + out.shape[0]])
    else:
        dist.reduce_scatter_tensor(out, x)


def _calibrate_and_store() -> dict[str, float]:
    from torch_hca.runtime.mesh import init_mesh

    init_mesh()
    return cached_calibrate(refresh=True)[0]


def calibrate_local(world_size: int = 2) -> str:
    """`python -m torch_hca calibrate`: measure on `world_size` local gloo ranks, cache, and say what."""
    from torch_hca.runtime.launch import launch
    from torch_hca.spmd.cost_model import cache_dir

    figures = launch(_calibrate_and_store, world_size)[0]
    lines = [f"cost model for {world_size} local gloo ranks, cached in {cache_dir()}:"]
    lines += [f"  {k:<20} {v:.4g}" for k, v in figures.items()]
    return "\n".join(lines)
