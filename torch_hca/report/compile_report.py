"""`hca.report`: what the compiler did, for people and for tests.

One `GraphReport` per graph Dynamo hands the backend (a graph break makes
two); a `CompileReport` gathers those of one compiled module.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import textwrap
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from torch_hca.errors import HCAError
from torch_hca.spmd.cost_model import CostModel
from torch_hca.spmd.collective_nodes import nbytes
from torch_hca.spmd.placements import dtype_str, layout_str, partial_dims
from torch_hca.report.layout_record import LayoutRecord
from torch_hca.report.parallelism import sentence

if TYPE_CHECKING:
    from torch_hca.compiler.checks.uneven import UnevenShares


# ----------------------------------------------------------------------------- text for people

WIDTH = 120  # the widest line str(report), table(WIDTH) and the demo print


def readable_code(code: str, width: int = WIDTH) -> str:
    """FX code with no line wider than ``width``, for people (``dtensor_code`` stays as FX wrote it).

    A statement's trailing ``;  a = b = None`` (where FX lets values go) gets its
    own line; a long call, signature or tuple puts one item per line::

        def forward(
            self,
            L_self_modules_fc1_parameters_weight_ : torch.distributed.tensor.DTensor,
            ...
        ):
    """
    out: list[str] = []
    for line in code.strip("\n").splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        for statement in _top_level(line.strip(), ";"):
            if statement.strip():
                out += _fit(indent + statement.strip(), width)
    return "\n".join(out)


def _scan(text: str):
    """(index, character, bracket depth before it) for each character outside string literals."""
    depth, quote = 0, None
    for i, ch in enumerate(text):
        if quote is not None:
            if ch == quote and text[i - 1] != "\\":
                quote = None
        elif ch in "'\"":
            quote = ch
        else:
            yield i, ch, depth
            depth += (ch in "([{") - (ch in ")]}")


def _top_level(text: str, sep: str) -> list[str]:
    """``text`` cut at each ``sep`` outside brackets and strings."""
    cuts = [i for i, ch, depth in _scan(text) if ch == sep and depth == 0]
    return [text[a + 1 : b] for a, b in zip([-1, *cuts], [*cuts, len(text)])]


def _fit(line: str, width: int) -> list[str]:
    """One line of code as lines of at most ``width``: the first bracket's items one per line, else wrapped."""
    if len(line) <= width:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    scanned = list(_scan(line))
    opening = next(((i, depth) for i, ch, depth in scanned if ch in "([{"), None)
    end = (
        None
        if opening is None
        else next((i for i, ch, depth in scanned if i > opening[0] and ch in ")]}" and depth == opening[1] + 1), None)
    )
    if end is None:  # no brackets (`a = b = None`): cut at spaces, continued with a backslash
        cut = textwrap.wrap(
            line.strip(), width - 2, initial_indent=indent, subsequent_indent=indent + " " * 8, break_on_hyphens=False
        )
        return [piece + " \\" for piece in cut[:-1]] + cut[-1:]
    start = opening[0]
    inner = line[start + 1 : end]
    items = [item.strip() for item in _top_level(inner, ",") if item.strip()]
    comma = "," if len(items) > 1 or inner.rstrip().endswith(",") else ""  # (x,) stays a tuple
    lines = _fit(line[: start + 1], width)
    for item in items:
        lines += _fit(f"{indent}    {item}{comma}", width)
    return lines + _fit(indent + line[end:], width)


@dataclass
class CollectiveRecord:
    """One collective in the compiled forward or backward graph."""

    kind: str  # collective_kinds.Kind value
    group: str  # process group name
    group_size: int
    bytes: int  # the full logical buffer (payload)
    wire_bytes: float  # bytes one rank sends in a ring implementation
    direction: str  # "forward" or "backward"
    node: str  # node name in the graph
    dtype: str
    shape: tuple[int, ...]
    partner: str | None = None  # the collective this one transposes
    rule: str = ""  # why it is there

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Redistribution:
    """A placement change in the DTensor program, explicit as a node."""

    node: str
    value: str
    src: str
    dst: str
    reason: str
    costed: str = ""  # the collectives the layout solver charges for it, as kind@mesh dim
    emitted: str = ""  # the forward collectives traced from it (the transpose pass reads their origin tags)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PassRecord:
    name: str
    reads: str
    writes: str
    changed: bool
    decisions: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the pass (compile-time profile)


