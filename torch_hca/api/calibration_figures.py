"""From the probes' seconds to the cost model's figures: each probe's fastest round, whether
the rounds disagree (noisy), and the figures solved from them (`figures_of`): the line through
the all_reduces, the matmul rate's half dimension, the share of a collective compute loses."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from torch_hca.spmd.collective_kinds import RULES, Kind

if TYPE_CHECKING:
    from torch_hca.api.calibration_probes import Probes

# The probes whose spread makes a calibration noisy: the rates layouts turn on (compute, a large
# transfer). Small collectives and host times vary between rounds even on a quiet machine, and so
# does the 16 MiB copy on a VM (66% on this project's quiet 2-core VM, 2026-12-03): not judged.
JUDGED = ("mlp_step", "matmul_256_rows", "all_reduce_4MiB")
# The slowest round of a judged probe 50% slower than its fastest: noisy. Quiet runs on this
# project's 2-core VM spread up to 37% (mlp_step) and 32% (all_reduce_4MiB); loaded, 146%.
MAX_SPREAD = 0.5


def fastest_rounds(rounds: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """(each probe's fastest round, how much slower its slowest round ran: 0.3 is 30%).

    Other work on the machine only slows a probe down, so its fastest round is the nearest to
    the machine's own speed; each round's figure is already a typical run, not a lucky one."""
    fastest = {k: min(r[k] for r in rounds) for k in rounds[0]}
    spread = {k: max(r[k] for r in rounds) / max(fastest[k], 1e-12) - 1.0 for k in rounds[0]}
    return fastest, spread


def noisy_probes(spread: dict[str, float], max_spread: float) -> list[str]:
    """The judged probes whose rounds disagreed beyond `max_spread`."""
    return [k for k in JUDGED if spread.get(k, 0.0) > max_spread]


def figures_of(t: dict[str, float], p: Probes) -> dict[str, float]:
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


def _share(steps_s: float, comm_s: float, both_s: float) -> float:
    """The share of a collective's time compute loses while both run (``contention``: see `torch_hca.api.calibrate`)."""
    return min(max((both_s - steps_s) / max(comm_s, 1e-9), 0.0), 1.0)
