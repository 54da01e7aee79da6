"""`hca.verify`: check a strategy file on its own, with code that shares nothing with the compiler.

This room imports only torch, `torch_hca.spmd` (the move table, transposes, wire bytes) and
`torch_hca.errors` (tests/test_layering.py). What it checks, and what it does not, is in
docs/strategy.md ("What the verifier proves").

    result = hca.verify("strategy.json")       # StrategyError listing every problem, else:
    print(result)                              # "verified: 3 rules x 1 graph, 0 problems, 0.01 s"
    hca.verify(model, "strategy.json", (x,))   # also against the model, re-traced on x (retrace.py),
                                               # and every rank run in float64 against it (numeric.py)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from torch_hca.errors import StrategyError

from .collective_rules import collectives, groups, in_flight, issued, owed
from .numeric import Numeric
from .numeric import check as numeric_check
from .op_rules import OpTally, op_placement, tally
from .residual_rules import residuals
from .retrace import Traced, against_model, parameters_of, trace
from .rules import Graph, Problem, mesh_and_model, moves, parameters, partial_reduced, placements, structure
from .share_rules import shares
from .sizes import binding_for, instantiate, sample_bindings, symbols

__all__ = ["Problem", "Verification", "problems", "verify"]

GRAPH_RULES = (
    placements,
    parameters,
    partial_reduced,
    op_placement,
    moves,
    collectives,
    owed,
    issued,
    in_flight,
    groups,
    residuals,
    shares,
)


@dataclass
class Verification:
    """What `verify` found: the problems (empty when the file passes) and what it looked at."""

    source: str
    problems: list[Problem] = field(default_factory=list)
    graphs: int = 0
    moves: int = 0
    collectives: int = 0
    seconds: float = 0.0
    model: str | None = None  # what the file was compared against: the model, re-traced or not
    numeric: Numeric | None = None  # the numerical refinement check, when it ran
    op_rules: OpTally | None = None  # how many op values the per-op-family rules decided

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = (
            f"{self.source}: {'verified' if self.ok else 'REJECTED'}: {self.graphs} graph(s), {self.moves} moves, "
            f"{self.collectives} collectives, {len(self.problems)} problem(s), {self.seconds:.3f} s"
            + (f"; {self.op_rules}" if self.op_rules else "")
            + (f"; against {self.model}" if self.model else "")
            + (f"; {self.numeric}" if self.numeric else "")
        )
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def _read(source: str | os.PathLike | dict) -> tuple[Any, str]:
    if isinstance(source, dict):
        return source, "strategy"
    name = os.fspath(source)
    try:
        with open(name) as f:
            return json.load(f), name
    except OSError as e:
        raise StrategyError(f"hca.verify: cannot read {name!r} ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise StrategyError(
            f"hca.verify: {name!r} is not valid JSON ({e.msg} at line {e.lineno}): truncated or "
            "hand-edited? Save it again with hca.report(compiled).save_strategy(path)"
        ) from e


def problems(data: Any) -> list[Problem]:
    """Every problem the rules find in a strategy (already read as JSON)."""
    found = structure(data)
    if found:
        return found
    found = mesh_and_model(data)
    try:
        copies = sized_copies(data)
    except (ValueError, ZeroDivisionError) as e:
        return [*found, Problem("file", "sizes", str(e), "an integer, or an expression of sizes")]
    for sized in copies:
        for i, g in enumerate(sized["graphs"]):
            graph = Graph(i, g, sized)
            for rule in GRAPH_RULES:
                try:
                    found += list(rule(graph))
                except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                    found.append(
                        Problem(
                            graph.where,
                            rule.__name__,
                            f"a malformed entry ({type(e).__name__}: {e})",
                            "the fields docs/strategy.md lists",
                        )
                    )
    once = {}  # a problem found at both sample sizes is named once, at the first
    for p in found:
        once.setdefault((p.where, p.rule), p)
    return list(once.values())


def sized_copies(data: dict) -> list[dict]:
    """The file as the rules read it: itself, or, where sizes are symbolic (a module cut by shares
    traces its rows as a symbol), a copy at each sample size of the symbols (`torch_hca.verify.sizes`)."""
    names = symbols(data["graphs"])
    return [instantiate(data, b) for b in sample_bindings(names)] if names else [data]


def _first_sized(data: dict) -> dict:
    try:
        return sized_copies(data)[0]
    except (ValueError, ZeroDivisionError):
        return data  # `problems` names it


def verify(
    model_or_strategy: nn.Module | str | os.PathLike | dict,
    strategy: str | os.PathLike | dict | None = None,
    example_inputs: Any = None,
    *,
    numeric: bool | None = None,
    raise_on_failure: bool = True,
) -> Verification:
    """Check a strategy file (a path, or its content as a dict) by the spmd algebra alone:
    ``verify(strategy)``; and against a model: ``verify(model, strategy, example_inputs)``.

    With a model, its parameters (names, shapes, dtypes, a sharded module's storage) must be the
    file's; with example inputs (the whole tensors one device would see), the model's forward is
    re-traced with torch alone and every value the file lists must have the trace's logical shape
    and dtype (`torch_hca.verify.retrace`); and, with ``numeric`` (default: on when example inputs
    are given and every other rule passed), every rank of the file's program is run in this process
    in float64 and each value and parameter gradient compared with the logical program's
    (`torch_hca.verify.numeric`), the first that differs named. Returns a `Verification`; with ``raise_on_failure``
    (default), a file with a problem is a `StrategyError` whose message lists each one: the value,
    the rule, what the file says and what it should say.
    """
    start = time.perf_counter()
    model = _model_form(model_or_strategy, strategy, example_inputs)
    data, name = _read(strategy if model is not None else model_or_strategy)
    result = Verification(name, problems(data))
    if not structure(data):
        result.op_rules = tally(_first_sized(data))
    traced = None  # the model re-traced: the numerical check runs its graphs again
    if model is not None and not structure(data):
        found, traced = _against(model, data, example_inputs, result)
        result.problems += found
    if numeric is None:
        numeric = example_inputs is not None
    if numeric and example_inputs is None:
        raise StrategyError("hca.verify(..., numeric=True): the numerical check needs example inputs")
    if numeric and model is not None and result.ok and _cut_by_shares(data):
        # The check cuts each example input as the placements say, evenly; under shares each rank's
        # piece is its share, which it does not simulate yet (docs/strategy.md, "Not yet").
        result.numeric = Numeric(skipped=["every graph: its inputs are cut by shares, and this check cuts them evenly"])
    elif numeric and model is not None and result.ok:
        found, result.numeric = numeric_check(model, data, example_inputs, traced=traced)
        result.problems += found
    if isinstance(data, dict) and isinstance(data.get("graphs"), list):
        result.graphs = len(data["graphs"])
        result.moves = sum(len(g.get("moves", [])) for g in data["graphs"] if isinstance(g, dict))
        result.collectives = sum(len(g.get("collectives", [])) for g in data["graphs"] if isinstance(g, dict))
    result.seconds = time.perf_counter() - start
    if raise_on_failure and not result.ok:
        raise StrategyError(
            f"hca.verify: {len(result.problems)} problem(s) in {name}:\n" + "\n".join(f"  {p}" for p in result.problems)
        )
    return result


def _cut_by_shares(data: Any) -> bool:
    return isinstance(data, dict) and any(isinstance(g, dict) and g.get("shares") for g in data.get("graphs") or [])


def _bound(data: dict, traced: Traced) -> dict:
    """The file with its symbolic sizes (a module cut by shares) at the values the example inputs give
    them: the sizes the re-traced model has; the first sample size where none fits (the inputs rule names it)."""
    names = symbols(data["graphs"])
    if not names:
        return data
    binding = binding_for(data["graphs"], traced.inputs) or sample_bindings(names)[0]
    try:
        return instantiate(data, binding)
    except (ValueError, ZeroDivisionError):
        return data  # `problems` names the size it cannot read


def _model_form(first: Any, strategy: Any, example_inputs: Any) -> nn.Module | None:
    """The model of ``verify(model, strategy, example_inputs)``, or None for ``verify(strategy)``."""
    if isinstance(first, nn.Module):
        if strategy is None:
            raise StrategyError(
                f"hca.verify({type(first).__name__}, ...): no strategy file given; write "
                "hca.verify(model, 'strategy.json', example_inputs)"
            )
        return first
    if strategy is not None or example_inputs is not None:
        raise StrategyError(
            f"hca.verify: the first argument is {type(first).__name__}, not a model, and a strategy "
            "follows it; write hca.verify(strategy) or hca.verify(model, strategy, example_inputs)"
        )
    return None


def _against(model: nn.Module, data: dict, example_inputs: Any, result: Verification) -> tuple[list, Traced | None]:
    """The file against the model: re-traced on the example inputs (the trace returned), or its parameters alone."""
    name = type(getattr(model, "_orig_mod", model)).__name__
    if example_inputs is None:
        result.model = f"{name} (parameters only: no example inputs to re-trace)"
        return against_model(data, Traced(parameters=parameters_of(model)), graphs=False), None
    traced = trace(model, example_inputs, data)
    found = against_model(_bound(data, traced), traced)
    n = traced.compared
    result.model = (
        f"{name} (re-traced: {len(traced.ops)} graph(s), {sum(map(len, traced.ops))} ops; the file's op values "
        f"paired {n['by name']} by name, {n['by shape']} by shape, {n['unpaired']} unpaired)"
    )
    return found, traced
