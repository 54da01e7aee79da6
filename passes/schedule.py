"""Schedule pass: bucket the collectives, then start each early and wait on it late.

The model (docs/theory.md, section 6, "Schedule equivalence"). A graph is a list of
events. Each reads and writes values; an async collective *leases* its input
buffers from its start until its ``wait_tensor``; all ranks of a group must
issue the group's collectives in one order. Two adjacent events that conflict
on no buffer and are not collectives of one group commute, and the
reordering below only ever makes such swaps:

* compute keeps the traced order;
* a collective starts as soon as its inputs and the previous collective of
  its group have run (at the latest where the graph had it), unless the bytes
  in flight would pass ``max_in_flight_mb``: then it waits for room, and when
  it reaches its traced place the oldest collectives in flight are waited
  first (a single collective larger than the bound runs alone);
* a ``wait_tensor``, and the late nodes that only finish its result (views,
  chunks, copies: `events.late_nodes`), run just before their first consumer
  (what only the graph output reads runs at the end, in traced order);
* in-place writes keep their place against every read and write of the same
  buffer, and after the wait of any collective that holds it.

The order depends only on the graph (positions and names), never on the rank
or on object ids, so every rank computes the same one. Bucketing
(`torch_hca.passes.buckets`) runs first and is a rewrite, not a swap.

The result is checked by the independent checker (`schedule_check.check_reorder`), and the
report records, per graph: ``order``, ``per_group`` and ``fingerprint`` (the
checker's), ``before`` (a copy of the graph as traced, for the timeline),
``buckets`` and ``moved``.

The options, with defaults: ``schedule=True``, ``bucket_cap_mb=None`` (from the cost model: see `CostModel.bucket_cap_bytes`; MiB of
payload per bucket, 0: no buckets), ``max_in_flight_mb=None`` (the larger of 64 MiB and twice
the graph's largest collective; `_in_flight_bound`). See
docs/scheduling.md.

Under ``inner="inductor"`` Inductor schedules the graph again. In torch 2.13
its scheduler first chains every collective to the previous one
(`comms.decide_global_ordering_of_comms`), so the issue order of collectives
(ours) is kept across all groups; compute, waits and the bucket copies may
still move: ``reorder_for_peak_memory`` (on by default) picks the order of
lowest estimated peak memory among ours and a few topological sorts, and
fusion merges the pointwise glue into kernels. Inductor's own overlap passes
(``reorder_for_compute_comm_overlap``, the FX bucketing passes,
``aten_distributed_optimizations``) are off by default and stay off: we never
set torch's config. Buckets survive (one collective stays one collective); on
CPU each ``all_reduce`` lowers to a copy and an in-place all_reduce. On the
4-layer data-parallel MLP with two buckets Inductor's code kept our order:
first bucket issued after the last two layers' gradients, both waits at the end.
"""

from __future__ import annotations


from typing import Any

import torch.fx as fx

from torch_hca._torch_private import copy_graph_module, group_size
from torch_hca.spmd.collective_nodes import OPS, WAIT, node_group, payload_bytes
from torch_hca.errors import CheckError
from torch_hca.compiler.checks.schedule_check import check_reorder

from .buckets import bucket_collectives
from torch_hca.spmd.events import is_start, is_view, late_nodes, waits_of, written
from .infra import PassContext, PassResult

MB = 2**20


