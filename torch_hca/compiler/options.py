"""Backend options: one frozen dataclass, parsed from `torch.compile(..., options=)`."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any

from torch_hca.spmd.calibration_cache import base_model
from torch_hca.spmd.cost_model import DEFAULTS, CostModel, backend_for, with_overrides
from torch_hca.errors import OptionsError
from torch_hca.runtime.mesh import devices_mixed

INNER = ("eager", "inductor", "dtensor")
LAYOUT = ("solve", "dtensor", "tune")
INPUT_CHECKS = ("values", "shapes", "first")  # torch_hca.compiler.checks.agreement
STAGING = ("auto", "on", "off")  # torch_hca.runtime.staging


@dataclass(frozen=True)
class Options:
    """What `torch.compile(model, backend="hca", options={...})` accepts.

    inner: how the transformed program runs. "eager": the c10d program as FX
      (default); "inductor": the c10d program compiled by Inductor; "dtensor":
      the DTensor program run eagerly, no AOTAutograd (the reference).
    strict: a redistribution the layout pass cannot make explicit, or a check
      that fails, is an error rather than a note in the report.
    debug_dir: write every graph before and after each pass, the collectives
      table and the strategy there, each rank under rank{r}/ (also set by
      TORCH_HCA_DEBUG_DIR). TORCH_LOGS="+torch_hca" logs the graphs instead.
    rank_rewrites: also apply collective rewrites that depend on the rank
      ("this rank's shard of an all-reduce is a reduce-scatter"); the ranks agree
      on each through the rendezvous store while compiling, so every rank must
      compile the same graphs in the same order.
    layout: "solve" (default): the layout pass chooses every value's placement
      by a global cost minimization (`torch_hca.compiler.layout.solver`); "as_written"
      (also spelled "dtensor"): keep the parallelism as written, DTensor's own per-op
      choices, only made explicit (data parallel storage keeps the batch split); "tune": the layouts the
      solver picks with communication priced as calibrated, 4x dearer and 4x
      cheaper, and DTensor's, each compiled, timed on the first call and the
      fastest kept (`torch_hca.backends.tune`).
    tune_rounds: with layout="tune", timed forward + backward runs of each
      candidate on the first call's inputs (default 8; the median decides).
    memory_weight: seconds of step time one byte of activation memory per rank
      is worth to the layout solver (default 0: memory is free).
    memory_budget: bytes of activation memory per rank the layout may use
      (default None: no bound); a layout that cannot fit is a PlanError.
    solver_time_limit_s: time limit of the exact solver before the greedy
      fallback takes over (default 10).
    cost_model: overrides of `torch_hca.spmd.cost_model.CostModel` fields
      (launch_s, alpha_s, bytes_per_s, flops_per_s, memory_bytes_per_s, op_s, sync_s, call_s,
      param_s, gather_bytes_per_s, scatter_bytes_per_s, contention, matmul_half_dim)
      on top of this host's cached calibration (``hca.calibrate(cache=True)``,
      ``python -m torch_hca calibrate``) or, without one, the defaults.
    schedule: reorder (start collectives early, wait late) and bucket
      collectives (default True); False keeps the traced order.
    bucket_cap_mb: largest flat buffer gradient reductions and weight
      all-gathers are merged into (default None: from the cost model, the size
      whose all_reduce spends 10% of its time on latency; about 1 MiB on gloo).
    max_in_flight_mb: bound on bytes of collectives started but not yet
      waited on (default None: the larger of 64 MiB and twice the graph's
      largest collective, so that one large gradient, a language model's head,
      stays in flight while the buckets after it start).
    check: refinement check (default False; the tests turn it on): on the first
      call the compiled program and the logical program (the single-device
      program Dynamo traced, run whole on every rank) run on the same inputs
      and a random cotangent; an output or gradient that differs beyond fp32
      tolerance is a CheckError naming it and its layout.
    input_check: what the ranks compare before each call of a compiled graph
      (torch_hca.compiler.checks.agreement): "values" (default): the program, every input's local
      shape and dtype, and a digest of the values that must be equal (Replicate()
      inputs, buffers, Python scalars, pieces at the same mesh coordinate);
      "shapes": no value digests after the first call; "first": everything, on
      the first call only (the shapes of inputs cut by shares on every call).
    strategy: path of a strategy file (`hca.report(c).save_strategy(path)`, docs/strategy.md):
      the layout pass checks it was made for this model, mesh and world size, then places
      every value as the file says instead of probing and solving (StrategyError on any difference).
    staging: "auto" (default): on a mesh whose ranks mix CPU and CUDA devices
      (`hca.init_mesh(devices=...)`), every collective runs on gloo through bounded, reused
      host buffers (torch_hca.runtime.staging), elsewhere as emitted; "on": staged on any mesh
      (how the CPU tests exercise the path); "off": never.
    mode: torch.compile's `mode=`, recorded in the report (not yet acted on).
    """

    inner: str = "eager"
    strict: bool = False
    debug_dir: str | None = None
    rank_rewrites: bool = False
    layout: str = "solve"
    tune_rounds: int = 8
    memory_weight: float = 0.0
    memory_budget: float | None = None
    solver_time_limit_s: float = 10.0
    cost_model: tuple = ()  # (field, value) pairs: the dataclass stays hashable
    schedule: bool = True
    bucket_cap_mb: float | None = None
    max_in_flight_mb: float | None = None
    check: bool = False
    input_check: str = "values"
    strategy: str | None = None
    staging: str = "auto"
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
            raise OptionsError(f"backend 'hca': unknown option(s) {unknown}; the options are {sorted(known)}")
        inner = options.get("inner", "eager")
        if inner not in INNER:
            raise OptionsError(f"backend 'hca': options['inner']={inner!r}; use one of {INNER}")
        for key in ("strict", "rank_rewrites", "schedule", "check"):
            if not isinstance(options.get(key, False), bool):
                raise OptionsError(f"backend 'hca': options[{key!r}] must be a bool, got {options[key]!r}")
        input_check = options.get("input_check", "values")
        if input_check not in INPUT_CHECKS:
            raise OptionsError(f"backend 'hca': options['input_check']={input_check!r}; use one of {INPUT_CHECKS}")
        staging = options.get("staging", "auto")
        if staging not in STAGING:
            raise OptionsError(f"backend 'hca': options['staging']={staging!r}; use one of {STAGING}")
        layout = options.get("layout", "solve")
        layout = "dtensor" if layout == "as_written" else layout  # the name users look for; "dtensor" says how
        if layout not in LAYOUT:
            raise OptionsError(f"backend 'hca': options['layout']={layout!r}; use one of {LAYOUT + ('as_written',)}")
        tune_rounds = options.get("tune_rounds", 8)
        if isinstance(tune_rounds, bool) or not isinstance(tune_rounds, int) or tune_rounds < 1:
            raise OptionsError(f"backend 'hca': options['tune_rounds'] must be an int >= 1, got {tune_rounds!r}")
        if layout == "tune" and inner == "dtensor":
            raise OptionsError(
                "backend 'hca': options layout='tune' times compiled programs, and inner='dtensor' "
                "compiles none; use inner='eager' or 'inductor' with it"
            )
        numbers = _numbers(options)
        overrides = options.get("cost_model") or {}
        if not isinstance(overrides, Mapping):
            raise OptionsError(
                f"backend 'hca': options['cost_model'] must be a dict of CostModel fields, got {overrides!r}"
            )
        with_overrides(DEFAULTS["gloo"], overrides)  # validates names and values
        debug_dir = options.get("debug_dir") or os.environ.get("TORCH_HCA_DEBUG_DIR")
        if debug_dir is not None and not isinstance(debug_dir, (str, os.PathLike)):
            raise OptionsError(f"backend 'hca': options['debug_dir'] must be a directory path, got {debug_dir!r}")
        strategy = _strategy(options.get("strategy"), layout)
        return cls(
            inner=inner,
            strategy=strategy,
            strict=options.get("strict", False),
            debug_dir=debug_dir,
            rank_rewrites=options.get("rank_rewrites", False),
            layout=layout,
            tune_rounds=tune_rounds,
            cost_model=tuple(sorted(overrides.items())),
            schedule=options.get("schedule", True),
            check=options.get("check", False),
            input_check=input_check,
            staging=staging,
            mode=mode,
            **numbers,
        )

    def costs(self, device_type: str) -> CostModel:
        """The cost model for a mesh on `device_type` (`costs_and_source`)."""
        return self.costs_and_source(device_type)[0]

    def costs_and_source(self, device_type: str) -> tuple[CostModel, str]:
        """The cost model for a mesh on `device_type`: this host's cached calibration, else the
        defaults (`base_model`), with this compile's overrides; and where it came from
        ("calibrated <when>" or "defaults", + "with overrides of ...").

        On a mesh of mixed devices every rank takes gloo's defaults: each rank solves its own
        layout, so all must price by the same figures (a host's calibration is its own), and
        every collective there runs on gloo."""
        if devices_mixed():
            base, source = DEFAULTS["gloo"], "defaults for gloo (a mesh of CPU and CUDA ranks)"
        else:
            base, source = base_model(backend_for(device_type))
        given = [k for k, _ in self.cost_model]
        if set(given) >= {f.name for f in dataclasses.fields(base)}:
            source = "options['cost_model'] (every figure given)"  # nothing of the base is left
        elif given:
            source += f" with overrides of {', '.join(given)}"
        return with_overrides(base, dict(self.cost_model)), source


_MAY_BE_NONE = ("memory_budget", "bucket_cap_mb", "max_in_flight_mb")  # None: no bound, or the default rule


def _numbers(options: dict[str, Any]) -> dict[str, float]:
    """The numeric options given, each checked: a finite number >= 0 (None: no bound, where allowed)."""
    numbers = {}
    for key in ("memory_weight", "memory_budget", "solver_time_limit_s", "bucket_cap_mb", "max_in_flight_mb"):
        if key in options and not (key in _MAY_BE_NONE and options[key] is None):
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, Real) or value < 0:
                raise OptionsError(f"backend 'hca': options[{key!r}] must be a number >= 0, got {value!r}")
            if not math.isfinite(value):  # NaN passes `< 0`; the solver (scipy) would fail on either
                raise OptionsError(
                    f"backend 'hca': options[{key!r}] must be a finite number, got {value!r}"
                    + ("; leave it out or give None for no bound" if key in _MAY_BE_NONE else "")
                )
            numbers[key] = float(value)
    return numbers


def _strategy(strategy: Any, layout: str) -> str | None:
    """options['strategy'] checked: the path of a strategy file, and not with layout='tune'."""
    if strategy is not None:
        if not isinstance(strategy, (str, os.PathLike)):
            raise OptionsError(
                f"backend 'hca': options['strategy'] must be the path of a strategy file, "
                f"got {strategy!r}; write it with hca.report(compiled).save_strategy(path)"
            )
        if layout == "tune":
            raise OptionsError(
                "backend 'hca': options strategy= and layout='tune' both choose the layout; leave one out"
            )
        strategy = os.fspath(strategy)
    return strategy
