"""The calibration cache: cost-model figures measured once per host, and the model a compile starts from.

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
import os
import socket
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .cost_model import DEFAULTS, CostModel, with_overrides
from ..errors import HCAError, OptionsError


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

    def __init__(
        self,
        figures: Mapping[str, float],
        measured_at: str | None = None,
        noisy: bool = False,
        spread: Mapping[str, float] | None = None,
    ):
        super().__init__(figures)
        self.measured_at = measured_at or now_utc()
        self.noisy = bool(noisy)
        self.spread = dict(spread or {})

    def describe(self) -> str:
        """ "calibrated 2026-12-03 06:10 UTC", with ", noisy" where it was."""
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
            raise HCAError(
                "calibration cache: no process group to read the world size and backend from; "
                "pass world_size= and backend= (e.g. 2, 'gloo') or call hca.init_mesh() first"
            )
        world_size = dist.get_world_size() if world_size is None else world_size
        backend = str(dist.get_backend()) if backend is None else backend
    return {"host": socket.gethostname(), "world_size": int(world_size), "backend": backend, "torch": torch.__version__}


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
        warnings.warn(
            f"torch_hca: ignoring the calibration cache {path} ({type(e).__name__}: {e}); "
            "hca.calibrate(cache=True, refresh=True) measures again and rewrites it",
            stacklevel=3,
        )
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
        warnings.warn(
            f"torch_hca: ignoring a calibration cache entry in {path} ({e}); "
            "hca.calibrate(cache=True, refresh=True) measures it again",
            stacklevel=2,
        )
        return None
    spread = entry.get("spread")
    return Calibration(
        figures,
        str(entry.get("measured_at", "?")),
        entry.get("noisy") is True,
        spread if isinstance(spread, dict) else None,
    )


def _entry(entries: list[dict], key: Mapping[str, Any]) -> dict | None:
    return next((e for e in entries if all(e.get(k) == key[k] for k in _KEY)), None)


def store_calibration(figures: Mapping[str, float], world_size: int | None = None, backend: str | None = None) -> Path:
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
        warnings.warn(
            f"torch_hca: a noisy calibration ({meta.describe()}) did not replace the quiet one of "
            f"{when(str(old.get('measured_at', '?')))} in {path}; measure again on a quiet machine "
            "(hca.calibrate(refresh=True))",
            stacklevel=2,
        )
        return path
    kept = [e for e in entries if e is not old]
    kept.append(
        {**key, "figures": figures, "measured_at": meta.measured_at, "noisy": meta.noisy, "spread": meta.spread}
    )
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=CACHE_FILE, dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump({"format": 1, "entries": kept}, f, indent=2)
    os.replace(tmp, path)
    return path


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
