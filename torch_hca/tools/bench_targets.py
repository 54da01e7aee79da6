"""The bench's speed targets, each checked in every round as well as overall.

A target is a ratio of two step times measured side by side in one run (hca's over
DDP's, say) against a bound. On a shared machine one run's ratio moves by 10-15%
between runs, so a ratio just under its bound may be noise: each target is also
read in every round (the contestants take turns, so a slow spell of the machine
falls on both sides of a round's ratio), and the verdict says in how many rounds
it held. "met" means in the overall medians and in every round.

The targets are the team's goals for the bench models (docs/bench.md):
data parallel at 0.9x DDP, tensor parallel at 0.8x one device under Inductor and
0.9x the expert plan under Inductor, hca's Inductor inner compiler no slower than
its eager one, hca's layout within 5% of the fastest other layout it could have
chosen (its regret), and the cost model's predicted step within 25% of the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bench_run import _regret


@dataclass(frozen=True)
class Target:
    model: str  # "*": every model with both contestants
    numerator: str
    denominator: str
    bound: float  # met when numerator / denominator <= bound


RATIOS = (
    Target("dp", "hca", "ddp", 0.9),
    Target("dp", "hca_inductor", "ddp", 0.9),
    Target("dp512", "hca", "ddp", 0.9),
    Target("dp512", "hca_inductor", "ddp", 0.9),
    Target("tt", "hca", "single_inductor", 0.8),
    Target("tt", "hca_inductor", "single_inductor", 0.8),
    Target("tt", "hca", "expert_inductor", 0.9),
    Target("tt", "hca_inductor", "expert_inductor", 0.9),
    Target("*", "hca_inductor", "hca", 1.0),
)
REGRET_BOUND = 1.05
PREDICTION_BOUND = 0.25  # |predicted / measured - 1|


def _ok(r: dict | None) -> bool:
    return r is not None and not r.get("failed") and bool(r.get("step_time_s"))


def _rounds(r: dict) -> list[float]:
    return list(r.get("round_step_times_s") or [])


def _verdict(value: float, rounds: list[float], bound: float) -> str:
    held = sum(v <= bound for v in rounds)
    if value <= bound and held == len(rounds):
        return "met"
    of = f"{held} of {len(rounds)} rounds"
    return f"met overall, {of}" if value <= bound else f"not met ({of})"


def _row(name: str, value: float, rounds: list[float], bound: float, rule: str) -> dict:
    return {
        "target": name,
        "value": value,
        "rounds": rounds,
        "bound": bound,
        "rule": rule,
        "verdict": _verdict(value, rounds, bound),
    }


def _ratio_rows(rows: dict[str, dict], model: str) -> list[dict]:
    out = []
    for t in RATIOS:
        num, den = rows.get(t.numerator), rows.get(t.denominator)
        if t.model not in ("*", model) or not (_ok(num) and _ok(den)):
            continue
        rounds = [a / b for a, b in zip(_rounds(num), _rounds(den)) if b]
        out.append(
            _row(
                f"{model}: {t.numerator} / {t.denominator}",
                num["step_time_s"] / den["step_time_s"],
                rounds,
                t.bound,
                f"<= {t.bound:g}",
            )
        )
    return out


def _regret_rows(rows: dict[str, dict], model: str) -> list[dict]:
    """hca's regret (`bench_run._regret`) overall, and in each round from that round's medians
    (the alternatives that emitted hca's own program, as the overall regret found them, count
    at hca's time there too)."""
    hca = rows.get("hca")
    if not _ok(hca) or hca.get("regret") is None:
        return []
    same = {"hca", *(hca.get("regret_same_program") or [])}
    rounds = []
    for i in range(len(_rounds(hca))):
        at = [
            {
                **r,
                "step_time_s": _rounds(r)[i],
                "program_sha1": "hca" if r["contestant"] in same else r.get("program_sha1"),
            }
            for r in rows.values()
            if _ok(r) and i < len(_rounds(r))
        ]
        regret = _regret(next(r for r in at if r["contestant"] == "hca"), at)["regret"]
        rounds.append(1.0 if regret is None else regret)
    return [_row(f"{model}: hca regret", hca["regret"], rounds, REGRET_BOUND, f"<= {REGRET_BOUND:g}")]


def _prediction_rows(rows: dict[str, dict], model: str) -> list[dict]:
    """The cost model's step (forward + backward) against the clock's, less the optimizer step."""
    hca = rows.get("hca")
    if not _ok(hca) or not hca.get("est_step_s"):
        return []
    opt = hca.get("optimizer_time_s") or 0.0
    error = lambda step: abs(hca["est_step_s"] / (step - opt) - 1) if step > opt else float("inf")
    return [
        _row(
            f"{model}: hca predicted step, |error|",
            error(hca["step_time_s"]),
            [error(t) for t in _rounds(hca)],
            PREDICTION_BOUND,
            f"<= {PREDICTION_BOUND:.0%}",
        )
    ]


def targets(records: list) -> list[dict]:
    """Every target the run's records can check: {target, value, rounds, bound, rule, verdict}."""
    out = []
    for model in dict.fromkeys(r["model"] for r in records):
        rows = {r["contestant"]: r for r in records if r["model"] == model}
        out += _ratio_rows(rows, model) + _regret_rows(rows, model) + _prediction_rows(rows, model)
    return out
