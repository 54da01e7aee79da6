"""One cost model for the layout solver and the timeline: alpha-beta communication, roofline compute.

A collective of kind k on a payload of S bytes over n ranks costs

    launch + sync + alpha * steps(k, n) + wire_bytes(k, S, n) / bandwidth

where ``wire_bytes`` is the ring model of `collective_kinds` (what one rank
sends) and ``steps`` the number of ring rounds. ``sync`` is what a collective
inside a step pays on top of its transfer: the ranks reach it apart after
compute, and the first waits for the last (work issued meanwhile hides it,
like the transfer; bucketing does not save it, so the bucket size ignores it). An op costs
``max(flops / flops_per_s, bytes touched / memory_bytes_per_s)``, and the host
``op_s`` to issue it (Python, FX, the dispatcher: what a small op costs). Each call
of a compiled graph also costs ``call_s`` of host time beyond its ops (Dynamo's
guards, the runtime wrappers, the input check, the autograd engine's node), and
``param_s`` per DTensor parameter the graph reads (AOTAutograd unwraps each
into its local tensor and wraps each gradient back into a DTensor, the autograd
engine accumulates it, Dynamo guards it).

The defaults are rough figures for the two transports torch_hca targets;
calibrate them for a cluster with ``options={"cost_model": {...}}``. An all_gather and
a reduce_scatter use their own wire rates where set (gloo has no reduce-scatter of its
own; the emitter runs one as an all_reduce, which sends twice the ring's bytes):

| field              | gloo (CPU, TCP) | nccl (GPU)  |
|--------------------|-----------------|-------------|
| launch_s           | 50e-6           | 10e-6       |
| alpha_s            | 20e-6           | 5e-6        |
| bytes_per_s        | 1e9             | 50e9        |
| flops_per_s        | 20e9            | 50e12       |
| memory_bytes_per_s | 10e9            | 3e12        |
| op_s               | 5e-6            | 5e-6        |
| sync_s             | 0               | 0           |
| call_s             | 0               | 0           |
| param_s            | 0               | 0           |
| gather_bytes_per_s | 0 (bytes_per_s) | 0           |
| scatter_bytes_per_s| 0.5e9           | 0           |
| contention         | 0               | 0           |
| matmul_half_dim    | 0               | 0           |

``matmul_half_dim`` (h, default 0: off) makes a matmul's rate grow with its smallest
dimension d (rows, reduction or output width, this rank's piece): ``flops_per_s * d / (d + h)``,
so ``flops_per_s`` is the rate of large matmuls. On one core of the 2-core VM `x @ w` with
`w` 512 x 512 ran at 48, 73, 84 and 91 GFLOP/s at 8, 32, 64 and 128 rows (h about 8):
splitting a batch of 64 rows over two ranks does not halve each one's matmul time.

``contention`` is for the timeline: while a collective runs, compute runs at
``1 - contention`` of its speed (`torch_hca.report.timeline`). Calibration measures it:
0.35 to 0.76 between runs on a 2-core VM with two gloo ranks of one thread each.

Figures measured once per machine are kept on disk: ``hca.calibrate(cache=True)``
(or ``python -m torch_hca calibrate``) stores them in ``calibration.json`` under
`cache_dir()`, keyed by (host, world size, backend, torch version), and
`cached_calibration()` reads them back. Each entry records when it was measured and
whether it was noisy (its rounds disagreed: other work shared the machine); a noisy
calibration never replaces a quiet one. The compiler starts from an entry when this
host has one for the process group it compiles on (`base_model`; its source, which
every compile log names, says when it was measured and whether it was noisy), else from
the defaults; ``options={"cost_model": {...}}`` overrides fields of either.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import numbers
import os
import socket
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .collective_kinds import RULES, Kind
from ..errors import HCAError, OptionsError


def ring_steps(kind: Kind, n: int) -> int:
    """Rounds of a ring implementation of `kind` over `n` ranks (0 for local kinds)."""
    if n <= 1 or not RULES[kind].communicates:
        return 0
    if kind in (Kind.ALL_REDUCE, Kind.SCALED_ALL_REDUCE, Kind.WEIGHTED_ALL_REDUCE):
        return 2 * (n - 1)
    if kind is Kind.PERMUTE:
        return 1
    return n - 1


@dataclass(frozen=True)
class CostModel:
    launch_s: float
    alpha_s: float
    bytes_per_s: float
    flops_per_s: float
    memory_bytes_per_s: float
    op_s: float = 5e-6  # host seconds to issue one op of the program
    sync_s: float = 0.0  # seconds a collective after compute waits for the slowest rank
    call_s: float = 0.0  # host seconds one call of a compiled graph costs beyond its ops
    param_s: float = 0.0  # and per DTensor parameter it reads (unwrapped, its gradient wrapped and accumulated)
    # The all_gather's and reduce_scatter's own wire rates where the transport's differ from the
    # all_reduce's (0: bytes_per_s). gloo has no reduce-scatter: it runs as an all_reduce.
    gather_bytes_per_s: float = 0.0
    scatter_bytes_per_s: float = 0.0
    # The share of its own time a collective takes from compute while both run: the transport's
    # threads use the cores compute runs on (1: no core to spare, overlap hides nothing; 0: none).
    contention: float = 0.0
    # The smallest matmul dimension at which a matmul runs at half of flops_per_s (0: the rate
    # does not depend on the shape). Small pieces of a split batch run below the peak rate.
    matmul_half_dim: float = 0.0

    def collective_s(self, kind: Kind, payload_bytes: float, n: int) -> float:
        """Seconds for one collective of `kind` on `payload_bytes` over `n` ranks."""
        steps = ring_steps(kind, n)
        if steps == 0:
            return 0.0
        return self.launch_s + self.sync_s + self.alpha_s * steps + self.bandwidth_s(kind, payload_bytes, n)

    def bandwidth_s(self, kind: Kind, payload_bytes: float, n: int) -> float:
        """The bandwidth term alone: a collective merged into a bucket shares its latency."""
        if ring_steps(kind, n) == 0:
            return 0.0
        own = {Kind.ALL_GATHER: self.gather_bytes_per_s, Kind.REDUCE_SCATTER: self.scatter_bytes_per_s}.get(kind)
        return RULES[kind].wire_bytes(payload_bytes, n) / (own or self.bytes_per_s)

    def compute_s(self, flops: float, bytes_touched: float, smallest_dim: float | None = None) -> float:
        """Seconds for one op: the slower of its arithmetic and its memory traffic; a matmul
        gives its smallest dimension (this rank's piece), whose rate `matmul_efficiency` scales."""
        rate = self.flops_per_s * self.matmul_efficiency(smallest_dim)
        return max(flops / rate, bytes_touched / self.memory_bytes_per_s)

    def matmul_efficiency(self, smallest_dim: float | None) -> float:
        """The share of `flops_per_s` a matmul whose smallest dimension is `smallest_dim` runs at."""
        if not self.matmul_half_dim or not smallest_dim or smallest_dim <= 0:
            return 1.0
        return smallest_dim / (smallest_dim + self.matmul_half_dim)

    def bucket_cap_bytes(self, n: int, latency_share: float = 0.1) -> float:
        """The bucket size whose all_reduce spends `latency_share` of its time on latency.

        Smaller buckets start earlier and hide behind more compute; larger ones
        pay the per-collective latency fewer times. At 10% latency the gloo
        defaults give about 1 MiB at 4 ranks, the nccl ones about 20 MiB at 8
        (DDP's fixed default is 25 MiB).
        """
        if n <= 1:
            return float("inf")
        # Merging saves transfers' latency, not the ranks' wait for each other (sync_s).
        latency = self.launch_s + self.alpha_s * ring_steps(Kind.ALL_REDUCE, n)
        wire_per_byte = RULES[Kind.ALL_REDUCE].wire_bytes(1.0, n)
        return latency * (1 - latency_share) / latency_share * self.bytes_per_s / wire_per_byte

    def with_communication_scaled(self, factor: float) -> "CostModel":
        """This model with every collective `factor` times as slow (latencies times it, rates
        over it) and compute as it is: the machine as a calibration off by `factor` would see it."""
        return dataclasses.replace(
            self, launch_s=self.launch_s * factor, alpha_s=self.alpha_s * factor, sync_s=self.sync_s * factor,
            bytes_per_s=self.bytes_per_s / factor, gather_bytes_per_s=self.gather_bytes_per_s / factor,
            scatter_bytes_per_s=self.scatter_bytes_per_s / factor)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def smallest_matmul_dim(first: Sequence[int], out: Sequence[int], against_weight: bool) -> float:
    """The smallest of a matmul's rows, reduction (its first operand's last dimension) and
    output width: what `CostModel.matmul_efficiency` reads. Against a 2-D weight (F.linear,
    x @ w) every leading dimension of the output is a row; a batched matmul's rows are its own."""
    rows = math.prod(out[:-1]) if against_weight else (out[-2] if len(out) >= 2 else 1)
    return float(min(rows, first[-1], out[-1]))


DEFAULTS: dict[str, CostModel] = {
    "gloo": CostModel(launch_s=50e-6, alpha_s=20e-6, bytes_per_s=1e9, flops_per_s=20e9, memory_bytes_per_s=10e9,
                      op_s=5e-6, scatter_bytes_per_s=0.5e9),  # an all_reduce: twice the ring's wire bytes
    "nccl": CostModel(launch_s=10e-6, alpha_s=5e-6, bytes_per_s=50e9, flops_per_s=50e12, memory_bytes_per_s=3e12,
                      op_s=5e-6),
}


def backend_for(device_type: str) -> str:
    """The transport a mesh on `device_type` uses: NCCL on CUDA, gloo otherwise."""
    return "nccl" if device_type == "cuda" else "gloo"


def scatter_runs_as_all_reduce(backend: str, device_type: str) -> bool:
    """Whether a sum's reduce_scatter of `device_type` tensors on a group of `backend` (a process
    group's backend string, e.g. "gloo" or "cpu:gloo,cuda:nccl") runs as an all_reduce of its
    input: gloo has no reduce-scatter of its own, so the emitter runs one that way
    (`backends/emit.py`), and the calibration and the bench's byte count follow it."""
    return device_type == "cpu" and "gloo" in backend


def cost_model(backend: str, overrides: Mapping[str, Any] | None = None) -> CostModel:
    """The default model for `backend` ("gloo" or "nccl") with `overrides` applied."""
    if backend not in DEFAULTS:
        raise OptionsError(f"cost model: unknown backend {backend!r}; use one of {sorted(DEFAULTS)}")
    return with_overrides(DEFAULTS[backend], overrides)


def base_model(backend: str) -> tuple[CostModel, str]:
    """The model the compiler starts from, and where it came from: this host's cached
    calibration for the current process group ("calibrated 2026-12-03 06:10 UTC (cache
    <file>)", with ", noisy" where its rounds disagreed), else the defaults ("defaults (not
    measured)").

    Each rank reads its own host's file: ranks on hosts with different entries would
    solve differently, which the first call's agreement check reports by rank.
    """
    import torch.distributed as dist

    if backend not in DEFAULTS:
        raise OptionsError(f"cost model: unknown backend {backend!r}; use one of {sorted(DEFAULTS)}")
    if dist.is_initialized() and str(dist.get_backend()) == backend:
        found = cached_calibration()
        if found is not None:
            return CostModel(**found), f"{found.describe()} (cache {cache_dir() / CACHE_FILE})"
    return DEFAULTS[backend], "defaults (not measured)"


def with_overrides(model: CostModel, overrides: Mapping[str, Any] | None) -> CostModel:
    if not overrides:
        return model
    fields = {f.name for f in dataclasses.fields(CostModel)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise OptionsError(f"options['cost_model']: unknown field(s) {unknown}; the fields are {sorted(fields)}")
    for key, value in overrides.items():
        # Latencies may be 0, and the kinds' own rates (0: bytes_per_s); other rates may not.
        may_be_zero = key in ("launch_s", "alpha_s", "op_s", "sync_s", "call_s", "param_s", "gather_bytes_per_s",
                              "scatter_bytes_per_s", "contention", "matmul_half_dim")
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
                or value < 0 or (value == 0 and not may_be_zero)):
            raise OptionsError(
                f"options['cost_model'][{key!r}] = {value!r}; give a finite number "
                f"{'>= 0' if may_be_zero else '> 0'}" + ("" if may_be_zero else " (a huge one, e.g. 1e15, makes it free)")
            )
        if key == "contention" and value > 1:
            raise OptionsError(f"options['cost_model']['contention'] = {value!r}; give a share from 0 to 1 "
                               "(1: compute stops while a collective runs)")
    return dataclasses.replace(model, **{k: float(v) for k, v in overrides.items()})


# ------------------------------------------------------------ calibration cache
# One JSON file of entries {host, world_size, backend, torch, figures, measured_at, noisy,
# spread}; an entry is used only when all four keys match. A file that cannot be read is
# ignored with a warning (and replaced by the next store), never an error.

CACHE_FILE = "calibration.json"
_KEY = ("host", "world_size", "backend", "torch")


class Calibration(dict):
    """Measured figures: a dict of the cost model's fields (what ``options={"cost_model": ...}``
    takes), and how far to trust them.

    measured_at: when, in UTC (ISO 8601, to the second); noisy: whether the measurement's
    rounds disagreed beyond the threshold (other work shared the machine: the figures may be
    slow); spread: per probe of `hca.calibrate`, how much slower its slowest round ran than
    its fastest (0.5: 50% slower).
    """

    def __init__(self, figures: Mapping[str, float], measured_at: str | None = None, noisy: bool = False,
                 spread: Mapping[str, float] | None = None):
        super().__init__(figures)
        self.measured_at = measured_at or now_utc()
        self.noisy = bool(noisy)
        self.spread = dict(spread or {})

    def describe(self) -> str:
        """"calibrated 2026-12-03 06:10 UTC", with ", noisy" where it was."""
        return f"calibrated {when(self.measured_at)}" + (", noisy" if self.noisy else "")

    def __repr__(self) -> str:
        return f"Calibration({dict(self)!r}, measured_at={self.measured_at!r}, noisy={self.noisy})"


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def when(measured_at: str) -> str:
    """An ISO 8601 time as a log reads it: "2026-12-03 06:10 UTC" (unchanged when it is not one)."""
    try:
        t = datetime.datetime.fromisoformat(measured_at)
    except (TypeError, ValueError):
        return str(measured_at)
    if t.tzinfo is not None:
        t = t.astimezone(datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M UTC")


def cache_dir() -> Path:
    """$TORCH_HCA_CACHE_DIR, else $XDG_CACHE_HOME/torch_hca, else ~/.cache/torch_hca."""
    if os.environ.get("TORCH_HCA_CACHE_DIR"):
        return Path(os.environ["TORCH_HCA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_hca"


def calibration_key(world_size: int | None = None, backend: str | None = None) -> dict[str, Any]:
    """This process's key: host name, world size and backend (from the process group when not
    given), torch version."""
    import torch
    import torch.distributed as dist

    if world_size is None or backend is None:
        if not dist.is_initialized():
            raise HCAError("calibration cache: no process group to read the world size and backend from; "
                           "pass world_size= and backend= (e.g. 2, 'gloo') or call hca.init_mesh() first")
        world_size = dist.get_world_size() if world_size is None else world_size
        backend = str(dist.get_backend()) if backend is None else backend
    return {"host": socket.gethostname(), "world_size": int(world_size), "backend": backend,
            "torch": torch.__version__}


def _read_entries(path: Path) -> list[dict]:
    """The file's entries; [] when it is missing, with a warning when it cannot be used."""
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("'entries' is not a list of objects")
        return entries
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"torch_hca: ignoring the calibration cache {path} ({type(e).__name__}: {e}); "
                      "hca.calibrate(cache=True, refresh=True) measures again and rewrites it", stacklevel=3)
        return []


def _valid_figures(figures: Any) -> dict[str, float]:
    """The cached figures, checked; a field added since they were measured takes its default
    (a calibration from an older torch_hca stays usable; refreshing it measures the new one)."""
    fields = dataclasses.fields(CostModel)
    names = [f.name for f in fields]
    later = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    if not isinstance(figures, Mapping) or not set(names) - set(later) <= set(figures) <= set(names):
        raise ValueError(f"figures {figures!r} do not name exactly the fields {names}")
    figures = {**{k: v for k, v in later.items() if k not in figures}, **figures}
    with_overrides(DEFAULTS["gloo"], figures)  # OptionsError on a negative, zero rate, NaN or non-number
    return {k: float(figures[k]) for k in names}


def cached_calibration(world_size: int | None = None, backend: str | None = None) -> Calibration | None:
    """The figures `store_calibration` kept for this host, world size, backend and torch
    version (with when they were measured and whether they were noisy), or None. Reads this
    process's file only: under several hosts, let rank 0 decide (``hca.calibrate(cache=True)``
    does), so that every rank solves with the same figures."""
    key = calibration_key(world_size, backend)
    path = cache_dir() / CACHE_FILE
    entry = _entry(_read_entries(path), key)
    if entry is None:
        return None
    try:
        figures = _valid_figures(entry.get("figures"))
    except (ValueError, HCAError) as e:
        warnings.warn(f"torch_hca: ignoring a calibration cache entry in {path} ({e}); "
                      "hca.calibrate(cache=True, refresh=True) measures it again", stacklevel=2)
        return None
    spread = entry.get("spread")
    return Calibration(figures, str(entry.get("measured_at", "?")), entry.get("noisy") is True,
                       spread if isinstance(spread, dict) else None)


def _entry(entries: list[dict], key: Mapping[str, Any]) -> dict | None:
    return next((e for e in entries if all(e.get(k) == key[k] for k in _KEY)), None)


def store_calibration(figures: Mapping[str, float], world_size: int | None = None,
                      backend: str | None = None) -> Path:
    """Keep `figures` as this key's entry (replacing an older one); returns the file's path.

    A `Calibration` keeps its time, noise flag and spreads; other figures are stored as quiet,
    measured now. A noisy calibration never replaces a quiet one (a warning says so): where
    this key has a quiet entry, the file is left as it is. Written to a temporary file and
    renamed, so a reader never sees half a file.
    """
    meta = figures if isinstance(figures, Calibration) else Calibration(figures)
    figures = _valid_figures(figures)
    key = calibration_key(world_size, backend)
    folder = cache_dir()
    path = folder / CACHE_FILE
    entries = _read_entries(path)
    old = _entry(entries, key)
    if meta.noisy and old is not None and old.get("noisy") is not True:
        warnings.warn(f"torch_hca: a noisy calibration ({meta.describe()}) did not replace the quiet one of "
                      f"{when(str(old.get('measured_at', '?')))} in {path}; measure again on a quiet machine "
                      "(hca.calibrate(refresh=True))", stacklevel=2)
        return path
    kept = [e for e in entries if e is not old]
    kept.append({**key, "figures": figures, "measured_at": meta.measured_at, "noisy": meta.noisy,
                 "spread": meta.spread})
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=CACHE_FILE, dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump({"format": 1, "entries": kept}, f, indent=2)
    os.replace(tmp, path)
    return path