class SchedulePass:
    name = "schedule"
    reads = "forward or backward graph (local tensors, _c10d_functional)"
    writes = "the same graph, collectives bucketed, started early and waited late, checked"

    def __init__(self, which: str):
        self.which = which
        self.name = f"schedule_{which}"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        before = copy_graph_module(gm)
        opts = ctx.options
        buckets: list[dict[str, Any]] = []
        moved = {"starts_earlier": 0, "waits_later": 0, "waits_forced": 0}
        bucketed, reordered = before, False
        cap = bound = None
        if opts.schedule:
            cap, bound = _bucket_cap(gm, ctx), _in_flight_bound(gm, opts.max_in_flight_mb)
            buckets = bucket_collectives(gm.graph, self.which, cap)
            bucketed = copy_graph_module(gm)  # the checker's baseline: buckets and moved singles are rewrites
            traced = list(gm.graph.nodes)
            order, forced = plan_order(gm.graph, bound)
            moved = {**count_moves(traced, order), "waits_forced": forced}
            reordered = order != traced
            apply_order(gm.graph, order)
        summary = check_reorder(bucketed, gm, self.which)  # before: bucketing is a rewrite, not a swap
        ctx.report.schedules[self.which] = {
            "order": "scheduled" if opts.schedule else "as traced",
            "per_group": summary.per_group,
            "fingerprint": summary.fingerprint,
            "before": before,
            "buckets": buckets,
            "bucket_cap_bytes": cap,  # the rules the buckets and the order kept (strategy file: `schedule`)
            "in_flight_bytes": bound,
            "moved": moved,
        }
        decisions = [
            f"{b['collective']}: {b['kind']} of {[m for m, _ in b['members']]} ({b['bytes']} bytes)" for b in buckets
        ]
        decisions.append(
            f"{ctx.report.schedules[self.which]['order']}; moved {moved}; fingerprint {summary.fingerprint}"
        )
        return PassResult(gm, bool(buckets) or reordered, decisions)


def _bucket_cap(gm: fx.GraphModule, ctx: PassContext) -> float:
    """Bytes per bucket: the option, or the cost model's choice for the largest group here."""
    if ctx.options.bucket_cap_mb is not None:
        return ctx.options.bucket_cap_mb * MB
    sizes = [group_size(node_group(n)) for n in gm.graph.nodes if n.op == "call_function" and n.target in OPS]
    device = (ctx.report.mesh or {}).get("device_type", "cpu")
    return ctx.options.costs(device).bucket_cap_bytes(max(sizes, default=1))


def _in_flight_bound(gm: fx.GraphModule, option_mb: float | None) -> float:
    """Bytes in flight: the option, else the larger of 64 MiB and twice the largest collective's
    payload. A collective over the bound runs alone: its wait comes before the next start, so a
    fixed 64 MiB bound waited on a 98 MiB LM-head gradient as soon as the next bucket was ready."""
    if option_mb is not None:
        return option_mb * MB
    largest = max((payload_bytes(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in OPS), default=0)
    return max(64 * MB, 2 * largest)


# ---------------------------------------------------------------- the model


def _effect_deps(nodes: list[fx.Node], waits_of: dict[fx.Node, list[fx.Node]]) -> dict[fx.Node, list[fx.Node]]:
    """Orderings that data edges miss: an in-place write after the reads before it (and
    after the wait of a collective that holds the buffer), reads after the write."""
    root: dict[fx.Node, fx.Node] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}
    writer: dict[fx.Node, fx.Node] = {}
    extra: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        reads = [root.get(a, a) for a in n.all_input_nodes]
        more = [writer[r] for r in reads if r in writer and writer[r] is not n]
        for r in (root.get(w, w) for w in written(n)):
            for reader in readers.pop(r, []):
                more += [reader, *waits_of.get(reader, [])] if reader is not n else []
            writer[r] = n
        for r in reads:
            readers.setdefault(r, []).append(n)
        if is_view(n) and isinstance(n.args[0], fx.Node):
            root[n] = root.get(n.args[0], n.args[0])
        if more:
            extra[n] = list(dict.fromkeys(more))
    return extra


# ---------------------------------------------------------- the reordering


