"""Symbolic sizes in a strategy file: the rows a module cut by shares traces as a symbol.

Under uneven shares (docs/heterogeneous.md) every rank traces one program over a symbolic
batch, so the file writes such a size as the traced expression's text (``"2*s33"``, bytes
``"64*s33"``). The rules are written for numbers: `instantiate` gives them a copy of the
file with every symbol bound to a value, and `sample_bindings` the values the verifier tries.
Two bindings, not one, so that a size wrong by a constant, or right at one row count by
coincidence, still differs somewhere. The expressions are read by this module's own small
evaluator (integers, + - * // / % and parentheses): nothing of the file is executed.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

_SYMBOL = re.compile(r"\b[a-z]\d+\b")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
}
_SIZE_KEYS = ("shape", "bytes", "wire_bytes")
# Rows the symbols take: multiples of every mesh size the zoo uses, so that a dimension the
# program splits over the ranks stays whole at both.
SAMPLES = (12, 60)


def symbols(data: Any) -> set[str]:
    """The symbol names in the file's size fields (empty: every size is a number)."""
    found: set[str] = set()
    for text in _size_texts(data):
        found |= set(_SYMBOL.findall(text))
    return found


def sample_bindings(names: set[str]) -> list[dict[str, int]]:
    """The bindings the rules are run at: each symbol at each of `SAMPLES` (all at once)."""
    return [dict.fromkeys(sorted(names), n) for n in SAMPLES]


def evaluate(text: str, binding: dict[str, int]) -> int | float:
    """The value of a size expression at `binding`; ValueError for anything but arithmetic on sizes."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"size {text!r} is not an expression of sizes") from e
    return _value(tree.body, binding, text)


def instantiate(data: Any, binding: dict[str, int]) -> Any:
    """A copy of `data` with every size expression (in a ``shape``, ``bytes`` or ``wire_bytes``) evaluated."""
    if isinstance(data, dict):
        return {k: _sized(v, binding) if k in _SIZE_KEYS else instantiate(v, binding) for k, v in data.items()}
    if isinstance(data, list):
        return [instantiate(v, binding) for v in data]
    return data


def _sized(value: Any, binding: dict[str, int]) -> Any:
    if isinstance(value, str):
        return _number(evaluate(value, binding))
    if isinstance(value, list):
        return [_number(evaluate(v, binding)) if isinstance(v, str) else v for v in value]
    return value


def _number(x: int | float) -> int | float:
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _size_texts(data: Any):
    if isinstance(data, dict):
        for k, v in data.items():
            if k in _SIZE_KEYS:
                yield from (x for x in (v if isinstance(v, list) else [v]) if isinstance(x, str))
            else:
                yield from _size_texts(v)
    elif isinstance(data, list):
        for v in data:
            yield from _size_texts(v)


def _value(node: ast.AST, binding: dict[str, int], text: str) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in binding:
        return binding[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, binding, text)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, binding, text), _value(node.right, binding, text))
    raise ValueError(f"size {text!r}: {ast.dump(node)[:40]} is not arithmetic on sizes")


def binding_for(graphs: list, inputs: list[list[tuple[list[int], str]]]) -> dict[str, int] | None:
    """The symbols' values at which every symbolic input of the file's `graphs` is one of the
    re-traced model's `inputs` (per graph, (shape, dtype)); None where no value does."""
    names = symbols(graphs)
    largest = max((d for graph in inputs for shape, _ in graph for d in shape), default=0)
    binding: dict[str, int] = {}
    for name in sorted(names):
        found = next((n for n in range(1, largest + 1) if _inputs_match(graphs, inputs, {**binding, name: n})), None)
        if found is None:
            return None
        binding[name] = found
    return binding


def _inputs_match(graphs: list, inputs: list, binding: dict[str, int]) -> bool:
    """Whether each input of the file whose symbols `binding` all gives is one of the model's inputs."""
    for g, theirs in zip(graphs, inputs):
        for v in g["values"].values():
            if not (v.get("kind") == "input" or str(v.get("op", "")).endswith("from_local")):
                continue
            shape = v.get("shape") or []
            texts = [d for d in shape if isinstance(d, str)]
            if not texts or any(set(_SYMBOL.findall(t)) - binding.keys() for t in texts):
                continue  # static, or waits for a symbol not bound yet
            try:
                mine = [evaluate(d, binding) if isinstance(d, str) else d for d in shape]
            except (ValueError, ZeroDivisionError):
                return False
            if (mine, v.get("dtype")) not in [(list(s), d) for s, d in theirs]:
                return False
    return True
