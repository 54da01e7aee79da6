"""The bench's tables: one per model (with the fewest-bytes and regret lines), the
targets table (`bench_targets`), the schedule on/off table, the --profile breakdown
table, and the footnotes that say how each column is measured."""

from __future__ import annotations

from .bench_profile import BREAKDOWN
from .bench_targets import targets


def _fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


_HEAD = (
    "contestant",
    "bytes/step",
    "x min",
    "coll/step",
    "step ms",
    "hca/this",
    "compile s",
    "peak mem",
    "grad rel err",
)


def _row(r: dict, amin: float, mark) -> tuple:
    if r.get("failed"):
        return (r["contestant"],) + ("n/a " + mark(f"{r['model']}/{r['contestant']} failed: {r['failed']}"),) * 8
    b = r["bytes_per_step"]
    extra = "".join(" " + mark(f"{r['model']}/{r['contestant']}: {note}") for note in r["notes"])
    return (
        r["contestant"],
        _fmt_bytes(b) + extra,
        _fmt(b / amin if amin else None, ".2f"),
        _fmt(r["collectives"], ".0f"),
        _fmt(r["step_time_s"], ".2f", 1e3),
        _fmt(r["hca_step_time_ratio"], ".2f"),
        _fmt(r["compile_time_s"], ".2f"),
        _fmt_bytes(r["peak_mem_bytes"]),
        _fmt(r["max_grad_rel_err"], ".1e"),
    )


def _aligned(table: list) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(row, widths))) for row in table]


# hca's own program run another way (same layout, same bytes), one device (no communication), and
# another storage than the plan's (replicated: the user's memory, not a layout to choose): not
# alternatives to compare hca's bytes against.
_NOT_COMPARED = ("hca", "hca_inductor", "hca_tune", "hca_noschedule", "single_inductor", "hca_dp_replicated")


def _fewest_bytes(rows: list) -> list[str]:
    """One line: are hca's bytes the fewest of the alternatives, and is the step
    communication- or compute-bound by hca's cost model?"""
    counted = [r for r in rows if r.get("bytes_per_step") is not None]
    hca = next((r for r in counted if r["contestant"] == "hca"), None)
    others = [r for r in counted if r["contestant"] not in _NOT_COMPARED]
    if hca is None or not others:
        return []
    best = min(others, key=lambda r: r["bytes_per_step"])
    verdict = "fewest" if hca["bytes_per_step"] <= best["bytes_per_step"] else "NOT the fewest"
    regime = ""
    if hca.get("est_comm_s") is not None and hca.get("est_compute_s") is not None:
        comm, compute = hca["est_comm_s"], hca["est_compute_s"]
        bound = "communication" if comm > compute else "compute"
        regime = f"; {bound}-bound by the cost model (comm {1e3 * comm:.2f} ms, compute {1e3 * compute:.2f} ms)"
    return [
        f"hca bytes/step {_fmt_bytes(hca['bytes_per_step'])}: {verdict} (best other: {best['contestant']}, "
        f"{_fmt_bytes(best['bytes_per_step'])}){regime}"
    ]


def _regret_line(rows: list) -> list[str]:
    """One line per contestant whose regret the bench measures (hca, hca_tune)."""
    lines = []
    for hca in (r for r in rows if r.get("regret") is not None):
        who = hca["contestant"]
        same = hca.get("regret_same_program") or []
        alts = ", ".join(
            f"{c} {1e3 * t:.2f}" + (f" ({who}'s program)" if c in same else "")
            for c, t in hca["regret_alternatives_s"].items()
        )
        if hca["regret_vs"] in same:
            lines.append(
                f"{who} regret 1.00: no other layout was faster; {', '.join(same)} came out as {who}'s "
                f"own program (ms: {alts}: the same program timed twice, apart by noise alone)"
            )
        else:
            lines.append(
                f"{who} regret {hca['regret']:.2f}: {who} {1e3 * hca['step_time_s']:.2f} ms / "
                f"{hca['regret_vs']} {1e3 * hca['regret_alternatives_s'][hca['regret_vs']]:.2f} ms, the "
                f"fastest other layout (ms: {alts}); above 1, a layout hca could have chosen was faster"
            )
    return lines


# fp32 against one device: any gradient further off than this is a wrong program, not rounding.
GRAD_TOL = 1e-5


def wrong_gradients(rows: list) -> list[dict]:
    """The records whose first step's gradients are off from one device's beyond `GRAD_TOL`."""
    return [r for r in rows if (r.get("max_grad_rel_err") or 0.0) > GRAD_TOL]


