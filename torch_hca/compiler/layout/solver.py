"""The layout solver: a placement for every value of a DTensor program, chosen globally by cost.

Each op of the Dynamo graph gets a *strategy*: the layout of each DTensor it
reads and the layout it writes. The candidates are found by asking DTensor
itself (`torch_hca.compiler.layout.candidates`: every combination of input layouts run
on fake DTensors; parameters keep their storage layout or are gathered;
program inputs and explicit redistributions are fixed). An edge producer -> consumer whose layouts differ pays for a
redistribution.

The cost of a choice (seconds, `torch_hca.spmd.cost_model`):
  * forward redistributions, and in backward their transposes (docs/theory.md,
    section 3: all_gather <-> reduce_scatter, all_to_all <-> all_to_all,
    all_reduce P->R <-> nothing, unless the cotangent comes back partial);
  * the reduction a replicated value's cotangent needs when something reads
    it on a split mesh dimension (the eager role): counted once per value,
    because partial cotangents are summed before they are reduced;
  * collectives on parameters (weight gathers, gradient reductions) pay
    bandwidth only: the scheduler merges them into buckets, which share the
    per-collective latency;
  * compute, forward and backward, divided over the mesh dimensions the op's
    work is split on (replicated work costs more);
  * activation memory (options `memory_weight`, `memory_budget`).

The exact solve is an integer program (`scipy.optimize.milp`, HiGHS): one
binary per (op, strategy), one per (edge, producer layout, consumer layout)
where both ends have a choice, marginals tying them together. It has a time
limit; without a solution in time a greedy pass (each op in graph order takes
its cheapest strategy given its producers) decides. Every rank solves, and every
rank keeps rank 0's choice (`_rank0s_choice`). Probes are cached by op
and layouts, so repeated layers are probed once; the integer program itself
spans the whole graph.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist
import torch.fx as fx

from torch_hca.compiler.layout.candidates import Layout, Op, Strategy, split_factor, value_bytes
from torch_hca.compiler.layout.move_costs import Costs
from torch_hca.compiler.layout.uneven_moves import UNEVEN_MOVE_S, moves_uneven, refuse_uneven_moves
from torch_hca.compiler.layout.value_row import ValueRow
from torch_hca.spmd.placements import layout_str
from torch_hca.errors import PlanError
from torch_hca.runtime.exchange import exchange, needs_exchange


@dataclass
class Solution:
    choice: dict[fx.Node, Strategy]
    solver: str
    objective_s: float
    bound_s: float | None
    status: str
    seconds: float
    explain: list[ValueRow] = field(default_factory=list)


# ----------------------------------------------------------------------------- the integer program


class _Program:
    """Sparse rows and a cost vector, built incrementally."""

    def __init__(self):
        self.cost: list[float] = []
        self.integral: list[int] = []
        self.lower: list[float] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.constant = 0.0

    def var(self, cost: float = 0.0, integral: bool = True, lower: float = 0.0) -> int:
        self.cost.append(cost)
        self.integral.append(1 if integral else 0)
        self.lower.append(lower)
        return len(self.cost) - 1

    def row(self, coeffs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coeffs, lo, hi))

    def solve(self, time_limit: float):
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        r, c, v = [], [], []
        for i, (coeffs, _, _) in enumerate(self.rows):
            for j, x in coeffs.items():
                r.append(i), c.append(j), v.append(x)
        a = coo_matrix((v, (r, c)), shape=(len(self.rows), len(self.cost))).tocsr()
        lo = np.array([row[1] for row in self.rows])
        hi = np.array([row[2] for row in self.rows])
        return milp(
            c=np.array(self.cost),
            integrality=np.array(self.integral),
            bounds=Bounds(np.array(self.lower), np.ones(len(self.cost))),
            constraints=[LinearConstraint(a, lo, hi)] if self.rows else [],
            options={"time_limit": time_limit, "disp": False},
        )


@dataclass
class _Edge:
    producer: Op
    consumer: Op
    slot: int


def _edges(ops: list[Op]) -> list[_Edge]:
    by_node = {op.node: op for op in ops}
    return [_Edge(by_node[s], op, i) for op in ops for i, s in enumerate(op.slots) if s in by_node]


def _key(s: Strategy, slot: int) -> tuple:
    return (s.inputs[slot], s.varying)


def _edge_cost(
    costs: Costs, e: _Edge, out: Layout, key: tuple, used: dict | None = None
) -> tuple[float, float, list[int]]:
    """Forward and backward seconds of the edge, and the mesh dims whose reduction its value owes.

    Moves of a parameter are bucketed: they add their bucket to `used`.
    """
    q, varying = key
    if moves_uneven(e.producer, out, key, costs.sizes):
        return UNEVEN_MOVE_S, 0.0, []
    nbytes = value_bytes(e.producer.value)
    bucketed = e.producer.is_parameter
    fw = costs.forward(nbytes, out, q, bucketed, used)
    if not e.producer.requires_grad:
        return fw, 0.0, []
    bw, owed = costs.backward(nbytes, out, q, varying, bucketed, used)
    return fw, bw, owed


def _moved_bytes(costs: Costs, e: _Edge, out: Layout, key: tuple) -> float:
    """Memory a redistribution allocates: this rank's piece of the value in its new layout."""
    q = key[0]
    if out == q:
        return 0.0
    return value_bytes(e.producer.value) / math.prod(split_factor(p, n) for p, n in zip(q, costs.sizes))


