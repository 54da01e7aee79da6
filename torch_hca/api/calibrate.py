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
    2 x `repeats` runs, each the mean of its fastest nine tenths;
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

Other work on the machine (a test suite, another job) slows every probe, and figures
measured under it once decided the layouts of every later compile (18.7 GFLOP/s cached
against 70-85 quiet). So all of the above is one round, run `rounds` times (3), and each
probe keeps its fastest round: load only slows a probe down, and each round's time is
already a typical run, not a lucky one. Where a judged probe (`JUDGED`: the MLP step, the
256-row matmul, the 4 MiB all_reduce) ran more than `max_spread` (50%) slower in
its slowest round than in its fastest, the figures are flagged noisy, with a warning. A
load that lasts through every round is not seen this way; the compile log's "calibrated
<when>" is the clue then. ``call_s`` and ``param_s`` are measured once, after the rounds.

Ranks measure different numbers, and the solver must make the same choice on
every rank, so rank 0's figures are broadcast and every rank returns them: a
`Calibration`, a dict of the figures that also says when they were measured
(``measured_at``), whether they were ``noisy`` and each probe's ``spread``.
Use the result as ``options={"cost_model": hca.calibrate()}``, or cache it:

``hca.calibrate(cache=True)`` measures once per machine: it returns the figures
cached for (rank 0's host, world size, backend, torch version) when there are
some (`torch_hca.spmd.calibration_cache.cached_calibration`; rank 0 reads, every rank gets
its answer), else measures and stores them; ``refresh=True`` measures again. A noisy
calibration is cached marked noisy, and only where the cache holds no quiet one for the
key (a quiet entry stays, with a warning); a noisy entry counts as none for
``cache=True``, which measures again. The compiler starts from the cached figures, noisy
or not, by itself (`torch_hca.spmd.calibration_cache.base_model`), and its compile log says which
("calibrated 2026-12-03 06:10 UTC, noisy (cache ...)"); ``python -m torch_hca calibrate``
fills the cache from local gloo ranks.
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
from torch_hca.spmd.calibration_cache import Calibration, cached_calibration, now_utc, store_calibration
from torch_hca.spmd.cost_model import CostModel, scatter_runs_as_all_reduce
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


def _contention_times(
    step: Callable[[], None], k: int, start: Callable[[], dist.Work], sync: Callable[[], None], repeats: int
) -> tuple[float, float, float]:
    """Seconds of `k` runs of `step` alone, of the collective `start()` returns alone, and of
    the collective issued before the `k` steps and waited after them (see `_share`)."""
    steps = lambda: ([step() for _ in range(k)], sync())

    def both():
        work = start()
        steps()
        work.wait()
        sync()

    steps_s, comm_s, both_s = _typical_in_turn_s([steps, lambda: (start().wait(), sync()), both], repeats)
    return steps_s, comm_s, both_s


def _share(steps_s: float, comm_s: float, both_s: float) -> float:
    """The share of a collective's time compute loses while both run (see `_measure`)."""
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
# The probes whose spread makes a calibration noisy: the rates layouts turn on (compute, a large
# transfer). Small collectives and host times vary between rounds even on a quiet machine, and so
# does the 16 MiB copy on a VM (66% on this project's quiet 2-core VM, 2026-12-03): not judged.
JUDGED = ("mlp_step", "matmul_256_rows", "all_reduce_4MiB")
# The slowest round of a judged probe 50% slower than its fastest: noisy. Quiet runs on this
# project's 2-core VM spread up to 37% (mlp_step) and 32% (all_reduce_4MiB); loaded, 146%.
MAX_SPREAD = 0.5


def calibrate(
    repeats: int = 20, *, cache: bool = False, refresh: bool = False, rounds: int = 3, max_spread: float = MAX_SPREAD
) -> Calibration:
    """Cost-model figures measured on the world's process group (rank 0's, on every rank).

    rounds: the measurement is repeated this many times and each probe keeps its fastest round
    (other work only slows a probe down); max_spread: a judged probe's slowest round this much
    slower than its fastest (0.5: 50%) flags the figures noisy, with a warning.
    cache: use the figures cached for this host, world size, backend and torch
    version, or measure and cache them; refresh: measure and cache even so. A noisy cached
    entry counts as none (measured again); a noisy measurement never replaces a quiet entry.
    """
    if cache or refresh:
        return cached_calibrate(repeats, refresh=refresh, rounds=rounds, max_spread=max_spread)[0]
    return _measure(*_checked(repeats, rounds, max_spread))


def cached_calibrate(
    repeats: int = 20, refresh: bool = False, *, store: bool = True, rounds: int = 3, max_spread: float = MAX_SPREAD
) -> tuple[Calibration, bool]:
    """(figures, whether they came from the cache): the cached ones unless `refresh` or noisy,
    else measured and, with `store`, stored by rank 0 (`store_calibration`: not over a quiet
    entry when noisy). Rank 0 decides, so every rank takes the same branch."""
    checked = _checked(repeats, rounds, max_spread)
    figures = None if refresh else _rank0_cached()
    if figures is not None:
        return figures, True
    figures = _measure(*checked)
    if store and dist.get_rank() == 0:
        store_calibration(figures)
    return figures, False


def _checked(repeats, rounds, max_spread) -> tuple[int, int, float]:
    for name, value in (("repeats", repeats), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = "timed runs per probe and round, default 20" if name == "repeats" else "default 3"
            raise HCAError(f"hca.calibrate: {name}={value!r}; give a positive int ({what})")
    if isinstance(max_spread, bool) or not isinstance(max_spread, (int, float)) or not max_spread > 0:
        raise HCAError(
            f"hca.calibrate: max_spread={max_spread!r}; give a number > 0 (default {MAX_SPREAD}: "
            "a round 50% slower than the fastest flags the figures noisy; math.inf: never)"
        )
    if not dist.is_initialized():
        raise MeshError("hca.calibrate(): no process group; call hca.init_mesh() first (or run under hca.launch)")
    return repeats, rounds, float(max_spread)


def _device() -> torch.device:
    mesh = current_mesh()
    return torch.device(mesh.device_type if mesh is not None else "cpu")


def _rank0_cached() -> Calibration | None:
    """Rank 0's quiet cache entry for this world, on every rank (None on every rank when it has
    none, or only a noisy one: that is measured again)."""
    found = cached_calibration() if dist.get_rank() == 0 else None
    return _broadcast(found if found is not None and not found.noisy else None)


def _broadcast(cal: Calibration | None) -> Calibration | None:
    """Rank 0's calibration, or its None, on every rank: figures, time, noise flag and spreads."""
    box = [cal]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Probes:
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


def _round(p: _Probes, repeats: int) -> dict[str, float]:
    """Seconds of every probe (`PROBES`), one round; how each is timed: `_measure`."""
    dist.barrier()  # every rank runs them in the same turn: each call is matched on every rank
    times = dict(zip(PROBES, _typical_in_turn_s([lambda op=op: (op(), p.sync()) for op in p.collectives], 2 * repeats)))
    dist.barrier()
    times["mlp_step"] = _median_s(lambda: (p.step(), p.sync()), max(repeats // 2, 3))
    times["matmul_16_rows"], times["matmul_256_rows"] = _typical_in_turn_s(p.matmuls, 2 * repeats)
    times["gather_after_compute"] = _after_compute_s(p.gather, p.step, p.sync, max(repeats // 2, 3))
    # The same number of steps every round, so that the fastest rounds' times still add up.
    p.steps_per_all_reduce = p.steps_per_all_reduce or max(1, math.ceil(times["all_reduce_4MiB"] / times["mlp_step"]))
    dist.barrier()
    times["steps_alone"], times["all_reduce_alone"], times["all_reduce_under_steps"] = _contention_times(
        p.step, p.steps_per_all_reduce, lambda: dist.all_reduce(p.bucket, async_op=True), p.sync, repeats
    )
    times["op"] = _median_s(p.op_step, max(repeats, 20)) / p.ops
    (times["copy_16MiB"],) = _typical_in_turn_s([p.copy], repeats)
    return times


def _stable(rounds: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """(each probe's fastest round, how much slower its slowest round ran: 0.3 is 30%).

    Other work on the machine only slows a probe down, so its fastest round is the nearest to
    the machine's own speed; each round's figure is already a typical run, not a lucky one."""
    fastest = {k: min(r[k] for r in rounds) for k in rounds[0]}
    spread = {k: max(r[k] for r in rounds) / max(fastest[k], 1e-12) - 1.0 for k in rounds[0]}
    return fastest, spread


def _noisy(spread: dict[str, float], max_spread: float) -> list[str]:
    """The judged probes whose rounds disagreed beyond `max_spread`."""
    return [k for k in JUDGED if spread.get(k, 0.0) > max_spread]


def _measure(repeats: int, rounds: int = 3, max_spread: float = MAX_SPREAD) -> Calibration:
    """Rank 0's figures on every rank: `rounds` rounds of every probe, each probe's fastest
    round, and the figures derived from those (`_figures_of`); noisy where `_noisy`."""
    device = _device()
    probes = _Probes(device)
    measured_at = now_utc()
    times, spread = _stable([_round(probes, repeats) for _ in range(rounds)])
    figures = _figures_of(times, probes)
    figures["call_s"], figures["param_s"] = _host_s(figures, device, repeats)
    noisy = _noisy(spread, max_spread)
    cal = _broadcast(Calibration({k: figures[k] for k in FIELDS}, measured_at, bool(noisy), spread))
    if cal.noisy and dist.get_rank() == 0:
        worst = ", ".join(f"{k} {spread[k]:.0%}" for k in noisy)
        warnings.warn(
            f"hca.calibrate: noisy: the slowest of {rounds} rounds ran slower than the fastest by {worst} "
            f"(more than {max_spread:.0%}); other work shares the machine? Each probe keeps its fastest "
            "round, but the figures may still be slow, and they are flagged noisy: a cache keeps them only "
            "where it has no quiet entry, and hca.calibrate(cache=True) measures again",
            stacklevel=3,
        )
    return cal


def _figures_of(t: dict[str, float], p: _Probes) -> dict[str, float]:
    """The cost model's figures (less call_s and param_s) from the probes' seconds."""
    n = p.n
    reduce_times = [t["all_reduce_64KiB"], t["all_reduce_512KiB"], t["all_reduce_4MiB"]]
    gather_s, reduce_s = t["all_gather_4B"], t["all_reduce_4B"]
    alpha = max(reduce_s - gather_s, 0.0) / max(n - 1, 1)
    wires = [RULES[Kind.ALL_REDUCE].wire_bytes(4 * k, n) for k in p.sizes]
    seconds_per_byte, latency = _line(wires, reduce_times)
    if seconds_per_byte <= 0:  # noise hid the slope: the largest all_reduce, less the 4-byte one
        seconds_per_byte, latency = max(reduce_times[-1] - reduce_s, 1e-9) / wires[-1], reduce_s
    launch = max(latency - alpha * 2 * (n - 1), 0.0)
    # What the same collective costs right after compute, beyond its transfer: the ranks reach
    # it at different times, and the first waits for the last.
    sync = max(t["gather_after_compute"] - gather_s, 0.0)

    def rate(kind: Kind, seconds: float) -> float:
        """Wire bytes per second of `kind` on 4 MiB, less the latency its ring rounds pay."""
        return RULES[kind].wire_bytes(p.big.numel() * 4, n) / max(seconds - launch - alpha * (n - 1), 1e-9)

    half_dim = _half_dim(t["matmul_16_rows"], t["matmul_256_rows"])
    return {
        "launch_s": launch,
        "alpha_s": alpha,
        "bytes_per_s": 1.0 / seconds_per_byte,
        # The MLP's matmuls are 256 wide: its rate over their share of the large matmuls' rate.
        "flops_per_s": p.step_flops / t["mlp_step"] * (256 + half_dim) / 256,
        "matmul_half_dim": half_dim,
        "memory_bytes_per_s": p.copy_bytes / t["copy_16MiB"],
        "op_s": t["op"],
        "sync_s": sync,
        "call_s": 0.0,
        "contention": _share(t["steps_alone"], t["all_reduce_alone"], t["all_reduce_under_steps"]),
        "gather_bytes_per_s": rate(Kind.ALL_GATHER, t["all_gather_4MiB"]),
        "scatter_bytes_per_s": rate(Kind.REDUCE_SCATTER, t["reduce_scatter_4MiB"]),
    }


def _half_dim(small_s: float, large_s: float) -> float:
    """h of the cost model's matmul rate ``d / (d + h)``, from `x @ w` (`w` 512 x 512) at 16 rows
    (`small_s`) and at 256 (`large_s`); 0 where the small one is no slower per FLOP (at most 256)."""
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
        out.copy_(x[start : start + out.shape[0]])
    else:
        dist.reduce_scatter_tensor(out, x)


def _calibrate_and_store() -> Calibration:
    from torch_hca.runtime.mesh import init_mesh

    init_mesh()
    return cached_calibrate(refresh=True)[0]


def calibrate_local(world_size: int = 2) -> str:
    """`python -m torch_hca calibrate`: measure on `world_size` local gloo ranks, cache, and say
    what (and what the cache holds now, where a noisy measurement did not replace it)."""
    from torch_hca.runtime.launch import launch
    from torch_hca.spmd.calibration_cache import CACHE_FILE, cache_dir

    figures = launch(_calibrate_and_store, world_size)[0]
    kept = cached_calibration(world_size, "gloo")
    lines = [f"cost model for {world_size} local gloo ranks, {figures.describe()}, cache {cache_dir() / CACHE_FILE}:"]
    lines += [f"  {k:<20} {v:.4g}" for k, v in figures.items()]
    if figures.noisy:
        lines.append(
            "noisy: the slowest round ran slower than the fastest by "
            + ", ".join(f"{k} {figures.spread[k]:.0%}" for k in JUDGED if k in figures.spread)
            + "; other work shares the machine? Measure again when it is quiet."
        )
        if kept is not None and not kept.noisy:
            lines.append(
                f"not cached: the cache keeps the quiet calibration of {kept.describe()[len('calibrated ') :]}"
            )
    return "\n".join(lines)