def _wrong_gradients_line(rows: list) -> list[str]:
    return [
        f"WRONG GRADIENTS: {r['contestant']} (max rel err {r['max_grad_rel_err']:.1e} > {GRAD_TOL:g} against "
        "one device); its step time times a wrong program"
        for r in wrong_gradients(rows)
    ]


def _prediction_line(rows: list) -> list[str]:
    """One line: hca's compiled forward and backward as its cost model predicted them (the scheduled
    timeline) against the clock: the step less its optimizer step, which the compiler never sees."""
    hca = next((r for r in rows if r["contestant"] == "hca"), None)
    if hca is None or not hca.get("est_step_s") or not hca.get("step_time_s"):
        return []
    est, step, opt = hca["est_step_s"], hca["step_time_s"], hca.get("optimizer_time_s") or 0.0
    measured = step - opt
    line = (
        f"predicted {1e3 * est:.2f} ms vs measured {1e3 * measured:.2f} ms for forward + backward (the step's "
        f"{1e3 * step:.2f} ms less the optimizer's {1e3 * opt:.2f}): the cost model is off by "
        f"{100 * (est / measured - 1):+.0f}% on hca's compiled program"
    )
    inside = hca.get("graphs_measured")
    if inside:  # hca.report(c).measured(): the compiled graphs' own calls, without the host work around them
        line += (
            f"; inside the compiled graphs {1e3 * inside['predicted_s']:.2f} predicted vs "
            f"{1e3 * inside['measured_s']:.2f} ms ({100 * inside['error']:+.0f}%)"
        )
    return [line]


def _profile_table(records: list) -> list[str]:
    """Where each contestant's profiled step went (rank 0's trace)."""
    rows = [r for r in records if r.get("profile")]
    if not rows:
        return []
    table = [("model", "contestant", "step ms", "compute", "collectives", "bucket copies", "other")]
    for r in rows:
        p = r["profile"]
        share = lambda k: f"{1e3 * p[k + '_s']:.2f} ({100 * p[k + '_s'] / p['step_s']:.0f}%)" if p["step_s"] else "n/a"
        table.append((r["model"], r["contestant"], f"{1e3 * p['step_s']:.2f}", *(share(k) for k in BREAKDOWN)))
        if r["contestant"] == "hca" and r.get("est_step_s"):
            table.append(_predicted_row(r))
    return [
        "== where the step time goes: one more profiled step, rank 0 (ms, share of the step); "
        "other = Python, FX, Dynamo, autograd, Inductor's C++ kernels; hca (predicted): its cost model's "
        "forward + backward, to tell which part it misses ==",
        *_aligned(table),
        "",
    ]


def _predicted_row(r: dict) -> tuple:
    """hca's step as its timeline has it, in the profile's columns: ops (their host time and
    the bucket copies included) as compute, the time compute waits on a collective as
    collectives; the optimizer step and the host time between ops are not in the model."""
    total, compute = r["est_step_s"], r["est_compute_s"]
    share = lambda s: f"{1e3 * s:.2f} ({100 * s / total:.0f}%)"
    return (
        r["model"],
        "hca (predicted)",
        f"{1e3 * total:.2f}",
        share(compute),
        share(total - compute),
        "(in compute)",
        "(not modelled)",
    )


def targets_table(records: list) -> list[str]:
    """The speed targets (`bench_targets`): overall, each round's value, the verdict."""
    checked = targets(records)
    if not checked:
        return []
    table = [("target", "overall", "goal", "each round", "verdict")]
    table += [
        (t["target"], f"{t['value']:.2f}", t["rule"], " ".join(f"{v:.2f}" for v in t["rounds"]), t["verdict"])
        for t in checked
    ]
    met = sum(t["verdict"] == "met" for t in checked)
    return [
        f"== targets: {met} of {len(checked)} met in every round (ratios of step times in this run; "
        "each round's from its medians, slowest rank) ==",
        *_aligned(table),
        "",
    ]


def _schedule_table(records: list) -> list[str]:
    table = [("model", "exposed comm est. off -> on (ms)", "step ms off", "step ms on", "on/off")]
    for model in dict.fromkeys(r["model"] for r in records):
        on = next((r for r in records if r["model"] == model and r["contestant"] == "hca"), None)
        off = next((r for r in records if r["model"] == model and r["contestant"] == "hca_noschedule"), None)
        if on is None or off is None or on.get("failed") or off.get("failed"):
            continue
        est = off.get("exposed_comm_est_s"), on.get("exposed_comm_est_s")
        est_txt = "n/a (no timeline in this build)" if None in est else f"{1e3 * est[0]:.3f} -> {1e3 * est[1]:.3f}"
        ratio = on["step_time_s"] / off["step_time_s"] if on["step_time_s"] and off["step_time_s"] else None
        table.append(
            (
                model,
                est_txt,
                _fmt(off["step_time_s"], ".2f", 1e3),
                _fmt(on["step_time_s"], ".2f", 1e3),
                _fmt(ratio, ".2f"),
            )
        )
    if len(table) == 1:
        return []
    return ["== schedule on/off: hca (schedule=True) vs hca_noschedule (schedule=False) ==", *_aligned(table), ""]