def _bucket_order(bucket: tuple) -> tuple:
    """A bucket's sort key, the same in every process (no hashes, no ids)."""
    direction, kind, m = bucket
    return (direction, kind.value, m)


def _reduction(costs: Costs, op: Op, layout: Layout, m: int, used: dict | None = None) -> float:
    return costs.reduction(value_bytes(op.value), layout, m, op.is_parameter, used)


def _own_cost(s: Strategy, memory_weight: float) -> float:
    return s.compute_s + memory_weight * s.memory_bytes


class _Formulation:
    """The integer program of one solve: a binary per (op, strategy) and per chosen edge pair,
    and the variables choices share: a bucket's latency, a value's owed reduction."""

    def __init__(self, ops: list[Op], costs: Costs, memory_weight: float):
        self.ops, self.costs, self.memory_weight = ops, costs, memory_weight
        self.prog = prog = _Program()
        self.y: dict[tuple[int, int], int] = {}
        for i, op in enumerate(ops):
            for j, s in enumerate(op.strategies):
                self.y[i, j] = prog.var(_own_cost(s, memory_weight))
            prog.row({self.y[i, j]: 1.0 for j in range(len(op.strategies))}, 1.0, 1.0)
        self.index = {id(op): i for i, op in enumerate(ops)}
        # Activation memory per rank: each op's result, and each redistribution's copy.
        self.memory = {self.y[i, j]: s.memory_bytes for i, op in enumerate(ops) for j, s in enumerate(op.strategies)}
        self.owed_vars: dict[tuple[int, Layout, int], int] = {}
        self.bucket_vars: dict[tuple, int] = {}

    def at_least(self, var: int, on: dict[int, float]) -> None:
        """var >= the sum of `on` (binaries of which at most one is set)."""
        self.prog.row({var: 1.0, **{v: -c for v, c in on.items()}}, 0.0, np.inf)

    def in_buckets(self, used: dict, on: dict[int, float]) -> None:
        """Choosing `on` puts collectives in these buckets: each bucket pays its latency once."""
        for b in sorted(used, key=_bucket_order):  # variables in an order every rank shares
            if b not in self.bucket_vars:
                self.bucket_vars[b] = self.prog.var(self.costs.bucket_latency(b))
            self.at_least(self.bucket_vars[b], on)

    def owe(self, pi: int, out: Layout, m: int, on: dict[int, float]) -> None:
        """The value `pi` (written as `out`) owes one reduction on mesh dim m when `on` is chosen."""
        k = (pi, out, m)
        if k not in self.owed_vars:
            used: dict = {}
            self.owed_vars[k] = self.prog.var(_reduction(self.costs, self.ops[pi], out, m, used), integral=False)
            self.in_buckets(used, {self.owed_vars[k]: 1.0})
        self.at_least(self.owed_vars[k], on)

    def add_edge(self, e: _Edge) -> None:
        prog, y = self.prog, self.y
        pi, ci = self.index[id(e.producer)], self.index[id(e.consumer)]
        outs = list(dict.fromkeys(s.output for s in e.producer.strategies))
        keys = list(dict.fromkeys(_key(s, e.slot) for s in e.consumer.strategies))
        out_vars = {o: {y[pi, j]: 1.0 for j, s in enumerate(e.producer.strategies) if s.output == o} for o in outs}
        key_vars = {
            k: {y[ci, j]: 1.0 for j, s in enumerate(e.consumer.strategies) if _key(s, e.slot) == k} for k in keys
        }
        pairs: dict[tuple, int] = {}
        for o, k in itertools.product(outs, keys):
            used: dict = {}
            fw, bw, owed = _edge_cost(self.costs, e, o, k, used)
            moved = _moved_bytes(self.costs, e, o, k)
            cost = fw + bw + self.memory_weight * moved
            if len(outs) == 1 or len(keys) == 1:
                # One end has a single choice: the pair is chosen with the other end's binary.
                on = key_vars[k] if len(outs) == 1 else out_vars[o]
                for v in on:
                    prog.cost[v] += cost
            else:
                on = {prog.var(cost): 1.0}
                pairs[o, k] = next(iter(on))
            for v in on:
                self.memory[v] = self.memory.get(v, 0.0) + moved
            for m in owed:
                self.owe(pi, o, m, on)
            self.in_buckets(used, on)
        if pairs:  # both ends choose: the pair binaries' marginals are the ends' binaries
            for o in outs:
                prog.row({**{pairs[o, k]: 1.0 for k in keys}, **{v: -1.0 for v in out_vars[o]}}, 0.0, 0.0)
            for k in keys:
                prog.row({**{pairs[o, k]: 1.0 for o in outs}, **{v: -1.0 for v in key_vars[k]}}, 0.0, 0.0)