class _Scheduler:
    """Lists the nodes: compute in traced order, starts hoisted, waits pulled on demand."""

    def __init__(self, graph: fx.Graph, bound_bytes: float):
        self.nodes = list(graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        starts = [n for n in self.nodes if is_start(n)]
        self.waits_of = {s: waits_of(s) for s in starts}
        self.start_of = {w: s for s, ws in self.waits_of.items() for w in ws}
        self.late = late_nodes(self.nodes)
        extra = _effect_deps(self.nodes, self.waits_of)
        self.deps = {n: list(dict.fromkeys([*n.all_input_nodes, *extra.get(n, [])])) for n in self.nodes}
        last_of_group: dict[str, fx.Node] = {}
        for s in starts:  # one issue order per group: the graph's
            group = node_group(s)
            if group in last_of_group and last_of_group[group] not in self.deps[s]:
                self.deps[s].append(last_of_group[group])
            last_of_group[group] = s
        self.nbytes = {s: payload_bytes(s) for s in starts}
        self.missing = {s: len(self.deps[s]) for s in starts}
        self.dependents: dict[fx.Node, list[fx.Node]] = {}
        for s in starts:
            for d in self.deps[s]:
                self.dependents.setdefault(d, []).append(s)
        self.bound = bound_bytes
        self.placed: dict[fx.Node, None] = {}
        self.ready: list[fx.Node] = []  # starts whose dependencies have run, traced order
        self.in_flight: dict[fx.Node, int] = {}  # start -> waits still to run (insertion order: FIFO)
        self.in_bytes = 0
        self.forced = 0
        self.holding = False  # no hoisting while waits are forced for room

    def place(self, n: fx.Node) -> None:
        self.placed[n] = None
        if n in self.nbytes:
            self.ready.remove(n)
            if self.waits_of[n]:  # one never waited on holds nothing we can free (the checker rejects it)
                self.in_flight[n] = len(self.waits_of[n])
                self.in_bytes += self.nbytes[n]
        start = self.start_of.get(n)
        if start is not None:
            self.in_flight[start] -= 1
            if not self.in_flight[start]:
                del self.in_flight[start]
                self.in_bytes -= self.nbytes[start]
        for s in self.dependents.get(n, []):
            self.missing[s] -= 1
            if not self.missing[s]:
                self.ready.append(s)
                self.ready.sort(key=self.pos.__getitem__)
        self.hoist()

    def fits(self, s: fx.Node) -> bool:
        return not self.in_flight or self.in_bytes + self.nbytes[s] <= self.bound

    def hoist(self) -> None:
        if self.holding:
            return
        self.holding = True  # the loop below takes what each placement makes ready
        while (s := next((s for s in self.ready if self.fits(s)), None)) is not None:
            self.place(s)
        self.holding = False

    def pull(self, n: fx.Node) -> None:
        """Place `n` now, after what it reads that is still unplaced (only late nodes can be)."""
        stack = [n]
        while stack:
            top = stack[-1]
            if top in self.placed:  # placed by a hoist while its dependencies were pulled
                stack.pop()
                continue
            missing = next((d for d in self.deps[top] if d not in self.placed), None)
            if missing is not None:
                if missing not in self.late:
                    raise CheckError(f"schedule pass: {top.name} needs {missing.name}, which is not placed yet")
                stack.append(missing)
                continue
            stack.pop()
            if top in self.nbytes:
                self.make_room(top)
            self.place(top)

    def make_room(self, s: fx.Node) -> None:
        held, self.holding = self.holding, True
        while not self.fits(s):
            oldest = next(iter(self.in_flight))
            for w in self.waits_of[oldest]:
                if w not in self.placed:
                    self.pull(w)
                    self.forced += 1
        self.holding = held

    def run(self) -> list[fx.Node]:
        self.holding = True  # the inputs first, together: nothing between them
        for n in self.nodes:
            if n.op == "placeholder":
                self.place(n)
        self.holding = False
        self.hoist()
        for n in self.nodes:
            if n not in self.placed and n not in self.late and n.op != "output":
                self.pull(n)
        for n in self.nodes:  # what only the output reads, in traced order; then the output
            if n not in self.placed:
                self.pull(n)
        return list(self.placed)


def plan_order(graph: fx.Graph, bound_bytes: float) -> tuple[list[fx.Node], int]:
    """The scheduled order of `graph`'s nodes and how many waits the bound forced early."""
    s = _Scheduler(graph, bound_bytes)
    return s.run(), s.forced


def apply_order(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Move `graph`'s nodes into `order` (every node once, the output last)."""
    first = next(iter(graph.nodes))
    if order[0] is not first:
        first.prepend(order[0])
    for a, b in zip(order, order[1:]):
        if a.next is not b:
            a.append(b)


def count_moves(before: list[fx.Node], after: list[fx.Node]) -> dict[str, int]:
    """Starts that now have less compute before them, waits that have more."""
    late = late_nodes(before)

    def compute_before(order):
        seen, out = 0, {}
        for n in order:
            out[n] = seen
            seen += n.op == "call_function" and not is_start(n) and n not in late
        return out

    b, a = compute_before(before), compute_before(after)
    starts = [n for n in before if is_start(n)]
    waits = [n for n in before if n.op == "call_function" and n.target is WAIT]
    return {"starts_earlier": sum(a[s] < b[s] for s in starts), "waits_later": sum(a[w] > b[w] for w in waits)}
