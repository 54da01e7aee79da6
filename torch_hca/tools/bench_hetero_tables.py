"""`bench --hetero`'s arithmetic and tables (torch_hca/tools/bench_hetero.py runs the ranks): the
balanced bound, one row per k from the ranks' raw timings, the goals read against the rows, and
where each contestant's step goes."""

from __future__ import annotations

import statistics

FAST, SLOW = 0, 1  # rank 1 is the slow one
# The goals: shares within 1.10x of the bound at every k; at k=2 at least 1.3x
# faster than the even split; at k=1 (shares 1:1) within 3% of the even program.
BOUND_GOAL, K2_GOAL, K1_GOAL = 1.10, 1.3, 1.03


def bound(whole_s: float, k: float) -> float:
    """``T = W / sum of speeds``: `whole_s` at speed 1 shared by speeds (1, 1/k)."""
    return whole_s / (1 + 1 / k)


def summarize(k: float, shares: tuple, rows: tuple, times: dict) -> dict:
    """One table row from the ranks' raw timings of one k.

    `times[contestant][rank]` holds that rank's per-step lists: ``step`` (seconds from the
    barrier to the end of the optimizer step) and ``compute`` (forward + sleep + backward,
    wall clock). A distributed step took its slowest rank's time. ``W``: the whole batch at
    speed 1, every step of both ranks; the k got: rank 1's compute over rank 0's on the
    same (whole) batch with rank 1 slowed (``whole_k``; at k=1 ``whole``, nothing slowed)."""
    med = statistics.median
    slowest = lambda c: med(max(pair) for pair in zip(times[c][FAST]["step"], times[c][SLOW]["step"]))
    whole = med(times["whole"][FAST]["step"] + times["whole"][SLOW]["step"])
    slowed = times.get("whole_k") or times["whole"]
    k_measured = med(slowed[SLOW]["compute"]) / med(slowed[FAST]["compute"])
    even, by_shares = slowest("even"), slowest("shares")
    t = bound(whole, k_measured)
    return {
        "k": k,
        "k_measured": k_measured,
        "shares": list(shares),
        "rows": list(rows),
        "whole_s": whole,
        "even_s": even,
        "shares_s": by_shares,
        "bound_s": t,
        "shares_over_bound": by_shares / t,
        "even_over_shares": even / by_shares,
    }


def goals(rows: list) -> list[str]:
    """The issue's three goals, each met or not, with the figures that decide it."""
    worst = max(rows, key=lambda r: r["shares_over_bound"])
    out = [
        _verdict(
            worst["shares_over_bound"] <= BOUND_GOAL,
            f"shares within {BOUND_GOAL:.2f}x of the bound at every k: worst {worst['shares_over_bound']:.3f}x "
            f"at k={worst['k']:g}",
        )
    ]
    for k, ok, text in (
        (
            2.0,
            lambda r: r["even_over_shares"] >= K2_GOAL,
            lambda r: f"k=2: shares {r['even_over_shares']:.2f}x faster than even (goal >= {K2_GOAL})",
        ),
        (
            1.0,
            lambda r: r["shares_s"] / r["even_s"] <= K1_GOAL,
            lambda r: f"k=1: shares at {r['shares_s'] / r['even_s']:.3f}x the even program's time (goal <= {K1_GOAL})",
        ),
    ):
        row = next((r for r in rows if r["k"] == k), None)
        out.append(f"  not measured: k={k:g} not in this run" if row is None else _verdict(ok(row), text(row)))
    return out


def _verdict(ok: bool, text: str) -> str:
    return f"  {'met    ' if ok else 'NOT met'}  {text}"


def breakdown(k: float, times: dict) -> list:
    """Where each contestant's step goes at `k`, medians in seconds: each rank's forward +
    backward CPU time, rank 1's sleep, the slowest rank's step."""
    med = statistics.median
    return [
        {
            "k": k,
            "contestant": c,
            "cpu_s": [med(t[r]["cpu"]) for r in (FAST, SLOW)],
            "slept_s": med(t[SLOW]["slept"]),
            "step_s": med(max(pair) for pair in zip(t[FAST]["step"], t[SLOW]["step"])),
        }
        for c, t in times.items()
    ]


def _aligned(head: tuple, body: list) -> str:
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
    line = lambda row: "  ".join(str(v).rjust(w) for v, w in zip(row, widths))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def breakdown_table(parts: list) -> str:
    head = ("k asked", "contestant", "r0 fwd+bwd CPU ms", "r1 fwd+bwd CPU ms", "r1 slept ms", "step ms")
    ms = lambda s: f"{s * 1e3:.1f}"
    return _aligned(
        head,
        [
            (
                f"{p['k']:g}",
                p["contestant"],
                ms(p["cpu_s"][FAST]),
                ms(p["cpu_s"][SLOW]),
                ms(p["slept_s"]),
                ms(p["step_s"]),
            )
            for p in parts
        ],
    )


def table(rows: list) -> str:
    head = (
        "k asked",
        "k got",
        "shares r0:r1",
        "rows r0:r1",
        "W ms",
        "even ms",
        "shares ms",
        "bound ms",
        "shares/bound",
        "even/shares",
    )
    body = [
        (
            f"{r['k']:g}",
            f"{r['k_measured']:.2f}",
            ":".join(map(str, r["shares"])),
            ":".join(map(str, r["rows"])),
            f"{r['whole_s'] * 1e3:.1f}",
            f"{r['even_s'] * 1e3:.1f}",
            f"{r['shares_s'] * 1e3:.1f}",
            f"{r['bound_s'] * 1e3:.1f}",
            f"{r['shares_over_bound']:.3f}",
            f"{r['even_over_shares']:.2f}",
        )
        for r in rows
    ]
    return _aligned(head, body)


# ------------------------------------------------------------ on each rank
