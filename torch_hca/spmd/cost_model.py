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

Figures measured once per machine are kept on disk and are where the compiler starts
(`torch_hca.spmd.calibration_cache`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .collective_kinds import RULES, Kind
from ..errors import OptionsError


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
            self,
            launch_s=self.launch_s * factor,
            alpha_s=self.alpha_s * factor,
            sync_s=self.sync_s * factor,
            bytes_per_s=self.bytes_per_s / factor,
            gather_bytes_per_s=self.gather_bytes_per_s / factor,
            scatter_bytes_per_s=self.scatter_bytes_per_s / factor,
        )

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def smallest_matmul_dim(first: Sequence[int], out: Sequence[int], against_weight: bool) -> float:
    """The smallest of a matmul's rows, reduction (its first operand's last dimension) and
    output width: what `CostModel.matmul_efficiency` reads. Against a 2-D weight (F.linear,
    x @ w) every leading dimension of the output is a row; a batched matmul's rows are its own."""
    rows = math.prod(out[:-1]) if against_weight else (out[-2] if len(out) >= 2 else 1)
    return float(min(rows, first[-1], out[-1]))


DEFAULTS: dict[str, CostModel] = {
    "gloo": CostModel(
        launch_s=50e-6,
        alpha_s=20e-6,
        bytes_per_s=1e9,
        flops_per_s=20e9,
        memory_bytes_per_s=10e9,
        op_s=5e-6,
        scatter_bytes_per_s=0.5e9,
    ),  # an all_reduce: twice the ring's wire bytes
    "nccl": CostModel(
        launch_s=10e-6, alpha_s=5e-6, bytes_per_s=50e9, flops_per_s=50e12, memory_bytes_per_s=3e12, op_s=5e-6
    ),
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


def all_to_all_runs_as_all_gather(device_type: str) -> bool:
    """Whether DTensor moves Shard(a) -> Shard(b) on a `device_type` mesh as an all_gather of
    the whole value, each rank keeping its piece: on CPU it assumes gloo has no all_to_all
    (`torch.distributed.tensor._collective_utils.shard_dim_alltoall`), so the move sends n
    times an all_to_all's bytes, and its price is the all_gather's."""
    return device_type == "cpu"


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
        # Latencies may be 0, and the kinds' own rates (0: bytes_per_s); other rates may not.
        may_be_zero = key in (
            "launch_s",
            "alpha_s",
            "op_s",
            "sync_s",
            "call_s",
            "param_s",
            "gather_bytes_per_s",
            "scatter_bytes_per_s",
            "contention",
            "matmul_half_dim",
        )
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or value < 0
            or (value == 0 and not may_be_zero)
        ):
            raise OptionsError(
                f"options['cost_model'][{key!r}] = {value!r}; give a finite number "
                f"{'>= 0' if may_be_zero else '> 0'}"
                + ("" if may_be_zero else " (a huge one, e.g. 1e15, makes it free)")
            )
        if key == "contention" and value > 1:
            raise OptionsError(
                f"options['cost_model']['contention'] = {value!r}; give a share from 0 to 1 "
                "(1: compute stops while a collective runs)"
            )
    return dataclasses.replace(model, **{k: float(v) for k, v in overrides.items()})
