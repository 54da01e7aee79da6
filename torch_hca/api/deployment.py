"""The deployment: which rank is which device, and what each can do (docs/heterogeneous.md).

The third of the design's three artifacts (model, strategy, deployment). A `Deployment` lists,
per rank, its device, its relative ``speed`` (work per second in any unit, the same unit for
every rank) and optionally a memory limit. It is data: written by hand or measured on the ranks
(`Deployment.measure`), saved and loaded as JSON, checked against the world it is used in.

What it decides today: the rows each rank takes of a batch cut by shares (`Deployment.shares`,
the split whose slowest rank finishes first), for ``hca.Shard(0, shares=...)``. The layout
solver does not read it yet (one compute rate for every rank).
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
VERSION = 1


@dataclass(frozen=True)
class RankCapacity:
    """One rank: its device (``"cpu"``, ``"cuda:0"``), its relative speed, its memory limit in bytes."""

    device: str
    speed: float
    memory_bytes: int | None = None


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
        return rows_by_speed([self.ranks[r].speed for r in ranks], rows, min_rows)

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
        if data.get("version") != VERSION:
            raise MeshError(f"{where}: version {data.get('version')!r}; this torch_hca reads version {VERSION}")
        entries = data.get("ranks")
        if not isinstance(entries, list) or [e.get("rank") if isinstance(e, dict) else None for e in entries] != list(
            range(len(entries or []))
        ):
            raise MeshError(f"{where}: 'ranks' must list ranks 0, 1, ... in order, each a dict")
        try:
            ranks = [RankCapacity(e["device"], e["speed"], e.get("memory_bytes")) for e in entries]
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
    def measure(cls, step: Callable[[], object] | None = None, rounds: int = 5, unit: str | None = None) -> Deployment:
        """Every rank measures its own speed, at once (as in training: the ranks share the
        machine's cores, links and memory), and every rank returns the same deployment.

        ``step``: the work to time (a training step on a fixed batch); its speed is steps per
        second. By default: a chain of 256 x 256 matmuls on this rank's device, in GFLOP/s.
        Each rank keeps its median of `rounds` timings (one warm-up first). Collective: call it
        on every rank of the default process group.
        """
        if not dist.is_initialized():
            raise MeshError("Deployment.measure: no process group; call it on every rank (hca.init_mesh first)")
        if rounds < 1:
            raise MeshError(f"Deployment.measure: rounds={rounds}; give at least 1")
        work, flops = (step, None) if step is not None else _matmul_work()
        work()
        times = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        speed = (flops / 1e9 if flops else 1.0) / max(seconds, 1e-9)
        mine = {"device": str(rank_device()), "speed": speed}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return cls(
            tuple(RankCapacity(e["device"], e["speed"]) for e in every),
            unit or ("steps/s" if step is not None else "GFLOP/s"),
            now_utc(),
        )


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