def solve(
    ops: list[Op],
    costs: Costs,
    *,
    memory_weight: float = 0.0,
    memory_budget: float | None = None,
    time_limit_s: float = 10.0,
) -> Solution:
    """The cheapest strategy for every op (exact within the time limit, else greedy)."""
    start = time.perf_counter()
    _check_budget(ops, memory_budget)
    f = _Formulation(ops, costs, memory_weight)
    for e in _edges(ops):
        f.add_edge(e)
    if memory_budget is not None:
        f.prog.row(f.memory, 0.0, memory_budget)
    result = f.prog.solve(time_limit_s)
    if result.x is not None:
        choice = {
            op.node: op.strategies[max(range(len(op.strategies)), key=lambda j: result.x[f.y[i, j]])]
            for i, op in enumerate(ops)
        }
        status = "optimal" if result.status == 0 else f"time limit ({result.message})"
        bound = getattr(result, "mip_dual_bound", None)
        solution = Solution(
            choice,
            "milp (scipy HiGHS)",
            float(result.fun),
            None if bound is None else float(bound),
            status,
            time.perf_counter() - start,
        )
    else:
        if memory_budget is not None and result.status == 2:
            raise PlanError(_over_budget(ops, memory_budget))
        choice = greedy(ops, costs, memory_weight)
        solution = Solution(
            choice,
            "greedy",
            total_cost(ops, costs, choice, memory_weight),
            None,
            f"fallback: {result.message}",
            time.perf_counter() - start,
        )
    refuse_uneven_moves([(e.producer, e.consumer, e.slot) for e in _edges(ops)], solution.choice, costs.sizes)
    kept = _rank0s_choice(ops, solution)
    if kept is not solution.choice:
        solution.choice = kept
        solution.status += "; rank 0's choice kept (this rank's solve found another)"
    solution.explain = explain_rows(ops, costs, solution.choice, memory_weight)
    return solution


