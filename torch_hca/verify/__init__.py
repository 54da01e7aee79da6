"""`hca.verify`: check a strategy file on its own, with code that shares nothing with the compiler.

This room imports only torch, `torch_hca.spmd` (the move table, transposes, wire bytes) and
`torch_hca.errors` (tests/test_layering.py). What it checks, and what it does not, is in
docs/strategy.md ("What the verifier proves").

    result = hca.verify("strategy.json")       # StrategyError listing every problem, else:
    print(result)                              # "verified: 3 rules x 1 graph, 0 problems, 0.01 s"
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from torch_hca.errors import StrategyError

from .collective_rules import collectives, groups, issued, owed
from .rules import Graph, Problem, mesh_and_model, moves, parameters, partial_reduced, placements, structure

__all__ = ["Problem", "Verification", "problems", "verify"]

GRAPH_RULES = (placements, parameters, partial_reduced, moves, collectives, owed, issued, groups)


@dataclass
class Verification:
    """What `verify` found: the problems (empty when the file passes) and what it looked at."""

    source: str
    problems: list[Problem] = field(default_factory=list)
    graphs: int = 0
    moves: int = 0
    collectives: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = (
            f"{self.source}: {'verified' if self.ok else 'REJECTED'}: {self.graphs} graph(s), {self.moves} moves, "
            f"{self.collectives} collectives, {len(self.problems)} problem(s), {self.seconds:.3f} s"
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
    for i, g in enumerate(data["graphs"]):
        graph = Graph(i, g, data)
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
    return found


def verify(strategy: str | os.PathLike | dict, *, raise_on_failure: bool = True) -> Verification:
    """Check a strategy file (a path, or its content as a dict) by the spmd algebra alone.

    Returns a `Verification`; with ``raise_on_failure`` (default), a file with a problem is a
    `StrategyError` whose message lists each one: the value, the rule, what the file says and
    what it should say.
    """
    start = time.perf_counter()
    data, name = _read(strategy)
    result = Verification(name, problems(data))
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
