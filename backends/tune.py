"""Option ``layout="tune"``: the layout chosen by the clock, on the first call.

The layout solver prices every choice with the cost model, and a calibration of a
busy machine can be off several-fold (docs/bench.md: one VM measured a collective's
launch at 0.13 ms in one run and 2.2 ms in another), which flips the choices whose
prices are close. With ``layout="tune"`` the pipeline compiles the programs the
solver picks with communication priced as calibrated, 4x dearer and 4x cheaper, and
DTensor's per-op choices (`candidate_options`; candidates with the same DTensor
program are compiled once). On the first call every rank runs each candidate's
forward and backward on that call's inputs once, untimed; candidates that emitted
the same forward and backward on every rank are merged (timing one program against
itself times noise); the rest take ``tune_rounds`` timed runs in turn. The ranks
exchange their medians and all keep the candidate whose slowest rank's median is
smallest (`pick`). The backward pulls
a fixed random cotangent back without touching ``.grad``; buffers the runs change
and the random number generators are put back, so the training step that follows
is the one it would have been. The kept program serves every call from then on;
its report lists each candidate's time beside the calibrated model's prediction of
it (`CompileReport.explain`), and the others' reports are left out of ``hca.report``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from torch_hca.errors import CheckError
from torch_hca.runtime.exchange import exchange, needs_exchange
from torch_hca.compiler.options import Options
from torch_hca.compiler.randomness import generator_states, set_generator_states
from torch_hca.compiler.checks.refinement import fixed_cotangents, history_cut, restorer
from torch_hca.report.compile_report import CompileReport
from torch_hca.report.records import GraphReport
from torch_hca.spmd.cost_model import CostModel

# (layout option, communication priced this many times the calibration's): the candidates, in
# the order a tie is broken (the calibrated solve first).
SCENARIOS: tuple[tuple[str, float], ...] = (("solve", 1.0), ("solve", 4.0), ("solve", 0.25), ("dtensor", 1.0))


def _label(layout: str, factor: float) -> str:
    return layout if factor == 1.0 else f"{layout}, communication x{factor:g}"


def candidate_options(options: Options, device_type: str) -> list[tuple[str, Options]]:
    """(label, options) of each layout to try: `options` with its layout set, and for a solve
    under another price of communication, the scaled collective figures added to its overrides."""
    base = options.costs(device_type)
    out = []
    for layout, factor in SCENARIOS:
        opts = dataclasses.replace(options, layout=layout)
        if factor != 1.0:  # the user's overrides kept, the collectives' figures scaled
            scaled = base.with_communication_scaled(factor).as_dict()
            changed = {k: v for k, v in scaled.items() if v != getattr(base, k)}
            opts = dataclasses.replace(opts, cost_model=tuple(sorted({**dict(options.cost_model), **changed}.items())))
        out.append((_label(layout, factor), opts))
    return out


@dataclass
class Candidate:
    """One distinct program: its label (and those of candidates that laid out the same), its report."""

    label: str
    report: GraphReport
    compiled: Callable
    same_as: list[str] = field(default_factory=list)  # other candidates' labels that laid out this program


def pick(medians_by_rank: dict[int, list[float]]) -> tuple[int, list[float]]:
    """The candidate to keep: the least of the slowest rank's medians (the earlier on a tie),
    and those slowest medians. Every rank computes it from the same numbers, so all agree."""
    slowest = [max(column) for column in zip(*medians_by_rank.values())]
    return min(range(len(slowest)), key=lambda i: (slowest[i], i)), slowest


class Tuned:
    """The compiled graph under ``layout="tune"``: times the candidates on its first call,
    then runs the one kept."""

    def __init__(
        self,
        candidates: list[Candidate],
        rounds: int,
        device_type: str,
        failed: list[str] = (),
        costs: CostModel | None = None,
    ):
        """`failed`: the candidates that did not compile, each "label: why" (shown in the report);
        `costs`: the calibrated model, which predicts each candidate's time beside its measure."""
        self.candidates, self.rounds, self.device_type, self.failed = candidates, rounds, device_type, list(failed)
        self.costs = costs
        self.kept: Candidate | None = candidates[0] if len(candidates) == 1 else None
        if self.kept is not None:
            self._record([])

    @property
    def report(self) -> GraphReport:
        """The kept program's report (before the first call: the calibrated solve's)."""
        return (self.kept or self.candidates[0]).report

    def __call__(self, *args):
        if self.kept is None:
            self._tune(list(args))
        return self.kept.compiled(*args)

    def _tune(self, args: list[Any]) -> None:
        """Run every candidate once, merge those that emitted one program, time the rest in
        turn, agree with the other ranks on the fastest and keep it."""
        sync = torch.cuda.synchronize if self.device_type == "cuda" else (lambda: None)
        restore, rng = restorer(args), generator_states(self.device_type)
        args = history_cut(args)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        try:
            # Untimed: the first-call checks run, and AOTAutograd compiles each backward.
            cotangents = {id(c): _run(c.compiled, args, leaves, None, sync)[1] for c in self.candidates}
            self._merge_same_programs()
            times: list[list[float]] = [[] for _ in self.candidates]
            for r in range(self.rounds if len(self.candidates) > 1 else 0):
                order = list(range(len(self.candidates)))
                for i in order[r % len(order) :] + order[: r % len(order)]:  # each round starts elsewhere
                    c = self.candidates[i]
                    times[i].append(_run(c.compiled, args, leaves, cotangents[id(c)], sync)[0])
        finally:
            restore()
            set_generator_states(self.device_type, rng)
        if len(self.candidates) == 1:
            self.kept = self.candidates[0]
            self._record([])
            return
        labels = [c.label for c in self.candidates]
        medians = [statistics.median(t) for t in times]
        index, slowest = pick(_by_rank("tune", labels, medians, self.report.index, float))
        self.kept = self.candidates[index]
        self._record(slowest)

    def _merge_same_programs(self) -> None:
        """Candidates whose layouts differ but whose emitted forward and backward are the same on
        every rank are one program: timing them against each other would time noise."""
        digests = [CompileReport([c.report]).program_digest() for c in self.candidates]
        by_rank = _by_rank("tune-programs", [c.label for c in self.candidates], digests, self.report.index, str)
        first: dict[tuple[str, ...], Candidate] = {}  # every rank's digest -> the first candidate emitting it
        for i, c in enumerate(self.candidates):
            same = first.setdefault(tuple(d[i] for d in by_rank.values()), c)
            if same is not c:
                same.same_as += [c.label, *c.same_as]
                c.report.dropped = f"layout='tune': the same program as graph {same.report.index} ({same.label})"
        self.candidates = list(first.values())

    def _record(self, slowest: list[float]) -> None:
        """The kept program's report lists every candidate's time; the others' are dropped."""
        kept = self.kept
        kept.report.tuning = {
            "kept": kept.label,
            "kept_graph": kept.report.index,
            "rounds": self.rounds,
            "candidates": [
                {
                    "layout": " = ".join([c.label, *c.same_as]),
                    "graph": c.report.index,
                    "median_s": slowest[i] if slowest else None,  # None: nothing timed
                    "predicted_s": self._predicted_s(c) if slowest else None,
                }
                for i, c in enumerate(self.candidates)
            ],
            "failed": self.failed,
            # The calibrated figures: hca.report's timeline and measured() price the kept program with
            # these, not with the scaled ones it may have been laid out under.
            "cost_model": None if self.costs is None else self.costs.as_dict(),
        }
        for c in self.candidates:
            if c is not kept:
                c.report.dropped = f"layout='tune' kept graph {kept.report.index} ({kept.label}), which ran faster"

    def _predicted_s(self, c: Candidate) -> float | None:
        """The calibrated model's forward + backward of `c` (its scheduled timeline)."""
        if self.costs is None:
            return None
        return CompileReport([c.report]).timeline(self.costs).after.total_s


