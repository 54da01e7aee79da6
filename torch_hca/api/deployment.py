"""The deployment: which rank is which device, and what each can do (docs/heterogeneous.md).

The third of the design's three artifacts (model, strategy, deployment). A `Deployment` lists,
per rank, its device, its relative ``speed`` (work per second in any unit, the same unit for
every rank) and optionally a memory limit. It is data: written by hand or measured on the ranks
(`Deployment.measure`), saved and loaded as JSON, checked against the world it is used in.

What it decides today: the rows each rank takes of a batch cut by shares (`Deployment.shares`,
the split whose slowest rank finishes first), for ``hca.Shard(0, shares=...)``. A rank's time
is ``fixed_s + rows / speed``: measured at two batch sizes (`measure(..., rows=(a, b))`), the
part of a step that does not shrink with the rows (per-call work, the optimizer step) is known,
and a slow rank, which pays it slowly too, gets fewer rows. The layout solver does not read it
yet (one compute rate for every rank).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from torch_hca.errors import MeshError
from torch_hca.runtime.mesh import rank_device
from torch_hca.spmd.calibration_cache import now_utc
from torch_hca.spmd.shares import rows_by_speed

SCHEMA = "torch_hca.deployment"
VERSION = 2  # 2: a rank's fixed_s; version 1 files (no fixed_s) still load
READS = (1, 2)


@dataclass(frozen=True)
class RankCapacity:
    """One rank: its device (``"cpu"``, ``"cuda:0"``), its relative speed, its memory limit in bytes,
    and the seconds a step costs it whatever its rows (``fixed_s``; with it, ``speed`` is rows per
    second: the deployment's unit is ``"rows/s"``)."""

    device: str
    speed: float
    memory_bytes: int | None = None
    fixed_s: float = 0.0


@dataclass(frozen=True)
class Deployment:
    """Each rank's device and capacity, in rank order."""

    ranks: tuple[RankCapacity, ...]
    unit: str = "relative"  # what `speed` counts: "GFLOP/s" measured by default, or "steps/s"
    measured_at: str | None = None  # when `measure` ran (UTC), None for a hand-written one

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if not self.ranks:
            raise MeshError("hca.Deployment: no ranks; give one RankCapacity per rank of the world")
        for r, cap in enumerate(self.ranks):
            where = f"hca.Deployment: rank {r}"
            if not isinstance(cap, RankCapacity):
                raise MeshError(f"{where} is {type(cap).__name__}; give a RankCapacity(device, speed)")
            try:
                torch.device(cap.device)
            except (RuntimeError, TypeError):
                raise MeshError(
                    f"{where}: device {cap.device!r} is not a torch device; write 'cpu' or 'cuda:0'"
                ) from None
            if isinstance(cap.speed, bool) or not isinstance(cap.speed, (int, float)) or not cap.speed > 0:
                raise MeshError(f"{where}: speed {cap.speed!r}; give a positive number (work per second)")
            if not math.isfinite(cap.speed):
                raise MeshError(f"{where}: speed {cap.speed!r}; give a finite number (work per second)")
            if cap.memory_bytes is not None and (
                isinstance(cap.memory_bytes, bool) or not isinstance(cap.memory_bytes, int) or cap.memory_bytes <= 0
            ):
                raise MeshError(f"{where}: memory_bytes {cap.memory_bytes!r}; give a positive integer, or None")
            if isinstance(cap.fixed_s, bool) or not isinstance(cap.fixed_s, (int, float)) or not cap.fixed_s >= 0:
                raise MeshError(
                    f"{where}: fixed_s {cap.fixed_s!r}; give the seconds a step costs it whatever its rows, >= 0"
                )
            if cap.fixed_s and self.unit != "rows/s":
                raise MeshError(
                    f"{where}: fixed_s {cap.fixed_s!r} with speeds in {self.unit!r}; a fixed time adds to rows / speed "
                    "only where speed counts rows per second: give unit='rows/s' (Deployment.measure(step, rows=...))"
                )

    @property
    def devices(self) -> tuple[str, ...]:
        """Each rank's device, in rank order: ``hca.init_mesh(devices=deployment.devices)``."""
        return tuple(cap.device for cap in self.ranks)

    # ------------------------------------------------------------------ what it decides

    def shares(self, rows: int, ranks: Sequence[int] | None = None, min_rows: int = 2) -> tuple[int, ...]:
        """Each rank's rows of a batch of `rows`, for ``hca.Shard(0, shares=...)``: the split
        whose slowest rank finishes first (`torch_hca.spmd.shares.rows_by_speed`), each rank at
        least `min_rows` (a compiled program specializes a piece of one row).

        ``ranks``: the global ranks along the cut mesh dimension, in mesh order (default: every
        rank, in order, as on a 1-D mesh)."""
        ranks = range(len(self.ranks)) if ranks is None else ranks
        missing = [r for r in ranks if not 0 <= r < len(self.ranks)]
        if missing:
            raise MeshError(f"Deployment.shares: ranks {missing} are not in this deployment of {len(self.ranks)} ranks")
        caps = [self.ranks[r] for r in ranks]
        return rows_by_speed([c.speed for c in caps], rows, min_rows, [c.fixed_s for c in caps])

    def step_s(self, rows: Sequence[int], ranks: Sequence[int] | None = None) -> tuple[float, ...]:
        """Each rank's predicted time for `rows` (one entry per rank of `ranks`): ``fixed_s +
        rows / speed``, in seconds where the unit is rows/s."""
        ranks = range(len(self.ranks)) if ranks is None else ranks
        return tuple(self.ranks[r].fixed_s + n / self.ranks[r].speed for r, n in zip(ranks, rows))

    # ------------------------------------------------------------------ checked against the world

    def check(self, world_size: int | None = None, rank: int | None = None) -> Deployment:
        """This deployment fits the world: one entry per rank, and this rank's device exists here.
        Raises `MeshError` naming the rank and what to change; returns itself."""
        world_size = dist.get_world_size() if world_size is None and dist.is_initialized() else world_size
        rank = dist.get_rank() if rank is None and dist.is_initialized() else rank
        if world_size is not None and world_size != len(self.ranks):
            raise MeshError(
                f"hca.Deployment describes {len(self.ranks)} ranks, the world has {world_size}: "
                "give one RankCapacity per rank (or measure it again on this world: Deployment.measure())"
            )
        if rank is not None:
            device = torch.device(self.ranks[rank].device)
            if device.type == "cuda" and not (
                torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
            ):
                raise MeshError(
                    f"hca.Deployment: rank {rank} is {self.ranks[rank].device}, which this machine does not have "
                    f"({torch.cuda.device_count()} CUDA devices); fix the deployment's device for rank {rank}"
                )
            if device.type not in ("cpu", "cuda"):
                raise MeshError(
                    f"hca.Deployment: rank {rank} is {self.ranks[rank].device}; torch_hca runs on 'cpu' and 'cuda' ranks"
                )
        return self

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "unit": self.unit,
            "measured_at": self.measured_at,
            "ranks": [{"rank": r, **asdict(cap)} for r, cap in enumerate(self.ranks)],
        }

    def save(self, path: str | os.PathLike) -> dict:
        """Write the deployment as JSON; returns what was written."""
        data = self.to_dict()
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "deployment") -> Deployment:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise MeshError(f"{where}: not a torch_hca deployment (schema {SCHEMA!r} expected)")
        if data.get("version") not in READS:
            raise MeshError(f"{where}: version {data.get('version')!r}; this torch_hca reads versions {READS}")
        entries = data.get("ranks")
        if not isinstance(entries, list) or [e.get("rank") if isinstance(e, dict) else None for e in entries] != list(
            range(len(entries or []))
        ):
            raise MeshError(f"{where}: 'ranks' must list ranks 0, 1, ... in order, each a dict")
        try:
            ranks = [
                RankCapacity(e["device"], e["speed"], e.get("memory_bytes"), e.get("fixed_s", 0.0)) for e in entries
            ]
        except KeyError as e:
            raise MeshError(f"{where}: a rank lacks {e}; each rank needs 'device' and 'speed'") from None
        return cls(tuple(ranks), data.get("unit", "relative"), data.get("measured_at"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Deployment:
        """Read a deployment written by `save` (or by hand); a broken file is a `MeshError`."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise MeshError(f"deployment file {os.fspath(path)!r}: {e}") from None
        return cls.from_dict(data, f"deployment file {os.fspath(path)!r}")

    # ------------------------------------------------------------------ measured on the ranks

    @classmethod
    def measure(
        cls,
        step: Callable[..., object] | None = None,
        rounds: int = 5,
        unit: str | None = None,
        rows: tuple[int, int] | None = None,
    ) -> Deployment:
        """Every rank measures its own speed, at once (as in training: the ranks share the
        machine's cores, links and memory), and every rank returns the same deployment.

        ``step``: the work to time (a training step on a fixed batch); its speed is steps per
        second. By default: a chain of 256 x 256 matmuls on this rank's device, in GFLOP/s.
        ``rows=(a, b)``: ``step(n)`` takes a batch of ``n`` rows; each rank times it at ``a`` and at
        ``b`` rows and keeps the line through them, ``fixed_s + n / speed`` (speed in rows/s, the
        fixed part at least 0 and at most 90% of the step at ``b`` rows, whatever the noise). Each rank keeps its median of `rounds` timings (one warm-up
        first). Collective: call it on every rank of the default process group.
        """
        if not dist.is_initialized():
            raise MeshError("Deployment.measure: no process group; call it on every rank (hca.init_mesh first)")
        if rounds < 1:
            raise MeshError(f"Deployment.measure: rounds={rounds}; give at least 1")
        if rows is not None:
            return cls._measure_line(step, rounds, rows)
        work, flops = (step, None) if step is not None else _matmul_work()
        seconds = _median_seconds(work, rounds)
        speed = (flops / 1e9 if flops else 1.0) / max(seconds, 1e-9)
        every = _every({"device": str(rank_device()), "speed": speed})
        return cls(
            tuple(RankCapacity(e["device"], e["speed"]) for e in every),
            unit or ("steps/s" if step is not None else "GFLOP/s"),
            now_utc(),
        )

    @classmethod
    def _measure_line(cls, step: Callable[[int], object] | None, rounds: int, rows: tuple[int, int]) -> Deployment:
        if step is None or len(rows) != 2 or not 0 < rows[0] < rows[1]:
            raise MeshError(
                f"Deployment.measure: rows={rows!r}; give step(n), a step on n rows, and two batch sizes a < b "
                "to time it at"
            )
        small, large = (_median_seconds(lambda n=n: step(n), rounds) for n in rows)
        # Noise can make the line flat or fall where rows cost little: a row is taken to cost at
        # least a tenth of the larger batch's average row, so at most 90% of a step is fixed.
        per_row = max((large - small) / (rows[1] - rows[0]), large / rows[1] / 10)
        fixed = max(small - rows[0] * per_row, 0.0)
        every = _every({"device": str(rank_device()), "speed": 1.0 / per_row, "fixed_s": fixed})
        return cls(tuple(RankCapacity(e["device"], e["speed"], None, e["fixed_s"]) for e in every), "rows/s", now_utc())


def _median_seconds(work: Callable[[], object], rounds: int) -> float:
    """The median of `rounds` timings of `work` (after one warm-up), every rank starting each at once."""
    work()
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _every(mine: dict) -> list[dict]:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _matmul_work(n: int = 256, chain: int = 16) -> tuple[Callable[[], None], float]:
    device = rank_device()
    a, w = torch.randn(n, n, device=device), torch.randn(n, n, device=device) / n**0.5

    def work():
        x = a
        for _ in range(chain):
            x = x @ w
        if device.type == "cuda":
            torch.cuda.synchronize()

    return work, 2.0 * n**3 * chain
