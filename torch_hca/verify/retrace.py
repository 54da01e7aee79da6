"""The strategy file against the model: the logical program re-traced with torch alone, and compared.

`trace` runs the model's own forward (a sharded module's, unwrapped: the single-device program)
under Dynamo with a backend that only keeps the graphs, on meta tensors of the parameters'
logical (global) shapes and of the example inputs: no value is computed, no collective runs, and
nothing of the compiler that wrote the file is imported. The graphs are kept (`Traced.captured`): the
numerical check runs them again on float64 tensors (`rebind`) instead of tracing a second time.
`against_model` names every difference
between the file and that trace: the parameters (names, shapes, dtypes, a sharded module's storage),
the inputs, and each value the file lists (logical shape and dtype, paired with the trace's ops in
program order). What it cannot recompute, and why, is in docs/strategy.md ("Against the model").
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from torch_hca.errors import StrategyError
from torch_hca.spmd.placements import dtype_str, layout_str, layout_texts

from . import vocabulary
from .rules import Problem

# Ops the compiler inserts into the program it lays out (inputs made DTensors, gradient reductions
# marked, moves, outputs): they have no counterpart in the user's program, so they are not paired.
_INSERTED = "torch_hca.compiler.dtensor_ops."
_LISTED = 10  # value differences named per graph; the rest are counted


@dataclass
class Traced:
    """What the re-trace found: per graph, the tensor ops in program order as (name, shape, dtype),
    the inputs' (shape, dtype), and the parameters each graph reads; and every parameter of the model."""

    ops: list[list[tuple[str, list[int], str]]] = field(default_factory=list)
    inputs: list[list[tuple[list[int], str]]] = field(default_factory=list)
    read: list[set[str]] = field(default_factory=list)
    parameters: dict[str, dict] = field(default_factory=dict)
    aliases: dict[str, set[str]] = field(default_factory=dict)  # a tied parameter's names
    # What `against_model` compared: file values paired with a trace op by name, by shape (renamed), none.
    compared: dict[str, int] = field(default_factory=lambda: {"by name": 0, "by shape": 0, "unpaired": 0})
    captured: Captured | None = field(default=None, repr=False, compare=False)  # the graphs it read


@dataclass
class Captured:
    """`capture`'s graphs, each as (GraphModule, {placeholder: parameter name}, the tensors Dynamo bound
    to its placeholders); {id(tensor): parameter names}; the tensors it made for the parameters and
    buffers ({"model.<name>": tensor}) and the inputs; and the file `vocabulary.expand` rewrote the
    graphs for (None: not expanded)."""

    graphs: list
    names: dict[int, set[str]]
    tensors: dict[str, torch.Tensor]
    inputs: tuple
    expanded_for: dict | None = None


def _user_forward(model: nn.Module):
    """The model's own forward: a sharded module's forward is hca's wrapper around it (functools.wraps)."""
    forward = type(model).forward
    return forward.__wrapped__ if getattr(forward, "_hca_wrapped", False) else forward


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A tensor of `t`'s logical shape and dtype on the meta device (a DTensor's global shape)."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def parameters_of(model: nn.Module) -> dict[str, dict]:
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        placements = getattr(p, "placements", None)  # a DTensor's storage (hca.sharded), else None
        out[name] = {
            "shape": list(p.shape),
            "dtype": dtype_str(p.dtype),
            "placements": layout_texts(layout_str(placements)) if placements is not None else None,
        }
    return out


def trace(model: nn.Module, example_inputs: Any, data: dict | None = None) -> Traced:
    """The model's logical program on `example_inputs` (the whole tensors one device would see);
    with the file `data`, the vocabulary-parallel loss expanded where the file lists it (`vocabulary`)."""
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: the module itself
    captured = capture(model, example_inputs, _meta, _meta, _meta)
    if data is not None:
        vocabulary.expand(captured.graphs, data)
        captured.expanded_for = data
    traced = _summary(model, captured.graphs, captured.names)
    traced.captured = captured
    return traced