def _rank0s_choice(ops: list[Op], solution: Solution) -> dict[fx.Node, Strategy]:
    """The choice rank 0's solver made (this rank's own where it is the same, or alone).

    Every rank must emit one program. The integer program is the same on every rank
    (tests/test_solver_determinism.py), but HiGHS does not always return the same one
    of several optima of equal cost: Llama on a (2, 2) mesh, 4 ranks on 2 cores, had
    two ranks place a redistribution before and after a ``contiguous`` (same cost), and
    the collective check stopped the first backward. So each rank posts its choice, one
    strategy index per op, and all keep rank 0's (`hca.plan` and the layout pass alike).
    """
    if not needs_exchange():
        return solution.choice
    mine = ",".join(str(op.strategies.index(solution.choice[op.node])) for op in ops)
    texts = exchange("layout choice", mine, range(dist.get_world_size()), "the layout solver's choice")
    theirs = mine if dist.get_rank() == 0 else texts[0]
    if theirs == mine:
        return solution.choice
    picks = theirs.split(",")
    if len(picks) != len(ops) or not all(int(j) < len(op.strategies) for op, j in zip(ops, picks)):
        # Rank 0 traced another program: the input check names the difference on the first call.
        return solution.choice
    return {op.node: op.strategies[int(j)] for op, j in zip(ops, picks)}


def _check_budget(ops: list[Op], budget: float | None) -> None:
    if budget is None:
        return
    least = sum(min(s.memory_bytes for s in op.strategies) for op in ops)
    if least > budget:
        raise PlanError(_over_budget(ops, budget, least))


def _over_budget(ops: list[Op], budget: float, least: float | None = None) -> str:
    biggest = sorted(ops, key=lambda op: -min(s.memory_bytes for s in op.strategies))[:3]
    names = ", ".join(f"{op.node.name} ({int(min(s.memory_bytes for s in op.strategies))} B at best)" for op in biggest)
    need = f"at least {int(least)} B" if least is not None else "more than that"
    return (
        f"layout solver: no layout fits memory_budget={int(budget)} B per rank "
        f"(needs {need}); the largest values are {names}: raise the budget or shard more"
    )


def total_cost(ops: list[Op], costs: Costs, choice: dict[fx.Node, Strategy], memory_weight: float) -> float:
    """The model's cost of a complete choice (what the integer program minimizes)."""
    total = sum(_own_cost(choice[op.node], memory_weight) for op in ops)
    owed: dict[tuple[fx.Node, int], None] = {}  # ordered: the sum is the same on every rank
    used: dict = {}
    for e in _edges(ops):
        out = choice[e.producer.node].output
        key = _key(choice[e.consumer.node], e.slot)
        fw, bw, dims = _edge_cost(costs, e, out, key, used)
        total += fw + bw + memory_weight * _moved_bytes(costs, e, out, key)
        owed.update(dict.fromkeys((e.producer.node, m) for m in dims))
    by_node = {op.node: op for op in ops}
    total += sum(_reduction(costs, by_node[n], choice[n].output, m, used) for n, m in owed)
    return total + sum(costs.bucket_latency(b) for b in sorted(used, key=_bucket_order))


