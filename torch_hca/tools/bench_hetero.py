"""`python -m torch_hca bench --hetero`: data parallelism on ranks of unequal speed (docs/heterogeneous.md).

Two local gloo ranks, one torch thread each. Rank 1 is made `k` times slower than
rank 0 for k in `HeteroConfig.ks`: on rank 1, between each step's forward and its
backward (after the forward's input check, before the backward's gradient
all-reduces), the rank sleeps ``(k - 1)`` times the CPU time its own forward and
backward took in its previous step (`time.thread_time`: it excludes the waits in the
collectives and the time the OS gave to other processes). The slowdown so scales with
the rows that rank holds and leaves the other core alone; rank 0 never sleeps.

For each k, in one run and in alternating rounds (every contestant compiled first, so
that the timed part runs in one stretch), four contestants take the same training step
(forward, backward, SGD step) on the same global batch:

- ``whole``: each rank trains a plain copy on the whole batch at speed 1, both ranks at
  once, no communication (`torch.compile(backend="aot_eager")`, the FX program run
  eagerly as hca's default ``inner="eager"`` runs its own). Its median step, over both
  ranks, is ``W``;
- ``whole_k``: the same with rank 1 slowed; its forward + sleep + backward over rank
  0's, on the same rows, is the k actually got (``k_measured``). Not run at k=1;
- ``even``: `hca.sharded({}, inputs=Shard(0), outputs=Shard(0), loss_reduction="mean")`,
  half the rows each;
- ``shares``: the batch cut by the shares of a deployment measured on the ranks
  (`hca.Deployment.measure` timing each rank's ``whole_k`` step on the whole batch and on half
  of it, at once: a fixed part and rows per second per rank; then `Deployment.shares`: the
  split whose slowest rank finishes first), with
  `hca.Shard(0, shares=...)`. `pick_shares`, the split balanced for the k asked, is printed
  beside it for reference.

The balanced bound is ``T = W / (1 + 1/k_measured)``: the whole batch's time shared
by the two speeds with nothing lost. Per k the table gives both step times (medians
of the slowest rank's, each step started after a barrier), the bound, shares over the
bound and even over shares; `goals` reads them against the issue's goals.
"""

from __future__ import annotations

import collections
import copy
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch_hca.spmd.shares import rows_by_speed

from .bench_hetero_tables import FAST, SLOW, breakdown, breakdown_table, goals, summarize, table
from .progress import Progress

WORLD = 2
RECENT = 5  # the slow rank sleeps (k - 1) x the median of its last RECENT passes' CPU time
MEASURE_ROUNDS = 5  # whole-batch steps each rank times for the deployment its shares come from


@dataclass(frozen=True)
class HeteroConfig:
    ks: tuple = (1.0, 1.5, 2.0, 3.0)
    batch: int = 24  # global rows per step
    seq: int = 64  # tokens per row: compute grows with them, the gradients' all-reduce does not
    dim: int = 128
    hidden: int = 512
    layers: int = 2
    rounds: int = 9  # alternating rounds per k
    steps: int = 4  # timed steps per contestant and round

    @classmethod
    def tiny(cls) -> HeteroConfig:
        return cls(ks=(1.0, 2.0), batch=8, seq=4, dim=16, hidden=32, layers=1, rounds=2, steps=2)


# ------------------------------------------------------------ the split and the arithmetic (no ranks)