def _made(model: nn.Module, example_inputs: Any, parameter, buffer, tensor_input) -> tuple[tuple, dict, dict]:
    """The inputs, {"model.<name>": tensor} for every parameter (one tensor per tied group) and buffer,
    made by the three functions given in this order (a generator they draw from draws alike), and
    {id(tensor): parameter names}."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    inputs = tuple(tensor_input(x) if isinstance(x, torch.Tensor) else x for x in example_inputs)
    made: dict[int, torch.Tensor] = {}  # one tensor per parameter: tied ones stay tied
    tensors = {
        f"model.{n}": made.setdefault(id(p), parameter(p)) for n, p in model.named_parameters(remove_duplicate=False)
    }
    names: dict[int, set[str]] = {}
    for n, t in tensors.items():
        names.setdefault(id(t), set()).add(n.removeprefix("model."))
    tensors.update({f"model.{n}": buffer(b) for n, b in model.named_buffers()})
    return inputs, tensors, names


def capture(model: nn.Module, example_inputs: Any, parameter, buffer, tensor_input) -> Captured:
    """Dynamo's graphs of the model's own forward, run on tensors made from the model's parameters,
    buffers and the example inputs by the three functions given (meta tensors: `trace`)."""
    model = getattr(model, "_orig_mod", model)
    inputs, tensors, names = _made(model, example_inputs, parameter, buffer, tensor_input)
    forward, graphs = _user_forward(model), []

    class Logical(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return forward(self.model, *args)

    def keep(gm: fx.GraphModule, bound: list) -> Any:
        # Which parameter each placeholder is, read now: Dynamo erases the examples after compiling.
        read = {}
        for node in gm.graph.find_nodes(op="placeholder"):
            grapharg = node.meta.get("grapharg")
            aliases = names.get(id(getattr(grapharg, "example", None))) if grapharg is not None else None
            if aliases:
                read[node.name] = min(aliases)
        graphs.append((gm, read, list(bound)))
        return gm.forward

    logical = Logical()

    def run(*args):
        return logical(*args)

    # A fresh code object: Dynamo's cache of this function starts empty on every call (no
    # recompilation limit reached by many verifications, no cache of the user's touched).
    fresh = types.FunctionType(run.__code__.replace(), run.__globals__, "verify_retrace", None, run.__closure__)
    try:
        with _swapped(logical, tensors):
            torch.compile(fresh, backend=keep, dynamic=False)(*inputs)
    except Exception as e:
        raise StrategyError(
            f"hca.verify: re-tracing {type(model).__name__} on the example inputs failed "
            f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else '?'}); give the whole "
            "inputs one device would see (not one rank's piece), as a tuple"
        ) from e
    return Captured(graphs, names, tensors, inputs)


@contextlib.contextmanager
def _swapped(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """`module`'s parameters and buffers replaced by `tensors` (by name) while tracing, then put back, as
    `torch.func.functional_call` does; swapped outside Dynamo: traced, the swap cost it about a second
    per Hugging Face model."""
    saved = []
    try:
        for name, t in tensors.items():
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            store = owner._parameters if leaf in owner._parameters else owner._buffers
            saved.append((store, leaf, store[leaf]))
            store[leaf] = t
        yield
    finally:
        for store, leaf, t in reversed(saved):
            store[leaf] = t


def rebind(captured: Captured, model: nn.Module, example_inputs: Any, parameter, buffer, tensor_input):
    """`captured`'s graphs bound to new tensors made by the three functions, as `capture` would have
    bound them had it traced on those (graphs and {id(tensor): parameter names}); None where a graph
    reads a meta tensor other than a parameter, buffer or input (one made between two graphs at a
    graph break: only a trace on the new tensors computes it)."""
    model = getattr(model, "_orig_mod", model)
    old = {id(t): key for key, t in captured.tensors.items()}
    old.update({id(x): i for i, x in enumerate(captured.inputs) if isinstance(x, torch.Tensor)})
    for _gm, _read, bound in captured.graphs:
        if any(isinstance(t, torch.Tensor) and t.is_meta and id(t) not in old for t in bound):
            return None
    inputs, tensors, names = _made(model, example_inputs, parameter, buffer, tensor_input)
    new = {i: (tensors[k] if isinstance(k, str) else inputs[k]) for i, k in old.items()}
    graphs = [(gm, read, [new.get(id(t), t) for t in bound]) for gm, read, bound in captured.graphs]
    return graphs, names


def _summary(model: nn.Module, graphs: list, names: dict) -> Traced:
    result = Traced(parameters=parameters_of(model), aliases={n: a for a in names.values() for n in a})
    for gm, parameter_of, _bound in graphs:
        ops, ins = [], []
        for node in gm.graph.nodes:
            v = node.meta.get("example_value")
            if not isinstance(v, torch.Tensor) or node.name in parameter_of:
                continue
            if node.op == "placeholder":
                ins.append((list(v.shape), dtype_str(v.dtype)))
            elif node.op in ("call_function", "call_method", "call_module"):
                ops.append((node.name, list(v.shape), dtype_str(v.dtype)))
        result.ops.append(ops)
        result.inputs.append(ins)
        result.read.append(set(parameter_of.values()))
    return result


# ----------------------------------------------------------------------------- the comparison

_TRACE = "(the re-traced model)"


def _parameter_problems(data: dict, traced: Traced) -> Iterator[Problem]:
    """The file's model section against the model's parameters, each difference named."""
    mine = traced.parameters
    for name, said in sorted(data["model"]["parameters"].items()):
        here = mine.get(name)
        where = f"model: parameter {name!r}"
        if here is None:
            yield Problem(
                where, "model parameters", f"{said.get('shape')} {said.get('dtype')}", f"no such parameter {_TRACE}"
            )
            continue
        for key in ("shape", "dtype", "placements"):
            if key == "placements" and here[key] is None:
                continue  # a plain module: its storage is the plan's, which it does not carry
            if said.get(key) != here[key]:
                yield Problem(where, f"model parameter {key}", said.get(key), f"{here[key]} {_TRACE}")
    file_names = set(data["model"]["parameters"])
    for name in sorted(set().union(*traced.read) - file_names if traced.read else set()):
        if not traced.aliases.get(name, {name}) & file_names:
            here = mine[name]
            yield Problem(
                f"model: parameter {name!r}", "model parameters", "nothing", f"{here['shape']} {here['dtype']} {_TRACE}"
            )


def _value_problems(i: int, graph: dict, traced: Traced) -> list[Problem]:
    """Graph i's values against the trace's graph i: the parameters it reads, its inputs, its ops."""
    where, found = f"graph {i}", []
    values = graph["values"]
    mine = traced.parameters
    inputs = traced.inputs[i]
    for name, v in values.items():
        if v["kind"] == "parameter":
            here = mine.get(v.get("parameter"))
            if here is not None and (v["shape"], v["dtype"]) != (here["shape"], here["dtype"]):
                found.append(
                    Problem(
                        f"{where}: value {name!r} (parameter {v.get('parameter')!r})",
                        "model value shape",
                        f"{v['shape']} {v['dtype']}",
                        f"{here['shape']} {here['dtype']} {_TRACE}",
                    )
                )
        elif v["kind"] == "input" or v["op"] == _INSERTED + "from_local":
            if (v["shape"], v["dtype"]) not in [(s, d) for s, d in inputs]:
                found.append(
                    Problem(
                        f"{where}: input {name!r}",
                        "model inputs",
                        f"{v['shape']} {v['dtype']}",
                        f"one of {[f'{s} {d}' for s, d in inputs]} {_TRACE}; the example inputs are the "
                        "whole tensors one device would see, not one rank's piece",
                    )
                )
    return found + _op_problems(where, values, traced.ops[i], traced.compared)


def _op_problems(where: str, values: dict, ops: list[tuple[str, list[int], str]], compared: dict) -> list[Problem]:
    """The file's ops against the trace's (the compiler's own ops left out). An op is paired with the
    trace's op of its name (Dynamo names a node after the user's variable, in both traces); one the
    trace has no name for (the compiler renamed it) with an unpaired trace op of its shape and dtype.
    The file's values are a dict a JSON file may hold sorted: no pairing relies on their order."""
    theirs = {n: (v["shape"], v["dtype"]) for n, v in values.items() if v["kind"] == "op" and not _inserted(v)}
    by_name = {name: (shape, dtype) for name, shape, dtype in ops}
    found, unpaired = [], []
    for name, (shape, dtype) in sorted(theirs.items()):
        here = by_name.pop(name, None)
        if here is None:
            unpaired.append((name, shape, dtype))
            continue
        compared["by name"] += 1
        if here != (shape, dtype):
            should = f"{here[0]} {here[1]} (op {name!r} of the re-traced model)"
            found.append(Problem(f"{where}: value {name!r}", "model value shape", f"{shape} {dtype}", should))
    left = [sig for sig in by_name.values()]  # the trace's ops no name paired
    for name, shape, dtype in unpaired:
        if (shape, dtype) in left:
            left.remove((shape, dtype))
            compared["by shape"] += 1
            continue
        compared["unpaired"] += 1
        should = f"no op of that shape and dtype {_TRACE} (unpaired there: {sorted({f'{s} {d}' for s, d in left})[:8]})"
        found.append(Problem(f"{where}: value {name!r}", "model value shape", f"{shape} {dtype}", should))
    if len(found) > _LISTED:
        more = len(found) - _LISTED
        found = found[:_LISTED] + [Problem(where, "model value shape", f"{more} more values", "(not listed)")]
    return found


def _inserted(v: dict) -> bool:
    return v["op"].startswith(_INSERTED)


def against_model(data: dict, traced: Traced, graphs: bool = True) -> list[Problem]:
    """Every difference between a (structurally sound) strategy file and the re-traced model
    (``graphs`` False: its parameters only)."""
    found = list(_parameter_problems(data, traced))
    if not graphs:
        return found
    entries = data["graphs"]
    if len(entries) != len(traced.ops):
        found.append(
            Problem(
                "model",
                "model graphs",
                f"{len(entries)} graph(s)",
                f"{len(traced.ops)} graph(s) {_TRACE}: another model or another torch's graph breaks",
            )
        )
    for i, graph in enumerate(entries[: len(traced.ops)]):
        found += _value_problems(i, graph, traced)
    return found
