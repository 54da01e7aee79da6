"""One cost model for the layout solver and the timeline: alpha-beta communication, roofline compute.

A collective of kind k on a payload of S bytes over n ranks costs

    launch + alpha * steps(k, n) + wire_bytes(k, S, n) / bandwidth

where ``wire_bytes`` is the ring model of `collective_kinds` (what one rank
sends) and ``steps`` the number of ring rounds. An op costs
``max(flops / flops_per_s, bytes touched / memory_bytes_per_s)``.

The defaults are rough figures for the two transports torch_hca targets;
calibrate them for a cluster with ``options={"cost_model": {...}}``:

| field              | gloo (CPU, TCP) | nccl (GPU)  |
|--------------------|-----------------|-------------|
| launch_s           | 50e-6           | 10e-6       |
| alpha_s            | 20e-6           | 5e-6        |
| bytes_per_s        | 1e9             | 50e9        |
| flops_per_s        | 20e9            | 50e12       |
| memory_bytes_per_s | 10e9            | 3e12        |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .collective_kinds import RULES, Kind
from .errors import OptionsError


def ring_steps(kind: Kind, n: int) -> int:
    """Rounds of a ring implementation of `kind` over `n` ranks (0 for local kinds)."""
    if n <= 1 or not RULES[kind].communicates:
        return 0
    if kind in (Kind.ALL_REDUCE, Kind.SCALED_ALL_REDUCE):
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

    def collective_s(self, kind: Kind, payload_bytes: float, n: int) -> float:
        """Seconds for one collective of `kind` on `payload_bytes` over `n` ranks."""
        steps = ring_steps(kind, n)
        if steps == 0:
            return 0.0
        return self.launch_s + self.alpha_s * steps + RULES[kind].wire_bytes(payload_bytes, n) / self.bytes_per_s

    def bandwidth_s(self, kind: Kind, payload_bytes: float, n: int) -> float:
        """The bandwidth term alone: a collective merged into a bucket shares its latency."""
        if ring_steps(kind, n) == 0:
            return 0.0
        return RULES[kind].wire_bytes(payload_bytes, n) / self.bytes_per_s

    def compute_s(self, flops: float, bytes_touched: float) -> float:
        """Seconds for one op: the slower of its arithmetic and its memory traffic."""
        return max(flops / self.flops_per_s, bytes_touched / self.memory_bytes_per_s)

    def bucket_cap_bytes(self, n: int, latency_share: float = 0.1) -> float:
        """The bucket size whose all_reduce spends `latency_share` of its time on latency.

        Smaller buckets start earlier and hide behind more compute; larger ones
        pay the per-collective latency fewer times. At 10% latency the gloo
        defaults give about 1 MiB at 4 ranks, the nccl ones about 20 MiB at 8
        (DDP's fixed default is 25 MiB).
        """
        if n <= 1:
            return float("inf")
        latency = self.collective_s(Kind.ALL_REDUCE, 0, n)
        wire_per_byte = RULES[Kind.ALL_REDUCE].wire_bytes(1.0, n)
        return latency * (1 - latency_share) / latency_share * self.bytes_per_s / wire_per_byte

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


DEFAULTS: dict[str, CostModel] = {
    "gloo": CostModel(launch_s=50e-6, alpha_s=20e-6, bytes_per_s=1e9, flops_per_s=20e9, memory_bytes_per_s=10e9),
    "nccl": CostModel(launch_s=10e-6, alpha_s=5e-6, bytes_per_s=50e9, flops_per_s=50e12, memory_bytes_per_s=3e12),
}


def backend_for(device_type: str) -> str:
    """The transport a mesh on `device_type` uses: NCCL on CUDA, gloo otherwise."""
    return "nccl" if device_type == "cuda" else "gloo"


def cost_model(backend: str, overrides: Mapping[str, Any] | None = None) -> CostModel:
    """The default model for `backend` ("gloo" or "nccl") with `overrides` applied."""
    if backend not in DEFAULTS:
        raise OptionsError(f"cost model: unknown backend {backend!r}; use one of {sorted(DEFAULTS)}")
    return with_overrides(DEFAULTS[backend], overrides)


def with_overrides(model: CostModel, overrides: Mapping[str, Any] | None) -> CostModel:
    if not overrides:
        return model
    fields = {f.name for f in dataclasses.fields(CostModel)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise OptionsError(f"options['cost_model']: unknown field(s) {unknown}; the fields are {sorted(fields)}")
    for key, value in overrides.items():
        latency = key in ("launch_s", "alpha_s")  # may be 0; rates may not
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not latency):
            raise OptionsError(
                f"options['cost_model'][{key!r}] = {value!r}; give a number "
                f"{'>= 0' if latency else '> 0'}"
            )
    return dataclasses.replace(model, **{k: float(v) for k, v in overrides.items()})
