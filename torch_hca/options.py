"""Backend options: one frozen dataclass, parsed from `torch.compile(..., options=)`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import OptionsError

INNER = ("eager", "inductor", "dtensor")


@dataclass(frozen=True)
class Options:
    """What `torch.compile(model, backend="hca", options={...})` accepts.

    inner: how the transformed program runs. "eager": the c10d program as FX
      (default); "inductor": the c10d program compiled by Inductor; "dtensor":
      the DTensor program run eagerly, no AOTAutograd (the reference).
    strict: a redistribution the layout pass cannot make explicit, or a check
      that fails, is an error rather than a note in the report.
    debug_dir: write every graph before and after each pass, the collectives
      table and the strategy there (also set by TORCH_HCA_DEBUG_DIR).
    rank_rewrites: also apply collective rewrites that depend on the rank
      ("this rank's shard of an all-reduce is a reduce-scatter"); the ranks agree
      on each through the rendezvous store while compiling, so every rank must
      compile the same graphs in the same order.
    mode: torch.compile's `mode=`, recorded in the report (not yet acted on).
    """

    inner: str = "eager"
    strict: bool = False
    debug_dir: str | None = None
    rank_rewrites: bool = False
    mode: str | None = None

    @classmethod
    def parse(cls, options: dict[str, Any] | None, mode: str | None = None) -> "Options":
        if options is not None and not isinstance(options, Mapping):
            raise OptionsError(
                f"backend 'hca': options must be a dict, got {type(options).__name__} {options!r}; "
                "write options={'inner': 'inductor'}"
            )
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)} - {"mode"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise OptionsError(
                f"backend 'hca': unknown option(s) {unknown}; the options are {sorted(known)}"
            )
        inner = options.get("inner", "eager")
        if inner not in INNER:
            raise OptionsError(f"backend 'hca': options['inner']={inner!r}; use one of {INNER}")
        strict = options.get("strict", False)
        rank_rewrites = options.get("rank_rewrites", False)
        for key, value in (("strict", strict), ("rank_rewrites", rank_rewrites)):
            if not isinstance(value, bool):
                raise OptionsError(f"backend 'hca': options[{key!r}] must be a bool, got {value!r}")
        debug_dir = options.get("debug_dir") or os.environ.get("TORCH_HCA_DEBUG_DIR")
        if debug_dir is not None and not isinstance(debug_dir, (str, os.PathLike)):
            raise OptionsError(
                f"backend 'hca': options['debug_dir'] must be a directory path, got {debug_dir!r}"
            )
        return cls(inner=inner, strict=strict, debug_dir=debug_dir, rank_rewrites=rank_rewrites, mode=mode)