CALLS_KEPT = 256  # the most recent calls of each compiled graph whose wall time is kept


@dataclass
class GraphReport:
    """Everything one graph went through, stage by stage."""

    index: int
    options: Any
    mesh: dict[str, Any] | None = None
    dynamo_graph: fx.GraphModule | None = None
    dtensor_program: fx.GraphModule | None = None
    joint: fx.GraphModule | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    inference: bool = False
    collectives: list[CollectiveRecord] = field(default_factory=list)
    redistributions: list[Redistribution] = field(default_factory=list)
    implicit_redistributions: list[str] = field(default_factory=list)
    run_replicated: list[str] = field(default_factory=list)  # ops DTensor has no rule for (lift pass)
    random_draws: list[str] = field(default_factory=list)  # "node: aten op" drawing random numbers (lift pass)
    refinement: dict[str, float] | None = None  # option check: relative error of each output and gradient
    refinement_skipped: str | None = None  # option check asked for, and why it did not run
    uneven: UnevenShares | None = None  # the shares the inputs are cut by
    weighted_means: list[str] = field(default_factory=list)  # partial means over uneven ranks, weighted by share
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    passes: list[PassRecord] = field(default_factory=list)
    schedules: dict[str, dict[str, Any]] = field(default_factory=dict)
    layout: LayoutRecord = field(default_factory=LayoutRecord)  # the layout pass's decision (see explain())
    # Option layout="tune": on the program kept, each candidate's time (`torch_hca.backends.tune`);
    # on the others, why they were dropped (hca.report leaves them out).
    tuning: dict[str, Any] | None = None
    dropped: str | None = None
    # Wall seconds of the compiled forward's and backward's recent calls after the first
    # (backends/pipeline.py times them; CPU meshes only), for `CompileReport.measured`.
    call_times: dict[str, collections.deque] = field(
        default_factory=lambda: {w: collections.deque(maxlen=CALLS_KEPT) for w in ("forward", "backward")}
    )
    # The parameters the graph reads, by id, held weakly: ids of dead parameters
    # are reused by new ones, so a match must also be the same object.
    param_refs: dict[int, weakref.ref] = field(default_factory=dict)

    def add_parameter(self, p: torch.Tensor) -> None:
        self.param_refs[id(p)] = weakref.ref(p)

    def reads_any(self, params: list[torch.Tensor]) -> bool:
        return any((r := self.param_refs.get(id(p))) is not None and r() is p for p in params)

    @property
    def dtensor_code(self) -> str:
        return self.dtensor_program.code if self.dtensor_program is not None else ""


# Every graph compiled in this process, in order.
_GRAPHS: list[GraphReport] = []


def next_graph_index() -> int:
    """The index the next compiled graph's report gets ("graph N" in messages)."""
    return len(_GRAPHS)


def new_graph_report(options: Any) -> GraphReport:
    g = GraphReport(index=len(_GRAPHS), options=options)
    _GRAPHS.append(g)
    return g


def _bytes_text(n) -> str:
    """A byte count as the table prints it; under dynamic shapes a symbolic one (``128*s33``) as its expression."""
    return f"{n:.0f}" if isinstance(n, (int, float)) else str(n)


