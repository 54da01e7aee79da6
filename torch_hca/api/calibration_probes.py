"""What `hca.calibrate` times, and how: the probes of one round (`Probes`, `time_round`) and the
host time of a compiled call (`host_s`). Each probe is described in `torch_hca.api.calibrate`;
the figures are read off their seconds in `torch_hca.api.calibration_figures`."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from torch_hca.spmd.cost_model import CostModel, scatter_runs_as_all_reduce
from torch_hca.errors import HCAError
from torch_hca.runtime.mesh import current_mesh


# ----------------------------------------------------------------------------- timing


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
    return [statistics.fmean(sorted(t)[: max(1, math.ceil(0.9 * len(t)))]) for t in times]


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    """The median of `repeats` runs: for compute, which a step pays at its typical speed, not its best."""
    return statistics.median(_times(fn, repeats))


def _after_compute_s(
    collective: Callable[[], None], compute: Callable[[], None], sync: Callable[[], None], repeats: int
) -> float:
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


def contention_times(
    step: Callable[[], None], k: int, start: Callable[[], dist.Work], sync: Callable[[], None], repeats: int
) -> tuple[float, float, float]:
    """Seconds of `k` runs of `step` alone, of the collective `start()` returns alone, and of
    the collective issued before the `k` steps and waited after them (see `calibration_figures._share`)."""
    steps = lambda: ([step() for _ in range(k)], sync())

    def both():
        work = start()
        steps()
        work.wait()
        sync()

    steps_s, comm_s, both_s = _typical_in_turn_s([steps, lambda: (start().wait(), sync()), both], repeats)
    return steps_s, comm_s, both_s


# ----------------------------------------------------------------------------- the probes


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

    return step, 11 * 2 * 256**3


def _op_step(device: torch.device) -> tuple[Callable[[], None], int]:
    """A training step run as the eager emitter runs one, and its op count: a 12-layer MLP on
    2 x 4 tensors (compute is nothing) through AOTAutograd, its forward and backward FX graphs
    run op by op. Timed per op, so each op's share of the autograd engine and AOTAutograd's
    wrappers counts too (about twice a bare op's cost)."""
    from functorch.compile import aot_module, make_boxed_func

    ops = []

    def eager(gm, example_inputs):
        ops.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        return make_boxed_func(gm.forward)

    layers = [torch.nn.Linear(4, 4, device=device) for _ in range(12)]
    model = aot_module(
        torch.nn.Sequential(*(m for layer in layers for m in (layer, torch.nn.ReLU()))),
        fw_compiler=eager,
        bw_compiler=eager,
    )
    x = torch.randn(2, 4, device=device)
    step = lambda: model(x).sum().backward()
    step()  # compiles: forward and backward graphs
    return step, sum(ops)


def host_s(figures: dict[str, float], device: torch.device, repeats: int) -> tuple[float, float]:
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
        model = torch.nn.Sequential(
            *(m for _ in range(layers) for m in (torch.nn.Linear(4, 4, device=device), torch.nn.ReLU()))
        )
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
            warnings.warn(
                f"hca.calibrate: call_s and param_s are 0: a probe module did not compile with hca ({e})", stacklevel=3
            )
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


# The probes a round times, by name: the spreads between rounds are kept under these names.
PROBES = (
    "all_gather_4B",
    "all_reduce_4B",
    "all_reduce_64KiB",
    "all_reduce_512KiB",
    "all_reduce_4MiB",
    "all_gather_4MiB",
    "reduce_scatter_4MiB",
    "mlp_step",
    "matmul_16_rows",
    "matmul_256_rows",
    "gather_after_compute",
    "steps_alone",
    "all_reduce_alone",
    "all_reduce_under_steps",
    "op",
    "copy_16MiB",
)


class Probes:
    """What every round times, set up once: the collectives' tensors, the MLP step, the
    op-by-op step, the matmuls' and the copy's operands."""

    def __init__(self, device: torch.device):
        n = self.n = dist.get_world_size()
        self.sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
        tiny, out = torch.ones(1, device=device), torch.empty(n, device=device)
        self.big = torch.ones(2**20, device=device)  # 4 MiB of fp32
        self.sizes = (2**14, 2**17, self.big.numel())  # fp32 elements: 64 KiB, 512 KiB, 4 MiB
        piece = torch.empty(self.big.numel() // n, device=device)
        self.bucket = torch.zeros_like(self.big)  # the scatter sums it in place, again and again: zeros stay zeros
        self.collectives = [  # PROBES[:7]
            lambda: dist.all_gather_single(out, tiny),
            lambda: dist.all_reduce(tiny),
            *(lambda t=torch.ones(k, device=device): dist.all_reduce(t) for k in self.sizes),
            lambda: dist.all_gather_single(self.big, piece),
            lambda: _reduce_scatter_as_emitted(self.bucket, piece),
        ]
        self.gather = self.collectives[0]
        self.step, self.step_flops = _mlp_step(device)
        self.op_step, self.ops = _op_step(device)
        w = torch.randn(512, 512, device=device)
        small, large = torch.randn(16, 512, device=device), torch.randn(256, 512, device=device)
        self.matmuls = [lambda: (small @ w, self.sync()), lambda: (large @ w, self.sync())]
        src, dst = torch.randn(2**22, device=device), torch.empty(2**22, device=device)
        self.copy, self.copy_bytes = (lambda: (dst.copy_(src), self.sync())), 2 * src.numel() * 4  # read and write
        self.steps_per_all_reduce = 0  # steps that outlast the 4 MiB all_reduce: set by the first round


def time_round(p: Probes, repeats: int) -> dict[str, float]:
    """Seconds of every probe (`PROBES`), one round; how each is timed: `torch_hca.api.calibrate`'s docstring."""
    dist.barrier()  # every rank runs them in the same turn: each call is matched on every rank
    times = dict(zip(PROBES, _typical_in_turn_s([lambda op=op: (op(), p.sync()) for op in p.collectives], 2 * repeats)))
    dist.barrier()
    times["mlp_step"] = _median_s(lambda: (p.step(), p.sync()), max(repeats // 2, 3))
    times["matmul_16_rows"], times["matmul_256_rows"] = _typical_in_turn_s(p.matmuls, 2 * repeats)
    times["gather_after_compute"] = _after_compute_s(p.gather, p.step, p.sync, max(repeats // 2, 3))
    # The same number of steps every round, so that the fastest rounds' times still add up.
    p.steps_per_all_reduce = p.steps_per_all_reduce or max(1, math.ceil(times["all_reduce_4MiB"] / times["mlp_step"]))
    dist.barrier()
    times["steps_alone"], times["all_reduce_alone"], times["all_reduce_under_steps"] = contention_times(
        p.step, p.steps_per_all_reduce, lambda: dist.all_reduce(p.bucket, async_op=True), p.sync, repeats
    )
    times["op"] = _median_s(p.op_step, max(repeats, 20)) / p.ops
    (times["copy_16MiB"],) = _typical_in_turn_s([p.copy], repeats)
    return times


def _reduce_scatter_as_emitted(x: torch.Tensor, out: torch.Tensor) -> None:
    """Sum `x` over the world into this rank's rows `out`, as `backends.emit` runs a bucket's
    reduce_scatter: on gloo, an all_reduce in place and a copy of this rank's rows; elsewhere
    the transport's own (`x` then holds the sum)."""
    if scatter_runs_as_all_reduce(str(dist.get_backend()), x.device.type):
        start = dist.get_rank() * out.shape[0]
        dist.all_reduce(x)
        out.copy_(x[start : start + out.shape[0]])
    else:
        dist.reduce_scatter_tensor(out, x)