def greedy(ops: list[Op], costs: Costs, memory_weight: float) -> dict[fx.Node, Strategy]:
    """Each op in graph order takes its cheapest strategy given what its producers chose."""
    choice: dict[fx.Node, Strategy] = {}
    by_node = {op.node: op for op in ops}
    for op in ops:

        def local(s: Strategy) -> float:
            cost = _own_cost(s, memory_weight)
            for i, src in enumerate(op.slots):
                if src in choice:
                    edge = _Edge(by_node[src], op, i)
                    fw, bw, owed = _edge_cost(costs, edge, choice[src].output, _key(s, i))
                    cost += (
                        fw
                        + bw
                        + memory_weight * _moved_bytes(costs, edge, choice[src].output, _key(s, i))
                        + sum(_reduction(costs, by_node[src], choice[src].output, m) for m in owed)
                    )
            return cost

        choice[op.node] = min(op.strategies, key=local)
    return choice


def as_written(ops: list[Op], memory_weight: float) -> dict[fx.Node, Strategy]:
    """The program as the user wrote it: each op in graph order reads its inputs as their producers
    wrote them wherever a strategy allows (what DTensor does on its own: no move where its rules
    run the op), the cheapest of those; an op no strategy runs so takes its cheapest."""
    choice: dict[fx.Node, Strategy] = {}
    for op in ops:
        kept = [
            s
            for s in op.strategies
            if all(src not in choice or s.inputs[i] == choice[src].output for i, src in enumerate(op.slots))
        ]
        choice[op.node] = min(kept or op.strategies, key=lambda s: _own_cost(s, memory_weight))
    return choice


# ----------------------------------------------------------------------------- explanations


def explain_rows(ops: list[Op], costs: Costs, choice: dict[fx.Node, Strategy], memory_weight: float) -> list[ValueRow]:
    """Per value: shape, layout, cost terms, and why (a constraint, or the alternative it beat)."""
    edges = _edges(ops)
    incoming: dict[fx.Node, list[_Edge]] = {}
    touching: dict[fx.Node, list[_Edge]] = {}
    for e in edges:
        incoming.setdefault(e.consumer.node, []).append(e)
        touching.setdefault(e.consumer.node, []).append(e)
        touching.setdefault(e.producer.node, []).append(e)

    def local(op: Op, s: Strategy) -> float:
        """The cost terms `op` touches, with `op` on `s` and every other op as chosen."""
        pick = lambda other: s if other is op else choice[other.node]
        total = _own_cost(s, memory_weight)
        for e in touching.get(op.node, []):
            out, key = pick(e.producer).output, _key(pick(e.consumer), e.slot)
            fw, bw, owed = _edge_cost(costs, e, out, key)
            total += fw + bw + memory_weight * _moved_bytes(costs, e, out, key)
            total += sum(_reduction(costs, e.producer, out, m) for m in owed)
        return total

    rows = []
    for op in ops:
        s = choice[op.node]
        fw = bw = 0.0
        for e in incoming.get(op.node, []):
            f, b, _ = _edge_cost(costs, e, choice[e.producer.node].output, _key(s, e.slot))
            fw, bw = fw + f, bw + b
        if op.fixed:
            why = op.fixed
        elif len(op.strategies) == 1:
            why = "the only layout DTensor runs it in without redistributing"
        else:
            mine = local(op, s)
            others = [(local(op, t) - mine, t) for t in op.strategies if t is not s]
            delta, best = min(others, key=lambda x: x[0])
            why = (
                f"beat {layout_str(best.output)} reading {', '.join(map(layout_str, best.inputs))} "
                f"by {delta * 1e6:.1f} us ({len(op.strategies)} candidates)"
            )
        rows.append(
            ValueRow(
                value=op.node.name,
                shape=tuple(op.value.shape),
                placement=layout_str(s.output),
                reads=tuple(layout_str(l) for l in s.inputs),
                compute_us=s.compute_s * 1e6,
                forward_comm_us=fw * 1e6,
                backward_comm_us=bw * 1e6,
                memory_bytes=s.memory_bytes,
                why=why,
            )
        )
    return rows