class CompileReport:
    """The graphs of one compiled module and what the passes decided for them."""

    def __init__(self, graphs: list[GraphReport], module: torch.nn.Module | None = None):
        self.graphs = graphs
        self._module = weakref.ref(module) if module is not None else None

    @property
    def graph(self) -> GraphReport:
        """The most recent graph (the only one when there was no graph break)."""
        return self.graphs[-1]

    @property
    def dtensor_code(self) -> str:
        return "\n".join(g.dtensor_code for g in self.graphs)

    @property
    def forward(self) -> fx.GraphModule | None:
        return self.graph.forward

    @property
    def backward(self) -> fx.GraphModule | None:
        return self.graph.backward

    @property
    def joint(self) -> fx.GraphModule | None:
        return self.graph.joint

    @property
    def collectives(self) -> list[CollectiveRecord]:
        return [c for g in self.graphs for c in g.collectives]

    def collective_counts(self, direction: str | None = None) -> dict[str, int]:
        """``{kind: count}`` over every graph, for one direction or both."""
        counts = collections.Counter(c.kind for c in self.collectives if direction in (None, c.direction))
        return dict(sorted(counts.items()))

    def table(self, width: int | None = None) -> str:
        """The collectives table as aligned text, one line per row; given ``width``, a ``rule`` wraps in its column."""
        head = ("graph", "dir", "kind", "group", "n", "shape", "dtype", "bytes", "wire/rank", "partner", "rule")
        rows = [head]
        for position, g in enumerate(self.graphs):  # position in this report, not the global index
            for c in g.collectives:
                rows.append(
                    (
                        str(position),
                        c.direction[:3],
                        c.kind,
                        c.group,
                        str(c.group_size),
                        "x".join(map(str, c.shape)) or "scalar",
                        dtype_str(c.dtype),
                        str(c.bytes),
                        _bytes_text(c.wire_bytes),
                        c.partner or "-",
                        c.rule,
                    )
                )
        return _aligned(rows, width) if len(rows) > 1 else "(no collectives in the compiled graphs)"

    def moves(self) -> str:
        """Every explicit move: value, layouts, what the solver costed next to what was emitted, and why."""
        rows = [("graph", "node", "value", "src -> dst", "costed", "emitted", "reason")]
        for position, g in enumerate(self.graphs):
            named = lambda kinds: _mesh_dims_named(kinds, (g.mesh or {}).get("names") or [])
            rows += [
                (
                    str(position),
                    r.node,
                    _dotted(r.value),
                    f"{r.src} -> {r.dst}",
                    named(r.costed) or "-",
                    named(r.emitted) or "-",
                    r.reason,
                )
                for r in g.redistributions
            ]
        return _aligned(rows, WIDTH) if len(rows) > 1 else "(no moves in the DTensor programs)"

    def partial_gradients(self) -> list[dict[str, Any]]:
        """Parameters whose current ``.grad`` is still Partial.

        DTensor leaves a replicated parameter's gradient Partial and reduces it
        outside the compiled graphs, one parameter at a time, wherever it is next
        needed replicated (typically in ``optimizer.step``): these reductions are
        not in `table`. Read this after ``backward()`` and before the step.
        """
        module = self._module() if self._module is not None else None
        if module is None:
            return []
        pending = []
        for name, p in module.named_parameters():
            g = p.grad
            if isinstance(g, DTensor) and partial_dims(g):
                pending.append(
                    {
                        "parameter": name,
                        "placements": layout_str(g.placements),
                        "bytes": nbytes(g),
                    }
                )
        return pending

    def strategy(self) -> dict[str, Any]:
        """The strategy as JSON-ready data (versioned)."""
        return {
            "version": 1,
            "mesh": self.graphs[0].mesh if self.graphs else None,
            "graphs": [
                {
                    "index": g.index,
                    "inference": g.inference,
                    "parameters": g.parameters,
                    "values": g.values,
                    "redistributions": [r.as_dict() for r in g.redistributions],
                    "collectives": [c.as_dict() for c in g.collectives],
                    "schedules": {k: {f: v for f, v in s.items() if f != "before"} for k, s in g.schedules.items()},
                    "layout": g.layout.as_dict(),
                    "tuning": g.tuning,
                }
                for g in self.graphs
            ],
        }

    def program_digest(self) -> str:
        """A digest of the forward and backward graphs emitted (every graph of the module): two
        compiles with one digest run the same program, whatever options chose it."""
        code = [gm.code for g in self.graphs for gm in (g.forward, g.backward) if gm is not None]
        return hashlib.sha1("\n".join(code).encode()).hexdigest()

    def timeline(self, costs: CostModel | None = None) -> "StepTimelines":
        """One training step estimated from the cost model, before and after the schedule pass.

        ``.before`` plays the graphs in the order AOTAutograd traced them,
        ``.after`` in the order the schedule pass emitted (see
        `torch_hca.report.timeline` for the model); each has ``exposed_comm_s``,
        ``chrome_trace()``, ``save_chrome_trace(path)`` and ``save_png(path)``.
        ``costs``: the figures to play them with (default: those the layout was solved with).
        """
        from torch_hca.report.timeline import estimate

        before, after, params = [], [], {}
        for g in self.graphs:
            for which in ("forward", "backward"):
                gm = getattr(g, which)
                if gm is None:
                    continue
                name = f"graph{g.index}.{which}"
                after.append((name, gm))
                before.append((name, g.schedules.get(which, {}).get("before", gm)))
                params[name] = len(g.parameters)
        if not after:
            raise HCAError(
                "hca.report(...).timeline(): no forward or backward graph was compiled (options inner='dtensor' "
                "runs the DTensor program eagerly); compile with inner='eager' or 'inductor' to estimate a step"
            )
        costs = costs or self.cost_model()
        return StepTimelines(estimate(before, costs, params=params), estimate(after, costs, params=params))

    def cost_model(self) -> CostModel:
        """The figures `timeline()` plays the graphs with by default: those the layout was solved
        with; under layout="tune" the calibrated ones (the kept program may have been laid out
        under communication priced otherwise)."""
        device = (self.graphs[0].mesh or {}).get("device_type", "cpu")
        tuning = self.graphs[0].tuning
        solved = (tuning or {}).get("cost_model") or self.graphs[0].layout.cost_model
        return CostModel(**solved) if solved else self.graphs[0].options.costs(device)

    def measured(self) -> "StepMeasure":
        """The compiled graphs' time on the clock against the cost model's prediction of it.

        Measured: the median wall time of each compiled forward and backward over its calls
        after the first (the last `CALLS_KEPT`), summed over the graphs. Predicted: the
        scheduled timeline (`timeline().after`) less each graph's call event (``call_s`` and
        ``param_s`` per parameter), the host work around a call that the measure does not see.
        CPU meshes only: a CUDA call returns before its kernels finish (use torch.profiler there).
        """
        timed = {
            (g.index, w): sorted(t) for g in self.graphs for w, t in g.call_times.items() if getattr(g, w) is not None
        }
        device = (self.graphs[0].mesh or {}).get("device_type", "cpu")
        if device != "cpu":
            raise HCAError(
                f"hca.report(...).measured(): the mesh is on {device!r}, whose calls return before their "
                "kernels finish; profile a step with torch.profiler instead"
            )
        if not timed:
            raise HCAError(
                "hca.report(...).measured(): no forward or backward graph was compiled (options "
                "inner='dtensor' runs the DTensor program eagerly); compile with inner='eager' or 'inductor'"
            )
        untimed = [f"graph {i} {w}" for (i, w), t in timed.items() if not t]
        if untimed:
            raise HCAError(
                f"hca.report(...).measured(): {', '.join(untimed)} has not run after its first call "
                "(the first compiles and checks); run a few training steps first"
            )
        measured = {key: t[len(t) // 2] for key, t in timed.items()}
        from torch_hca.report.timeline import CALL

        timeline = self.timeline().after
        predicted = timeline.total_s - sum(e.duration_s for e in timeline.events if e.name == CALL)
        return StepMeasure(
            predicted,
            sum(measured.values()),
            min(len(t) for t in timed.values()),
            {f"graph{i}.{w}": s for (i, w), s in measured.items()},
        )

    def explain(self) -> str:
        """Why each value has its placement: shape, layout chosen, cost terms, and what it beat."""
        parts = []
        for g in self.graphs:
            lay = g.layout
            head = f"== graph {g.index}: layout by {lay.solver}"
            if lay.solved:
                bound = lay.bound_s
                head += (
                    f", {lay.status}; objective {lay.objective_s * 1e6:.1f} us"
                    f"{'' if bound is None else f', bound {bound * 1e6:.1f} us'}; "
                    f"{lay.strategies} strategies, solved in {lay.seconds:.2f} s; "
                    f"cost model: {lay.cost_model_source or '?'}"
                )
            lines = [head + " =="]
            if g.tuning is not None:
                lines.append(tuning_line(g.tuning))
            rows = lay.values
            if rows:
                lines.append(
                    f"{'value':<24} {'shape':<14} {'placement':<10} {'reads':<24} "
                    f"{'compute':>9} {'fw comm':>9} {'bw comm':>9}  why"
                )
                for r in rows:
                    lines.append(
                        f"{r['value'][:24]:<24} {str(tuple(r['shape'])):<14} {r['placement']:<10} "
                        f"{','.join(r['reads']):<24} {r['compute_us']:>7.1f}us {r['forward_comm_us']:>7.1f}us "
                        f"{r['backward_comm_us']:>7.1f}us  {r['why']}"
                    )
            for left in lay.left_to_dtensor:
                lines.append(f"moved by DTensor's choice, not the solver's: {left}")
            parts.append("\n".join(lines))
        return "\n\n".join(parts)

    def to_json(self) -> str:
        return json.dumps(self.strategy(), indent=2, sort_keys=True, default=str)

    def save_strategy(self, path) -> dict[str, Any]:
        """Write the strategy file (docs/strategy.md) that ``options={"strategy": path}`` loads and
        `hca.verify` checks; returns its content."""
        from torch_hca.report.strategy_file import save

        return save(self, path)

    def parallelism(self) -> str:
        """One sentence per graph: what was stored, what the program does, its predicted step,
        and the user's layout as written priced by the same model (`torch_hca.report.parallelism`)."""
        return "\n".join(sentence(g) for g in self.graphs)

    def __str__(self) -> str:
        parts = [
            "== parallelism ==\n"
            + "\n".join(
                textwrap.fill(line, WIDTH, subsequent_indent="    ") for line in self.parallelism().splitlines()
            )
        ]
        for g in self.graphs:
            parts.append(f"== graph {g.index}: DTensor program ==\n{readable_code(g.dtensor_code)}")
        parts.append("== moves ==\n" + self.moves())
        parts.append("== collectives ==\n" + self.table(WIDTH))
        pending = self.partial_gradients()
        if pending:
            lines = [f"{p['parameter']} {p['placements']} {p['bytes']} bytes" for p in pending]
            parts.append("== gradients left Partial, reduced outside the graphs on first use ==\n" + "\n".join(lines))
        return "\n\n".join(parts)


@dataclass(frozen=True)
class StepMeasure:
    """`CompileReport.measured()`: a step's compiled graphs, predicted and on the clock."""

    predicted_s: float  # the scheduled timeline's forward + backward, less the host work around calls
    measured_s: float  # the sum over the compiled graphs of each one's median call
    calls: int  # calls timed per graph (the fewest of any graph)
    per_graph_s: dict[str, float]  # "graph0.forward" -> its median call

    @property
    def error(self) -> float:
        """How far the prediction is off: predicted / measured - 1 (-0.2: 20% too fast)."""
        return self.predicted_s / self.measured_s - 1

    def __str__(self) -> str:
        return (
            f"predicted {self.predicted_s * 1e3:.2f} ms vs measured {self.measured_s * 1e3:.2f} ms "
            f"(median of {self.calls}+ calls per graph) for the compiled forward + backward: "
            f"the cost model is off by {self.error:+.0%}"
        )


def tuning_line(tuning: dict[str, Any]) -> str:
    """One line: the candidates layout="tune" timed, the one kept first."""
    failed = "".join(f"; not compiled: {f}" for f in tuning.get("failed", []))
    if len(tuning["candidates"]) == 1:
        return f"tuned: one program to run ({tuning['candidates'][0]['layout']}), nothing timed{failed}"
    times = ", ".join(
        f"{c['layout']} {c['median_s'] * 1e3:.2f} ms"
        + ("" if c["predicted_s"] is None else f" (predicted {c['predicted_s'] * 1e3:.2f})")
        for c in tuning["candidates"]
    )
    return (
        f"tuned: kept {tuning['kept']} of {len(tuning['candidates'])} distinct layouts, by the slowest rank's "
        f"median of {tuning['rounds']} forward + backward runs on the first call's inputs: {times}{failed}"
    )


def _aligned(rows: list[tuple[str, ...]], width: int | None) -> str:
    """Rows as aligned columns; given ``width``, a row wider than it wraps its last (free text) column."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        line = "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
        lines += [line] if width is None or len(line) <= width else _wrap_last_column(r, widths, width)
    return "\n".join(lines)


def _mesh_dims_named(kinds: str, names: list[str]) -> str:
    """``"all_gather@0"`` -> ``"all_gather@dp"`` where the mesh names its dims."""
    return re.sub(r"@(\d+)", lambda m: "@" + (names[int(m[1])] if int(m[1]) < len(names) else m[1]), kinds or "")


def _dotted(name: str) -> str:
    """Dynamo's name of a module attribute as people write it: ``l_self_modules_fc2_parameters_bias_`` -> ``fc2.bias``."""
    if not name.startswith("l_self_"):
        return name
    path = name[len("l_self_") :].rstrip("_")
    for kind in ("modules", "parameters", "buffers"):  # "<kind>_" opens each step of the path
        path = re.sub(rf"(^|_){kind}_", lambda m: "." if m.group(1) else "", path)
    return path


_GETATTR = re.compile(r"getattr\(([^(),]*), '([^']*)'\)")
_SUBSCRIPT = re.compile(r"\[['\"]([^'\"]*)['\"]\]")
# Steps of a Dynamo source that are no step of the module path a user writes.
_NOT_A_STEP = {"__dict__", "_modules", "_parameters", "_buffers"}


def module_path(source: str) -> str:
    """Dynamo's source of a submodule or parameter as people write it.

    ``getattr(L['self'].__dict__['_hca_logical'].inner.blocks, '0').attn.wq`` -> ``blocks.0.attn.wq``,
    ``L['self']._modules['fc1']`` -> ``fc1``; the root module itself is ``""``. Text that is no
    such source comes back unchanged.
    """
    if not source.startswith(("L[", "getattr(")):
        return source
    path = source
    while True:  # getattr(x, 'k') -> x.k, innermost first
        shorter = _GETATTR.sub(r"\1.\2", path)
        if shorter == path:
            break
        path = shorter
    path = _SUBSCRIPT.sub(r".\1", path)  # x['k'] -> x.k
    steps = [s for s in path.split(".") if s and s not in _NOT_A_STEP]
    if steps[:2] == ["L", "self"] or steps[:1] == ["L"]:
        steps = steps[2:] if steps[1:2] == ["self"] else steps[1:]
    if "_hca_logical" in steps:  # hca.sharded's holder of the user's module (torch_hca.compiler.logical)
        steps = steps[steps.index("_hca_logical") + 1 :]
        steps = steps[1:] if steps[:1] == ["inner"] else steps
    return ".".join(steps)


def _wrap_last_column(row: tuple[str, ...], widths: list[int], width: int) -> list[str]:
    """A table row whose last column (free text) wraps within the column, or below the row if it is too narrow."""
    prefix = "  ".join(v.ljust(w) for v, w in zip(row[:-1], widths[:-1])) + "  "
    room = width - len(prefix)
    if room >= 30:
        text = _at_most(textwrap.wrap(row[-1], room, break_on_hyphens=False), room)
        return [prefix + text[0]] + [" " * len(prefix) + t for t in text[1:]]
    head = textwrap.wrap(prefix.rstrip(), width, subsequent_indent="    ")
    return head + _at_most(
        textwrap.wrap(row[-1], width, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False), width
    )


CELL_LINES = 3  # a wrapped cell's most lines; the whole text is in to_json() and debug_dir's collectives.txt


def _at_most(lines: list[str], width: int, most: int = CELL_LINES) -> list[str]:
    """A wrapped cell cut to `most` lines, the last ending in ``...`` when text was left out."""
    if len(lines) <= most:
        return lines
    last = lines[most - 1]
    return lines[: most - 1] + [(last if len(last) <= width - 3 else last[: width - 3].rstrip()) + "..."]


@dataclass
class StepTimelines:
    before: Any  # torch_hca.report.timeline.Timeline
    after: Any

    def summary(self) -> str:
        b, a = self.before, self.after
        return (
            f"exposed communication {b.exposed_comm_s * 1e6:.1f} us -> {a.exposed_comm_s * 1e6:.1f} us; "
            f"step {b.total_s * 1e6:.1f} us -> {a.total_s * 1e6:.1f} us (estimated)"
        )


def report(compiled: Any = None) -> CompileReport:
    """The report for a compiled module (or, given nothing, the last compiled graph).

    ``compiled`` is what ``torch.compile(model, backend="hca")`` returned, or the
    model itself. It must have been called at least once.
    """
    if compiled is None:
        kept = [g for g in _GRAPHS if g.dropped is None]
        if not kept:
            raise HCAError("hca.report(): nothing has been compiled with backend='hca' in this process")
        return CompileReport([kept[-1]])
    module = getattr(compiled, "_orig_mod", compiled)
    if not isinstance(module, torch.nn.Module):
        raise HCAError(f"hca.report: expected the module torch.compile returned, got {type(compiled).__name__}")
    params = list(module.parameters())
    graphs = [g for g in _GRAPHS if g.dropped is None and g.reads_any(params)]
    if not graphs:
        raise HCAError(
            f"hca.report: no graph of this {type(module).__name__} was compiled with backend='hca'; "
            "compile it with torch.compile(model, backend='hca') and call the compiled module once first"
        )
    return CompileReport(graphs, module)
