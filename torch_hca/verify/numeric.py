"""The numerical refinement check: every rank of the file's program run in this process, in float64,
against the logical program, value by value and gradient by gradient.

The graphs of the model's forward that `retrace.trace` captured on meta tensors are bound to real
float64 tensors (`retrace.rebind`: seeded random parameters, the model's buffers, the example
inputs; a graph that reads a value made between graphs is traced again on them) and run op by op twice:

* on the whole tensors: the logical program;
* on each rank's pieces (`torch_hca.verify.pieces`): a parameter or input is cut as the file
  places it; each op runs on every rank's local pieces of the values the file says it reads, after
  the file's moves (each step as its collective acts on the pieces of its group); a value the file
  says is reduced in the backward (a gradient mark, or an op whose backward owes a reduction) sums
  its cotangent over the group there; a move's backward is the one the file states for each step.

After each op, the ranks' pieces put back together by the file's placement of that value (shards
concatenated, partials summed, replicas compared) must be the logical value; the first value that
is not is a problem, "numerical refinement". Then one backward with a seeded random cotangent per
output, given to each rank as the output's placement says (a shard of it, or the whole): every
parameter's gradient, put back together by its storage placement (partial over the mesh dims a
deferred-role parameter is replicated on: `hca.reduce_gradients` sums them later), must be the
logical gradient. What this proves and does not is in docs/strategy.md.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import cotangents, gradients, vocabulary
from . import pieces as P
from .retrace import Traced, capture, rebind, trace
from .float64 import METHODS, RTOL, differs, flat, float64, in_place, natural, scale, wide
from .rules import Problem

_INSERTED = "torch_hca.compiler.dtensor_ops."
_RESHAPES = {"view", "reshape", "flatten", "unflatten", torch.reshape, torch.flatten, torch.unflatten}
_EXPANDS = {"expand", "broadcast_to", torch.broadcast_to}
_CREATE_LIKE = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}
_DROPOUTS = {F.dropout, torch.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout}
_EMBEDDINGS = {F.embedding, torch.embedding}


@dataclass
class Numeric:
    """What the numerical check compared, per graph summed: values and gradients, and what it could not."""

    values: int = 0
    gradients: int = 0
    unpaired: int = 0  # ops of the trace with no value in the file: run, not compared
    skipped: list[str] = field(default_factory=list)  # why something was not compared
    seconds: float = 0.0

    def __str__(self) -> str:
        text = f"numerical refinement: {self.values} values and {self.gradients} gradients compared in float64"
        if self.unpaired:
            text += f", {self.unpaired} ops with no value in the file run but not compared"
        if self.skipped:
            text += f"; not compared: {'; '.join(self.skipped[:3])}" + (" ..." if len(self.skipped) > 3 else "")
        return text + f" ({self.seconds:.2f} s)"


def check(
    model: nn.Module, data: dict, example_inputs: Any, seed: int = 0, traced: Traced | None = None
) -> tuple[list[Problem], Numeric]:
    """Run every graph of the file on all its ranks in float64 against the re-traced model: the graphs
    of `traced` (`retrace.trace(model, example_inputs, data)`), else of a trace made now."""
    import time

    start = time.perf_counter()
    captured = traced.captured if traced is not None else None
    if captured is None or captured.expanded_for is not data:
        captured = trace(model, example_inputs, data).captured  # the vocabulary-parallel loss expanded
    gen = torch.Generator().manual_seed(seed)
    bound = rebind(captured, model, example_inputs, *float64(gen))
    if bound is None:  # a graph reads a value computed between graphs: traced again, on float64 tensors
        gen = torch.Generator().manual_seed(seed)
        again = capture(model, example_inputs, *float64(gen))
        vocabulary.expand(again.graphs, data)
        bound = again.graphs, again.names
    graphs, names = bound
    summary = Numeric()
    found: list[Problem] = []
    if len(graphs) != len(data["graphs"]):
        summary.skipped.append(f"{len(data['graphs'])} graph(s) in the file, {len(graphs)} re-traced")
    else:
        mesh = P.Mesh(data["mesh"]["shape"], data["mesh"]["ranks"])
        for i, (gm, read, bound) in enumerate(graphs):
            run = _Run(i, gm, read, bound, names, data["graphs"][i], mesh, summary, gen)
            found += run.forward()
            if not found:
                found += run.backward()
    summary.seconds = time.perf_counter() - start
    return found, summary


def _own_backward(step: dict) -> str | None:
    """The kind of a move step's own backward collective: the one the file links, or an
    all_to_all's transpose, an all_to_all (gloo's fallback gathers both ways; the file links none)."""
    return step.get("backward") or ("all_to_all" if step.get("kind") == "all_to_all" else None)


class _Run:
    """One graph: the logical program and every rank's, side by side."""

    def __init__(self, index, gm: fx.GraphModule, read, bound, names, graph: dict, mesh: P.Mesh, summary, gen):
        self.where, self.gm, self.read, self.mesh, self.summary, self.gen = (
            f"graph {index}",
            gm,
            read,
            mesh,
            summary,
            gen,
        )
        self.values: dict[str, dict] = graph["values"]
        self.moves = {m["node"]: m for m in graph["moves"]}
        self.outputs = graph["outputs"]
        self.reduced: dict[str, list[tuple[int, str]]] = {}  # value -> its backward collectives (mesh dim, kind)
        # A move step's own backward collective is its transpose, which the step's simulation runs.
        stepped = {(n, s["mesh_dim"]) for n, m in self.moves.items() for s in m["steps"] if _own_backward(s)}
        # A replicated value cut locally (R -> S) whose cotangent the program gathers whole in the
        # backward (DTensor's backward of that move) although the file's step states none: on each
        # rank the cut's own backward pads its piece with zeros, so the gather is their sum.
        self.gathered: set[tuple[str, int]] = set()
        for c in graph["collectives"]:  # not a move step's own backward: a reduction of the cotangent
            if c.get("recomputes") is not None:  # a forward collective issued again: not a reduction
                continue
            if c.get("direction") == "backward" and (c.get("origin"), c.get("mesh_dim")) not in stepped:
                if c["kind"] == "all_gather" and self._cut_from_replicated(c.get("origin"), c.get("mesh_dim")):
                    self.gathered.add((c["origin"], c["mesh_dim"]))
                    continue
                self.reduced.setdefault(c.get("origin"), []).append((c["mesh_dim"], c["kind"]))
        self.readers: dict[str, list[str]] = {}  # file value -> the file values that read it
        for n, v in self.values.items():
            for r in v["reads"]:
                self.readers.setdefault(r, []).append(n)
        self.whole: dict[tuple[str, int], bool] = {}  # (value, mesh dim) -> its cotangent whole there (cotangents)
        self.logical: dict[str, Any] = {}  # trace node -> its value on the whole tensors
        self.ranks: dict[str, list] = {}  # trace node (unpaired) or file value -> each rank's piece
        self.paired: dict[str, str] = {}  # trace node -> file value
        self.claimed: set[str] = set()
        self.skipped = False
        self.results: list = []
        self.unpaired: list[str] = []
        self.leaves: dict[str, tuple[torch.Tensor, list[torch.Tensor], dict]] = {}  # parameter: whole, pieces, file
        by_parameter = {v.get("parameter"): n for n, v in self.values.items() if v["kind"] == "parameter"}
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        for node, value in zip(placeholders, bound):
            self.logical[node.name] = value
            if node.name in read and isinstance(value, torch.Tensor):
                aliases = names.get(id(value), {read[node.name]})
                name = next((by_parameter[a] for a in sorted(aliases) if a in by_parameter), None)
                if name is None:
                    continue
                whole = value.detach().clone().requires_grad_(value.is_floating_point())
                parts = [p.requires_grad_(whole.requires_grad) for p in P.cut(whole.detach(), self._at(name), mesh)]
                self.logical[node.name] = whole
                self.ranks[name], self.paired[node.name] = parts, name
                self.leaves[name] = (whole, parts, self.values[name])
                self.claimed.add(name)

    def _at(self, name: str) -> list[str]:
        return self.values[name]["placements"]

    def _root(self, name: str) -> str:
        """The value a read stands for: through moves and the compiler's one-read marks."""
        while True:
            v = self.values.get(name)
            if v is None or not v["reads"] or not (v["kind"] == "move" or v["op"].startswith(_INSERTED)):
                return name
            if v["op"].endswith("from_local"):
                return name
            name = v["reads"][0]

    def _cut_from_replicated(self, name: str | None, mesh_dim: int | None) -> bool:
        move = self.moves.get(name)
        steps = [s for s in move["steps"] if s["mesh_dim"] == mesh_dim] if move else []
        return len(steps) == 1 and steps[0]["src"] == "R" and steps[0]["dst"].startswith("S")

    def _reduced_above(self, name: str, mesh_dim: int) -> bool:
        """Whether value `name`, or a value it comes from through ops of one read, sums its cotangent on `mesh_dim`."""
        while name in self.values:
            if any(dim == mesh_dim for dim, _ in self.reduced.get(name, [])):
                return True
            reads = self.values[name]["reads"]
            if len(reads) != 1:
                return False
            name = reads[0]
        return False

    def pieces(self, name: str) -> list:
        """Each rank's piece of file value `name`: moves and marks made on the way."""
        if name in self.ranks:
            return self.ranks[name]
        v = self.values[name]
        if not v["reads"]:
            raise P.NotSimulated(f"value {name!r} has no source")
        src = self.pieces(v["reads"][0])
        if v["kind"] == "move":
            for s in self.moves[name]["steps"]:
                if (name, s["mesh_dim"]) in self.gathered:
                    src = P.reduce_in_backward(src, self.mesh, s["mesh_dim"])
                if s["src"] == "R" and s["dst"] == "P(sum)" and self._reduced_above(v["reads"][0], s["mesh_dim"]):
                    # The move's cotangent arrives whole on every rank (DTensor's backward of R -> P); where
                    # it meets partial cotangents that a reduction above sums, DTensor adds it as a partial
                    # (whole / n on each rank), so that the sum counts it once.
                    src = P.divide_in_backward(src, self.mesh.sizes[s["mesh_dim"]])
                src = P.step(src, self.mesh, s["mesh_dim"], s["src"], s["dst"], _own_backward(s))
        else:  # a gradient mark or another one-read op of the compiler: the identity forward
            src = [x.clone() if x.requires_grad else x for x in src]
        self.ranks[name] = self._reduced(name, src)
        return self.ranks[name]

    def _reduced(self, name: str, parts: list) -> list:
        for dim, kind in self.reduced.get(name, []):
            if kind != "all_reduce":
                raise P.NotSimulated(f"a backward {kind} at {name!r}")
            parts = P.reduce_in_backward(parts, self.mesh, dim)
        return parts

    # ------------------------------------------------------------------------- forward

    def forward(self) -> list[Problem]:
        inplace = [n.name for n in self.gm.graph.nodes if in_place(n)]
        if inplace:  # the file holds the compiler's out-of-place rewrite: not paired op for op yet
            self.summary.skipped.append(f"{self.where}: in-place ops ({', '.join(inplace[:3])}): the graph")
            self.skipped = True
            return []
        for node in self.gm.graph.nodes:
            if node.op in ("call_function", "call_method", "get_attr"):
                try:
                    problem = self._op(node)
                except P.NotSimulated as e:
                    self.summary.skipped.append(f"{self.where} op {node.name!r} ({e}): the rest of the graph")
                    self.skipped = True
                    return []
                if problem is not None:
                    self.skipped = True
                    return [problem]
            elif node.op == "call_module":
                self.summary.skipped.append(f"{self.where} module call {node.name!r}: the rest of the graph")
                self.skipped = True
                return []
        self.skipped = False
        return self._outputs()

    def _logical(self, node: fx.Node) -> Any:
        args, kwargs = wide(fx.node.map_arg((node.args, node.kwargs), lambda a: self.logical[a.name]))
        if node.op == "get_attr":
            return wide(getattr(self.gm, node.target))
        if node.target in _DROPOUTS:
            p, training = (list(args[1:3]) + [kwargs.get("p", 0.5), kwargs.get("training", True)][len(args) - 1 :])[:2]
            if p and training:
                self.summary.skipped.append(f"{self.where} {node.name!r}: dropout (p={p}) taken as the identity")
            return args[0]
        if node.op == "call_method":
            return getattr(args[0], METHODS.get(node.target, node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    def _op(self, node: fx.Node) -> Problem | None:
        out = self._logical(node)
        self.logical[node.name] = out
        tensors = [a for a in node.all_input_nodes if isinstance(self.logical.get(a.name), torch.Tensor)]
        tuples = [a for a in node.all_input_nodes if isinstance(self.logical.get(a.name), (tuple, list))]
        piece = node.target is operator.getitem and bool(tuples)
        if not piece and not isinstance(out, torch.Tensor):
            if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
                self.ranks[node.name] = self._run_ranks(node, tensors, None, out)
            return None
        name = self._pair(node, out, tensors)
        parts = self._piece(node, tuples[0], name) if piece else None
        if parts is None:
            parts = self._run_ranks(node, tensors, name, out)
        if name is None:
            self.summary.unpaired += 1
            self.unpaired.append(node.name)
            self.ranks[node.name] = parts
            return None
        parts = self._reduced(name, parts)
        self.ranks[name] = parts
        return self.compare(name, parts, out)

    def _piece(self, node: fx.Node, source: fx.Node, name: str | None) -> list | None:
        """Each rank's item of tuple op `source` (split, chunk) that getitem `node` takes; None where no rank ran it."""
        reads = self.values[name]["reads"] if name else []
        if any(self.values.get(r, {}).get("kind") == "move" for r in reads):
            # The compiler wrote this piece as its own op reading a moved value (gathered first, under
            # layout="dtensor"): the tuple op again, on the pieces the file moved.
            inputs = [a for a in source.all_input_nodes if isinstance(self.logical.get(a.name), torch.Tensor)]
            return [t[node.args[1]] for t in self._run_ranks(source, inputs, name, self.logical[source.name])]
        return [t[node.args[1]] for t in self.ranks[source.name]] if source.name in self.ranks else None

    def compare(self, name: str, parts: list, out: torch.Tensor, placements=None, what="value") -> Problem | None:
        placements = placements or self._at(name)
        shapes = {tuple(p.shape) for p in parts}
        try:
            whole, spread = P.assemble(parts, placements, self.mesh)
        except (RuntimeError, P.NotSimulated) as e:
            return self._problem(name, placements, f"pieces that do not fit together ({e}); shapes {sorted(shapes)}")
        self.summary.values += what == "value"
        if spread > RTOL * scale(out):
            return self._problem(name, placements, f"replicas differing by {spread:.3g} (max abs) between ranks", what)
        how = differs(whole, out, what)
        return self._problem(name, placements, how, what) if how else None

    def _problem(self, name: str, placements, got: str, what: str = "value") -> Problem:
        v = self.values.get(name, {})
        if what == "gradient":
            where = f"{self.where}, gradient of parameter {v.get('parameter')!r} (value {name!r})"
        else:
            where = f"{self.where}, {what} {name!r}" + (f" ({v['op']})" if v.get("op") else "")
        return Problem(
            where,
            "numerical refinement",
            f"{placements}: run on every rank in float64 and put back together, {got}",
            f"the logical program's {what} (the model re-traced, one device, float64)",
        )

    def _pair(self, node: fx.Node, out: torch.Tensor, tensors: list[fx.Node]) -> str | None:
        """The file's value for trace op `node`: by name (Dynamo names both after the user's
        variable), else an unclaimed op of its shape reading the same values."""
        v = self.values.get(node.name)
        if v is not None and v["kind"] == "op" and not v["op"].startswith(_INSERTED) and node.name not in self.claimed:
            self.claimed.add(node.name)
            self.paired[node.name] = node.name
            return node.name
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].name in self.ranks:
            tensors = [a for a in node.args[0].all_input_nodes if isinstance(self.logical.get(a.name), torch.Tensor)]
        mine = [self.paired.get(a.name) for a in tensors]
        for name in sorted(self.values, key=natural):  # program order: split's pieces, say, in order
            v = self.values[name]
            if name in self.claimed or v["kind"] != "op" or v["op"].startswith(_INSERTED):
                continue
            if v["shape"] == list(out.shape) and [self._root(r) for r in v["reads"]] == mine:
                self.claimed.add(name)
                self.paired[node.name] = name
                return name
        return None

    def _reads(self, node: fx.Node, tensors: list[fx.Node], name: str | None) -> dict[str, tuple[list, list]]:
        """Each tensor argument's pieces on every rank and their placement: the file's read of it
        (moved) where the file says which."""
        out, reads = {}, list(self.values[name]["reads"]) if name else []
        whole = ["R"] * len(self.mesh.sizes)
        for i, a in enumerate(tensors):
            mine = self.paired.get(a.name)
            pick = next((r for r in reads if self._root(r) == mine), None) if mine else None
            if pick is None and mine is None:  # an input: the file's first unbound input it reads
                pick = next((r for r in reads if self._unbound_input(self._root(r))), None)
                if pick is not None:
                    self._bind(a, self._root(pick))
            if pick is None and name and len(reads) == len(tensors) - i:
                pick = reads[0]  # the rest in order
            if pick is not None:
                reads.remove(pick)
                out[a.name] = (cotangents.counted_once(self, pick, name), self._at(pick))
            elif mine in self.ranks:
                out[a.name] = (self.ranks[mine], self._at(mine))
            elif a.name in self.ranks:
                out[a.name] = (self.ranks[a.name], None)
            else:  # read by no value of the file: an input or buffer every rank holds whole
                out[a.name] = (P.cut(self.logical[a.name], whole, self.mesh), whole)
        return out

    def _unbound_input(self, name: str) -> bool:
        """An input (`from_local`), or a plain tensor of the program made a replicated one
        (`replicate`, no reads), not yet bound to the trace's tensor it stands for."""
        v = self.values.get(name) or {}
        is_input = v.get("kind") == "input" or (v.get("op", "").startswith(_INSERTED) and not v.get("reads"))
        return is_input and name not in self.claimed

    def _bind(self, node: fx.Node, name: str) -> None:
        self.claimed.add(name)
        self.paired[node.name] = name
        self.ranks[name] = P.cut(self.logical[node.name], self._at(name), self.mesh)
        self.summary.values += 1

    def _run_ranks(self, node: fx.Node, tensors: list[fx.Node], name: str | None, out: Any) -> list:
        """The op on each rank's pieces. Shapes written in the op become the rank's local shape;
        an op that reads no tensor makes the logical value, cut as the file places it."""
        placements = self._at(name) if name else ["R"] * len(self.mesh.sizes)
        if not tensors or node.op == "get_attr" or node.target in _CREATE_LIKE:
            return P.cut(out, placements, self.mesh) if isinstance(out, torch.Tensor) else [out] * self.mesh.world
        local = self._reads(node, tensors, name)
        results = []
        for r in range(self.mesh.world):
            env = {a: parts[r] for a, (parts, _) in local.items()}
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env.get(a.name, self.logical[a.name]))
            args, kwargs = wide((args, kwargs))
            target = METHODS.get(node.target, node.target) if node.op == "call_method" else node.target
            if target in _RESHAPES or target in _EXPANDS:
                shape = P.local_shape(out.shape, placements, self.mesh, r)
                results.append(args[0].reshape(shape) if target in _RESHAPES else args[0].expand(shape))
            elif target in _DROPOUTS:
                results.append(args[0])
            elif target in _EMBEDDINGS and name:
                weight = node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
                rows = self.logical[weight.name].shape[0]
                results.append(P.lookup(target, args, kwargs, local[weight.name][1], self.mesh, r, rows))
            elif target in vocabulary.PER_RANK and name and not kwargs:
                at = [local[a.name][1] if isinstance(a, fx.Node) and a.name in local else None for a in node.args]
                classes = self.logical[node.args[0].name].shape[1]
                results.append(vocabulary.on_rank(target, args, at, self.mesh, r, classes))
            elif node.op == "call_method":
                results.append(getattr(args[0], target)(*args[1:], **kwargs))
            else:
                try:
                    results.append(target(*args, **kwargs))
                except RuntimeError as e:  # may be the file's placements, or an op this check cannot cut
                    raise P.NotSimulated(f"rank {r}: {str(e).splitlines()[0][:120]}") from e
        return results

    def _outputs(self) -> list[Problem]:
        self.results = []
        out_node = next(iter(self.gm.graph.find_nodes(op="output")))
        returned = [a for a in flat(out_node.args[0]) if isinstance(self.logical.get(a.name), torch.Tensor)]
        if len(returned) != len(self.outputs):
            self.summary.skipped.append(
                f"{self.where}: {len(self.outputs)} outputs in the file, {len(returned)} traced"
            )
            return []
        for node, o in zip(returned, self.outputs):
            parts = self.pieces(o["value"])
            at = self._at(o["value"])
            for d, (a, b) in enumerate(zip(at, o["placements"])):
                if a != b:
                    parts = P.step(parts, self.mesh, d, a, b, None)
            problem = self.compare(o["value"], parts, self.logical[node.name], o["placements"], "output")
            if problem is not None:
                return [problem]
            self.results.append((node, parts, o["placements"]))
        return []

    def backward(self) -> list[Problem]:
        return gradients.check(self)