def pick_shares(k: float, batch: int, min_rows: int = 2) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shares and rows, in rank order (fast rank 0, slow rank 1), of `batch` rows for a rank 1
    `k` times slower than rank 0: the legal split (each rank at least `min_rows`; rows in
    exact proportion to the shares) whose slower side, ``max(rows0, k * rows1)``, is least;
    among equals, rank 1's rows nearest ``batch / (1 + k)``."""
    if not k > 0 or batch < 2 * min_rows:
        raise ValueError(f"pick_shares: k={k!r} must be > 0 and batch={batch} at least {2 * min_rows}")
    ideal = batch / (1 + k)
    slow = min(range(min_rows, batch - min_rows + 1), key=lambda r: (max(batch - r, k * r), abs(r - ideal)))
    g = math.gcd(batch - slow, slow)
    return ((batch - slow) // g, slow // g), (batch - slow, slow)


def _model(cfg: HeteroConfig) -> nn.Module:
    layers = []
    for _ in range(cfg.layers):
        layers += [nn.Linear(cfg.dim, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, cfg.dim)]
    return nn.Sequential(*layers)


class _Contestant:
    """One contestant's model, optimizer and rows on this rank; `slowed`: rank 1 runs at 1/k."""

    def __init__(self, name: str, model: nn.Module, run, rows: tuple, rank: int, slowed: bool = True):
        self.name, self.model, self.run, self.slowed = name, model, run, slowed
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        whole = name.startswith("whole")
        self.start = 0 if whole else sum(rows[:rank])
        self.rows = sum(rows) if whole else rows[rank]
        # The CPU times of this rank's last forward + backward passes: the sleep follows their
        # median, so that one slow pass (a collection, a page fault storm) does not echo in the next.
        self.recent: collections.deque = collections.deque(maxlen=RECENT)

    def step(self, x: torch.Tensor, y: torch.Tensor, k: float) -> dict:
        """One training step at `k` times this rank's own time; returns its seconds: ``step``
        (to the end of the optimizer step), ``compute`` (forward + sleep + backward, wall clock),
        ``cpu`` (forward + backward, this thread's CPU time) and ``slept``."""
        x, y = x[self.start : self.start + self.rows], y[self.start : self.start + self.rows]
        t0 = time.perf_counter()
        c0 = time.thread_time()
        loss = F.mse_loss(self.run(x), y)
        c1 = time.thread_time()
        # After the forward's input check, before the backward's gradient all-reduces: the
        # other rank waits for this sleep where it would wait for a slower device's compute.
        t_sleep = time.perf_counter()
        if k > 1 and self.recent:
            time.sleep((k - 1) * statistics.median(self.recent))
        slept = time.perf_counter() - t_sleep
        c2 = time.thread_time()
        loss.backward()
        c3 = time.thread_time()
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.recent.append((c1 - c0) + (c3 - c2))
        return {"step": time.perf_counter() - t0, "compute": t1 - t0, "cpu": self.recent[-1], "slept": slept}

    def timed(self, batches: list, k: float, into: dict) -> None:
        k = k if self.slowed else 1.0
        for x, y in batches:
            dist.barrier()
            for key, seconds in self.step(x, y, k).items():
                into.setdefault(key, []).append(seconds)


def _contestants(cfg: HeteroConfig, ref: nn.Module, mesh, rank: int) -> dict:
    """The contestants every k shares: the whole batch on each rank (at speed 1, and with rank 1
    slowed: one compiled copy, two optimizers), and the even split."""
    import torch_hca as hca

    even_rows = (cfg.batch // WORLD,) * WORLD
    one = copy.deepcopy(ref)
    run = torch.compile(one, backend="aot_eager")
    even = hca.sharded({}, mesh=mesh, inputs=hca.Shard(0), outputs=hca.Shard(0), loss_reduction="mean")(
        copy.deepcopy(ref)
    )
    return {
        "whole": _Contestant("whole", one, run, even_rows, rank, slowed=False),
        "whole_k": _Contestant("whole_k", one, run, even_rows, rank),
        "even": _Contestant("even", even, torch.compile(even, backend="hca"), even_rows, rank),
    }


def _measured_shares(cfg: HeteroConfig, whole_k: _Contestant, batches: list, k_here: float) -> dict:
    """The rows a deployment measured on the ranks gives each: every rank times its whole-batch
    step at its own speed (rank 1 slowed), at once, on the whole batch and on half of it; the line
    through the two (a fixed part and rows per second); the split whose slowest rank finishes first."""
    from torch_hca.api.deployment import Deployment

    x, y = batches[0]
    half = cfg.batch // 2
    # Its own contestant (the same compiled copy): the sleep follows the CPU times of its own size.
    halves = _Contestant("whole_k", whole_k.model, whole_k.run, (half - half // 2, half // 2), dist.get_rank())
    by_rows = {cfg.batch: whole_k, half: halves}
    dep = Deployment.measure(
        step=lambda n: by_rows[n].step(x, y, k_here), rounds=MEASURE_ROUNDS, rows=(half, cfg.batch)
    )
    rows = dep.shares(cfg.batch)
    g = math.gcd(*rows)
    return {
        "shares": tuple(r // g for r in rows),
        "rows": rows,
        "speeds": [r.speed for r in dep.ranks],
        "fixed_s": [r.fixed_s for r in dep.ranks],
        "rows_by_speeds_alone": rows_by_speed([r.speed for r in dep.ranks], cfg.batch),
    }


def _by_shares(cfg: HeteroConfig, ref: nn.Module, mesh, rank: int, shares: tuple, rows: tuple) -> _Contestant:
    import torch_hca as hca

    cut = hca.Shard(0, shares=shares)
    model = hca.sharded({}, mesh=mesh, inputs=cut, outputs=cut, loss_reduction="mean")(copy.deepcopy(ref))
    return _Contestant("shares", model, torch.compile(model, backend="hca"), rows, rank)


def _warm(entries: dict, names: list, batches: list, k_here: float) -> None:
    """Each contestant's untimed steps (the first ever compiles; the rest prime the slowdown)."""
    for name in names:
        for x, y in batches[:2]:
            dist.barrier()
            entries[name].step(x, y, k_here if entries[name].slowed else 1.0)


def _one_k(cfg: HeteroConfig, k: float, entries: dict, batches: list, progress: Progress) -> dict:
    """Every contestant's timed rounds at `k`, alternating; this rank's raw timings."""
    k_here = k if dist.get_rank() == SLOW else 1.0
    names = [n for n in entries if n != "whole_k" or k != 1]  # at k=1 the whole batch is slowed by nothing
    _warm(entries, names, batches, k_here)
    times = {name: {} for name in names}
    progress(f"k={k:g}: {cfg.rounds} rounds of {', '.join(names)}")
    for r in range(cfg.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each contestant first in turn
            entries[name].timed(batches[2 : 2 + cfg.steps], k_here, times[name])
    return times


def run_rank(cfg: HeteroConfig, since: float | None = None) -> dict:
    """This rank's raw timings for every k (`summarize` reads them in the launcher). Every
    contestant is compiled first, so that the timed part runs in one stretch."""
    from torch_hca.runtime.mesh import init_mesh

    mesh = init_mesh()
    rank = dist.get_rank()
    progress = Progress("bench --hetero", since, enabled=rank == 0)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref = _model(cfg)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=gen),
            torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=gen),
        )
        for _ in range(2 + cfg.steps)
    ]
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=4 * len(cfg.ks) + 8):
        common = _contestants(cfg, ref, mesh, rank)
        by_k, picked = {}, {}
        for k in cfg.ks:
            k_here = k if rank == SLOW else 1.0
            _warm(common, ["whole_k"], batches, k_here)  # compiled, and its slowdown primed
            picked[k] = _measured_shares(cfg, common["whole_k"], batches, k_here)
            shares, rows = picked[k]["shares"], picked[k]["rows"]
            progress(f"compiling: whole batch, even and shares {':'.join(map(str, shares))} (k={k:g}, measured) ...")
            by_k[k] = {**common, "shares": _by_shares(cfg, ref, mesh, rank, shares, rows)}
            _warm(by_k[k], list(by_k[k]), batches, 1.0)
            for c in by_k[k].values():
                c.recent.clear()  # compiling is no part of the step
        progress("timing ...")
        return {"picked": picked, "times": {k: _one_k(cfg, k, by_k[k], batches, progress) for k in cfg.ks}}


# ------------------------------------------------------------ the command


def _cpu_seconds() -> tuple | None:
    """(wall, CPU seconds the machine was busy, CPU seconds of this process and its waited-for
    children) now; None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    t = os.times()
    busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    return time.time(), busy, t.user + t.system + t.children_user + t.children_system


def _others_cores(before: tuple | None, after: tuple | None) -> float | None:
    """Cores other processes kept busy on average between `before` and `after` (`_cpu_seconds`)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return max(((after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0]), 0.0)


def main(json_path: str | None = None, tiny: bool = False, rounds: int | None = None, batch: int | None = None) -> int:
    from torch_hca.runtime.launch import launch

    cfg = HeteroConfig.tiny() if tiny else HeteroConfig()
    if rounds:
        cfg = HeteroConfig(**{**asdict(cfg), "rounds": rounds})
    if batch:  # more rows a step: the compute grows, data parallelism's fixed costs do not
        cfg = HeteroConfig(**{**asdict(cfg), "batch": batch})
    load = os.getloadavg()
    print(
        f"torch_hca bench --hetero: rank 1 k times slower (sleeps (k-1) x the median CPU time of its last "
        f"{RECENT} forward+backward passes), "
        f"k in {', '.join(f'{k:g}' for k in cfg.ks)}; MLP {cfg.layers} x ({cfg.dim}->{cfg.hidden}->{cfg.dim}) "
        f"on a batch of {cfg.batch} x {cfg.seq} tokens{' (tiny: a smoke test, not a measurement)' if tiny else ''}; "
        f"{cfg.rounds} rounds x {cfg.steps} steps; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n",
        flush=True,
    )
    progress = Progress("bench --hetero")
    progress(f"starting {WORLD} local gloo ranks")
    before = _cpu_seconds()
    results = launch(run_rank, WORLD, cfg, progress.since, timeout_s=600.0)
    others = _others_cores(before, _cpu_seconds())
    picked, per_rank = results[0]["picked"], [r["times"] for r in results]
    by_contestant = lambda k: {c: [per_rank[r][k][c] for r in range(WORLD)] for c in per_rank[0][k]}
    rows = [summarize(k, picked[k]["shares"], picked[k]["rows"], by_contestant(k)) for k in cfg.ks]
    progress("done")
    parts = [p for k in cfg.ks for p in breakdown(k, by_contestant(k))]
    after = os.getloadavg()
    print(table(rows))
    print(
        "\nshares from the deployment measured on the ranks (each rank's step on the whole batch and on half "
        "of it, at once: a fixed part and rows per second):"
    )
    for k in cfg.ks:
        p, hand = picked[k], pick_shares(k, cfg.batch)[1]
        speeds, fixed = p["speeds"], p["fixed_s"]
        print(
            f"k={k:g}: {speeds[FAST]:.0f} : {speeds[SLOW]:.0f} rows/s (k measured {speeds[FAST] / speeds[SLOW]:.2f}), "
            f"fixed {1e3 * fixed[FAST]:.1f} : {1e3 * fixed[SLOW]:.1f} ms -> rows {':'.join(map(str, p['rows']))}; "
            f"by the speeds alone {':'.join(map(str, p['rows_by_speeds_alone']))}; "
            f"balanced for the k asked: {':'.join(map(str, hand))}"
        )
    print('\ngoals (docs/heterogeneous.md, "Measuring heterogeneity here"):')
    print("\n".join(goals(rows)))
    print("\nwhere the steps go (medians):")
    print(breakdown_table(parts))
    busy = "not measured" if others is None else f"{others:.2f} cores on average"
    print(
        f"\nother processes during the run: {busy}; load average before {load[0]:.2f}, after {after[0]:.2f} "
        f"(1 min) on {os.cpu_count()} cores"
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "config": asdict(cfg),
                    "load_average_before": load,
                    "load_average_after": after,
                    "others_cores": others,
                    "rows": rows,
                    "breakdown": parts,
                    "measured_shares": {f"{k:g}": picked[k] for k in cfg.ks},
                    "raw": {f"{k:g}": [per_rank[r][k] for r in range(WORLD)] for k in cfg.ks},
                },
                f,
                indent=2,
            )
        print(f"wrote {os.path.abspath(json_path)}")
    return 0