def _run(
    compiled: Callable,
    args: list[Any],
    leaves: list[torch.Tensor],
    cotangents: list[torch.Tensor] | None,
    sync: Callable[[], None],
) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one forward and backward (the backward when grad mode is on and an output
    needs one), and the cotangents it pulled back (made on the first run: the same each time)."""
    sync()
    start = time.perf_counter()
    out = compiled(*args)
    outs = [
        o
        for o in (out if isinstance(out, (tuple, list)) else (out,))
        if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()
    ]
    if cotangents is None:
        cotangents = fixed_cotangents(outs)
    if outs and leaves:
        torch.autograd.grad(outs, leaves, cotangents, allow_unused=True)
    sync()
    return time.perf_counter() - start, cotangents


def _by_rank(
    topic: str, labels: list[str], values: list[Any], graph: int, parse: Callable[[str], Any]
) -> dict[int, list]:
    """Every rank's `values`, one per candidate (through the rendezvous store; just this rank's
    on one rank). Ranks that compiled other candidates (which the solver's determinism rules
    out) are an error."""
    if not needs_exchange():
        return {0: list(values)}
    text = "\n".join(f"{label}\t{v}" for label, v in zip(labels, values))  # str() of a float round-trips
    what = f"graph {graph}, layout='tune'"
    texts = exchange(topic, text, range(dist.get_world_size()), what)
    texts[dist.get_rank()] = text
    out = {}
    for rank, t in sorted(texts.items()):
        rows = [line.split("\t") for line in t.split("\n")]
        if [label for label, _ in rows] != labels:
            raise CheckError(
                f"{what}: rank {rank} timed the candidates {[label for label, _ in rows]} but rank "
                f"{dist.get_rank()} timed {labels}: the ranks compiled different layouts; give every "
                "rank the same model, plan, options and calibration"
            )
        out[rank] = [parse(v) for _, v in rows]
    return out
