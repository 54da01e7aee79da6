"""`hca.report`: what the compiler did, for people and for tests.

One `GraphReport` (`torch_hca.report.records`) per graph Dynamo hands the backend (a graph
break makes two); a `CompileReport` gathers those of one compiled module and reads them out
as text (`torch_hca.report.text`) and JSON.
"""

from __future__ import annotations

import collections
import hashlib
import json
import textwrap
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from torch_hca.errors import HCAError
from torch_hca.report import deployment_view
from torch_hca.spmd.cost_model import CostModel
from torch_hca.spmd.collective_nodes import nbytes
from torch_hca.spmd.placements import dtype_str, layout_str, partial_dims
from torch_hca.report.parallelism import sentence
from torch_hca.report.records import CollectiveRecord, GraphReport, StepMeasure, StepTimelines
from torch_hca.report.text import WIDTH, aligned, bytes_text, dotted, mesh_dims_named, readable_code, tuning_line


# Every graph compiled in this process, in order.
_GRAPHS: list[GraphReport] = []


def next_graph_index() -> int:
    """The index the next compiled graph's report gets ("graph N" in messages)."""
    return len(_GRAPHS)


def new_graph_report(options: Any) -> GraphReport:
    g = GraphReport(index=len(_GRAPHS), options=options)
    _GRAPHS.append(g)
    return g


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
                        bytes_text(c.wire_bytes),
                        c.partner or "-",
                        c.rule,
                    )
                )
        return aligned(rows, width) if len(rows) > 1 else "(no collectives in the compiled graphs)"

    def moves(self) -> str:
        """Every explicit move: value, layouts, what the solver costed next to what was emitted, and why."""
        rows = [("graph", "node", "value", "src -> dst", "costed", "emitted", "reason")]
        for position, g in enumerate(self.graphs):
            named = lambda kinds: mesh_dims_named(kinds, (g.mesh or {}).get("names") or [])
            rows += [
                (
                    str(position),
                    r.node,
                    dotted(r.value),
                    f"{r.src} -> {r.dst}",
                    named(r.costed) or "-",
                    named(r.emitted) or "-",
                    r.reason,
                )
                for r in g.redistributions
            ]
        return aligned(rows, WIDTH) if len(rows) > 1 else "(no moves in the DTensor programs)"

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
            view = self.deployment_view(g)
            if view is not None:
                lines.append(deployment_view.sentence(view))
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
                        f"{r.value[:24]:<24} {str(tuple(r.shape)):<14} {r.placement:<10} "
                        f"{','.join(r.reads):<24} {r.compute_us:>7.1f}us {r.forward_comm_us:>7.1f}us "
                        f"{r.backward_comm_us:>7.1f}us  {r.why}"
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
        and the user's layout as written priced by the same model (`torch_hca.report.parallelism`);
        under shares with a deployment, each rank's rows and predicted step (`deployment_view`)."""
        lines = []
        for g in self.graphs:
            view = self.deployment_view(g)
            lines.append(sentence(g) + (f"; {deployment_view.sentence(view)}" if view else ""))
        return "\n".join(lines)

    def _module_entry(self, key: str) -> Any:
        """What the sharded module keeps under `key` (its spec, its last call's rows), or None."""
        module = self._module() if self._module is not None else None
        return module.__dict__.get(key) if module is not None else None

    def deployment_view(self, g: GraphReport) -> dict | None:
        """Each rank's rows and predicted step for graph `g` under the module's deployment
        (``hca.sharded(..., deployment=)``), None without one or without a batch cut by rows."""
        return deployment_view.per_rank(g, self._module_entry("_hca_spec"), self._module_entry("_hca_uneven_rows"))

    def deployment(self) -> dict | None:
        """The module's deployment as its JSON data (``hca.sharded(..., deployment=)``), or None."""
        dep = getattr(self._module_entry("_hca_spec"), "deployment", None)
        return dep.to_dict() if dep is not None else None

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
