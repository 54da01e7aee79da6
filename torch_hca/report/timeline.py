"""Estimate one training step over time: compute and communication, from a cost model.

`estimate` plays the graphs the backend emits (local tensors, aten ops,
`_c10d_functional` collectives) on lanes, one compute lane and one lane per
process group::

    compute   |relu| mm |            (waits)            | mul |
    comm:0              |--------- all_reduce ---------|
                        ^ issued                        ^ wait_tensor returns

The rules (a model, not a measurement; deterministic):

* the graphs run one after another, in the order given, on one clock;
* the compute lane runs the nodes in graph order; an aten op takes
  ``costs.compute_s(flops, bytes)``: FLOPs from torch's per-op formulas
  (`torch.utils.flop_counter.flop_registry`) where it has one, else one per
  output element; bytes are the tensors it reads plus those it writes, read
  from ``node.meta["val"]`` (a node without one costs nothing);
* every op but getitem also takes ``costs.op_s``, the host time to issue it
  (Python, FX, the dispatcher); placeholders, outputs and getitem take no
  time, views and ops that return no tensor only ``op_s``;
* each graph starts with ``costs.call_s`` on the compute lane (event "call"):
  the host time a call of a compiled graph costs beyond its ops, and
  ``costs.param_s`` for each DTensor parameter it reads (``params``);
* a collective is issued at the compute lane's current time and takes no
  compute time; it runs on its group's lane (``"comm:<group name>"``) from
  ``max(issue time, lane free)`` for ``costs.collective_s(kind, payload, n)``,
  so one group's collectives run one after another and groups in parallel;
  a coalesced collective is one transfer of all its tensors;
* `wait_tensor` holds the compute lane until its collective ends (every
  getitem of a coalesced collective resolves to that one transfer);
* while any collective runs, the compute lane works at ``1 - costs.contention``
  of its speed: the transport's threads take the cores compute runs on (at
  contention 1 compute stops, and overlap hides nothing).

``compute_s`` is the compute lane's work at full speed, and ``exposed_comm_s =
total_s - compute_s`` the time communication adds: waits, and compute slowed
by contention. With each wait right after its start (the traced order) it is
all the communication; issuing early and waiting late hides up to the compute
in between, less its contention.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

import torch_hca._torch_private as _torch_private
from torch_hca.spmd.collective_nodes import OPS, WAIT, nbytes, node_group, payload_bytes
from torch_hca.spmd.cost_model import CostModel, smallest_matmul_dim
from torch_hca.spmd.op_families import ATEN_MATMULS, aten_flops, is_view_op
from torch_hca.errors import HCAError

COMPUTE = "compute"
CALL = "call"  # the event of a graph's call_s


@dataclass
class Event:
    name: str
    lane: str  # "compute" or "comm:<group name>"
    start_s: float
    end_s: float
    node: str
    graph: str

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Timeline:
    events: list[Event]
    total_s: float  # end of the last event
    compute_s: float  # the compute lane's work at full speed
    comm_s: float  # sum of communication durations
    exposed_comm_s: float  # total_s - compute_s: time communication adds (waits, contention)

    def lanes(self) -> list[str]:
        """ "compute" first, then the communication lanes in the order they were first used."""
        comm = [e.lane for e in self.events if e.lane != COMPUTE]
        return [COMPUTE, *dict.fromkeys(comm)]

    def chrome_trace(self) -> dict:
        """Chrome trace-event JSON (µs, one thread per lane); opens in Perfetto or chrome://tracing."""
        tids = {lane: i for i, lane in enumerate(self.lanes())}
        names = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "torch_hca step estimate"}}]
        for lane, tid in tids.items():
            names.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": lane}})
            names.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
        spans = [
            {
                "name": e.name,
                "cat": e.graph,
                "ph": "X",
                "pid": 0,
                "tid": tids[e.lane],
                "ts": e.start_s * 1e6,
                "dur": e.duration_s * 1e6,
                "args": {"node": e.node, "graph": e.graph},
            }
            for e in self.events
        ]
        return {"traceEvents": names + spans, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()))

    def save_png(self, path) -> None:
        """A Gantt chart of the lanes, coloured by graph (needs matplotlib)."""
        try:
            from matplotlib.figure import Figure  # no pyplot: leaves matplotlib's global state alone
            from matplotlib.patches import Patch
        except ImportError as e:
            raise HCAError(
                'Timeline.save_png draws with matplotlib, which is not installed; pip install "torch_hca[plot]"'
            ) from e
        lanes = self.lanes()
        colours = {g: f"C{i}" for i, g in enumerate(dict.fromkeys(e.graph for e in self.events))}
        fig = Figure(figsize=(10, 1.5 + 0.5 * len(lanes)))
        ax = fig.subplots()
        for row, lane in enumerate(lanes):
            mine = [e for e in self.events if e.lane == lane]
            ax.broken_barh(
                [(e.start_s * 1e3, e.duration_s * 1e3) for e in mine],
                (row - 0.4, 0.8),
                facecolors=[colours[e.graph] for e in mine],
                edgecolor="white",
                linewidth=0.3,
            )
        ax.set_yticks(range(len(lanes)), labels=lanes)
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)")
        if len(colours) > 1:
            ax.legend(handles=[Patch(color=c, label=g) for g, c in colours.items()], loc="upper right", fontsize=8)
        ax.set_title(self.summary(), fontsize=8, wrap=True)
        fig.tight_layout()
        fig.savefig(path)

    def summary(self) -> str:
        collectives = sum(e.lane != COMPUTE for e in self.events)
        hidden = max(0.0, 1 - self.exposed_comm_s / self.comm_s) if self.comm_s else 1.0  # no "-0%" from rounding
        return (
            f"step ~{_duration(self.total_s)}: compute {_duration(self.compute_s)}, communication "
            f"{_duration(self.comm_s)} in {collectives} collective(s) on {len(self.lanes()) - 1} group(s), "
            f"exposed {_duration(self.exposed_comm_s)} ({hidden:.0%} of communication hidden behind compute)"
        )