FOOTNOTES = [
    "bytes/step: bytes one rank sends per training step (forward + backward + optimizer step) in a ring "
    "implementation of each logical collective (all-reduce 2(n-1)/n S, all-gather and reduce-scatter (n-1)/n S), "
    "read from the c10d ops (c10d::allreduce_, c10d::_allgather_base_, ...) of one profiled step after the timed "
    "ones: every contestant is counted the same way, compiled graphs, DDP buckets and FSDP2 included. gloo itself "
    "runs a reduce-scatter as a full all-reduce; that is not counted. hca runs its reduce-scatters on gloo as "
    "all-reduces itself, and those are counted as all-reduces. All groups are taken to span the world.",
    "x min: bytes/step over the analytic minimum of the model's textbook strategy (in its header: Megatron "
    "activations for tensor parallel, gradients for data parallel, weights and gradients for FSDP). A contestant "
    "may run the same storage differently (hca's layout solver may gather small weights instead of reducing "
    "activations, or move activations instead of FSDP weights), so it can land above or below 1. "
    "coll/step: c10d collectives issued in that step, a coalesced one counted once.",
    "step ms: median of the timed steps of every round (after 1 warm-up step), forward + backward + SGD step, "
    "each step started after a barrier, slowest rank's median; with --rounds K the contestants take turns, "
    "--steps steps each, K times; hca/this: hca's step time over this contestant's "
    "(< 1: hca is faster). compile s: first step minus the median step (for eager contestants, first-call "
    "set-up such as DDP's buckets or FSDP2's lazy init).",
    "peak mem: what lives across steps (this rank's parameters or parameter shards, and DDP's gradient buckets; "
    "SGD keeps no state) plus the highest running total of CPU allocator allocations minus frees during the "
    "profiled step (activations, gradients, communication buffers, Inductor's buffers: all go through the CPU "
    "allocator), max over ranks. Not counted: gloo's internal transport buffers and Python objects; frees of "
    "memory allocated before the step are not subtracted (so this errs high). A CUDA mesh would read "
    "torch.cuda.max_memory_allocated instead (not exercised: the bench runs on CPU gloo ranks).",
    "grad rel err: max over parameters of |g - g_ref| / |g_ref| after the first step vs a single-device run "
    "on the full batch.",
    "regret: hca's step ms over the fastest of the other layouts hca could have chosen on the plan's storage, "
    "each compiled by hca (hca_dtensor_layout: DTensor's per-op choices; hca_dp: the batch split, the plan's "
    "storage); an alternative that emits hca's own program (same forward and backward graphs) counts at hca's "
    "time. hca_dp_replicated (every parameter replicated, the batch split) changes the storage: shown, not "
    "counted. The expert plans' storage is hca's plan here, so it adds no contestant. hca_tune "
    "(options layout='tune': the layout kept by timing the candidates on the first call) has its own line.",
]


def tables(records: list) -> str:
    lines: list[str] = []
    foot: list[str] = []

    def mark(text: str) -> str:
        if text not in foot:
            foot.append(text)
        return f"[{len(FOOTNOTES) + foot.index(text) + 1}]"

    for model in dict.fromkeys(r["model"] for r in records):
        rows = [r for r in records if r["model"] == model]
        amin = rows[0]["analytic_min_bytes"]
        lines.append(
            f"== {model} (world size {rows[0]['world_size']}; analytic minimum {_fmt_bytes(amin)}/step/rank: "
            f"{rows[0]['analytic_min_why']}) =="
        )
        lines += _aligned([_HEAD] + [_row(r, amin, mark) for r in rows]) + _wrong_gradients_line(rows)
        lines += _fewest_bytes(rows) + _regret_line(rows) + _prediction_line(rows)
        lines.append("")
    lines += targets_table(records) + _schedule_table(records) + _profile_table(records)
    lines += [f"[{i + 1}] {t}" for i, t in enumerate(FOOTNOTES + foot)]
    return "\n".join(lines)