def _duration(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


# ------------------------------------------------------------- op costs


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def op_seconds(node: fx.Node, costs: CostModel) -> float:
    """Compute-lane seconds of one non-collective node (0 for free or unknown ones)."""
    op = node.target
    out = node.meta.get("val")
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or is_view_op(op) or not _tensors(out):
        return 0.0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    touched = sum(nbytes(t) for t in _tensors((args, kwargs))) + sum(nbytes(t) for t in _tensors(out))
    return costs.compute_s(aten_flops(op, args, kwargs, out), float(touched), _smallest_matmul_dim(op, args, out))


def _smallest_matmul_dim(op: torch._ops.OpOverload, args, out) -> float | None:
    """`smallest_matmul_dim` of an aten matmul (None: not a matmul)."""
    first = ATEN_MATMULS.get(op)
    if first is None or not isinstance(out, torch.Tensor) or out.dim() < 2 or len(args) <= first:
        return None
    a = args[first]
    return smallest_matmul_dim(a.shape, out.shape, against_weight=False) if isinstance(a, torch.Tensor) else None


# ------------------------------------------------------------ the player


class _Player:
    """The clocks: the compute lane's time, each group lane's free time, each collective's end."""

    def __init__(self, costs: CostModel, group_size: Callable[[str], int], params: Mapping[str, int]):
        self.costs = costs
        self.group_size = group_size
        self.params = params
        self.sizes: dict[str, int] = {}
        self.now = 0.0
        self.work = 0.0  # compute-lane seconds at full speed
        self.busy: list[tuple[float, float]] = []  # (start, end) of collectives that may still run
        self.lane_free: dict[str, float] = {}
        self.ends: dict[fx.Node, float] = {}  # collective, or getitem of a coalesced one -> its end
        self.events: list[Event] = []

    def play(self, graph: str, gm: fx.GraphModule) -> None:
        called = self.costs.call_s + self.costs.param_s * self.params.get(graph, 0)
        if called > 0:  # the host work of calling the graph, before its first op
            self.run(Event(CALL, COMPUTE, self.now, self.now, "", graph), called)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in OPS:
                self.issue(graph, node)
            elif node.target is WAIT:
                self.now = max(self.now, self.ends.get(node.args[0], self.now))
            elif node.target is operator.getitem and node.args[0] in self.ends:
                self.ends[node] = self.ends[node.args[0]]
            else:
                self.compute(graph, node)

    def compute(self, graph: str, node: fx.Node) -> None:
        # Every op the program runs pays the host cost of issuing it; getitem is Python only.
        seconds = op_seconds(node, self.costs) + (0.0 if node.target is operator.getitem else self.costs.op_s)
        if seconds > 0:
            self.run(Event(str(node.target.overloadpacket), COMPUTE, self.now, self.now, node.name, graph), seconds)

    def run(self, event: Event, seconds: float) -> None:
        """Put `seconds` of compute on the lane from now: slower where collectives run."""
        self.work += seconds
        self.now = event.end_s = self.finish(self.now, seconds)
        self.events.append(event)

    def finish(self, start: float, seconds: float) -> float:
        """When compute of `seconds` begun at `start` ends, at speed 1 - contention while a
        collective runs. Collectives issued later start later, so the known ones suffice."""
        speed = 1.0 - self.costs.contention
        self.busy = [(s, e) for s, e in self.busy if e > start]
        if speed == 1.0 or not self.busy:
            return start + seconds
        t = start
        for s, e in _union(self.busy):
            if s > t:  # free until the next collective starts
                if seconds <= s - t:
                    return t + seconds
                seconds -= s - t
                t = s
            if speed > 0 and seconds <= (e - t) * speed:
                return t + seconds / speed
            seconds -= (e - t) * speed
            t = e
        return t + seconds

    def issue(self, graph: str, node: fx.Node) -> None:
        info, group = OPS[node.target], node_group(node)
        if group not in self.sizes:
            self.sizes[group] = self.group_size(group)
        payload = payload_bytes(node)
        seconds = self.costs.collective_s(info.kind, payload, self.sizes[group])
        lane = f"comm:{group}"
        start = max(self.now, self.lane_free.get(lane, 0.0))
        self.ends[node] = self.lane_free[lane] = start + seconds
        if seconds > 0:  # a group of one moves nothing
            self.busy.append((start, start + seconds))
            name = info.kind.value + (" (coalesced)" if info.coalesced else "")
            self.events.append(Event(name, lane, start, start + seconds, node.name, graph))


def estimate(
    graphs: list[tuple[str, fx.GraphModule]],
    costs: CostModel,
    group_size: Callable[[str], int] = _torch_private.group_size,
    params: Mapping[str, int] | None = None,
) -> Timeline:
    """Play ``[(name, graph), ...]`` (e.g. forward then backward) on the lanes; see the module
    docstring. ``params``: the DTensor parameters each named graph reads (default none)."""
    player = _Player(costs, group_size, params or {})
    for name, gm in graphs:
        player.play(name, gm)
    events = player.events
    total = max((e.end_s for e in events), default=0.0)
    comm = sum(e.duration_s for e in events if e.lane != COMPUTE)
    return Timeline(events, total, player.work, comm, max(0.0, total - player.work))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The spans merged where they overlap, in order."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged
