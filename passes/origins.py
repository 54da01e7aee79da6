"""Origin pass: tag every node of the DTensor program, so the collectives traced from it name it.

Reads the DTensor program after the layout and roles passes. Every call node
gets its own name as its origin (`_torch_private.set_origin`); AOTAutograd
carries the tag to each node the forward of that node traces to, and to each
backward node of the same autograd node. So every collective of the joint graph
names the move (or op) whose forward issued it or whose backward it belongs to,
and the transpose pass looks its partner up instead of guessing.

The pass also records, per origin, the layouts it reads and writes (one letter
per mesh dimension, `spmd.placements.letter`): with the move table
(`collective_kinds.backward_kinds`) they say which collectives the backward of
that node may issue on each mesh dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx
from torch.distributed.tensor import DTensor

from torch_hca.compiler import dtensor_ops
from torch_hca._torch_private import set_origin
from torch_hca.spmd.collective_kinds import Kind, backward_kinds, move_kind
from torch_hca.report.text import module_path
from torch_hca.spmd.placements import letter

from .infra import PassContext, PassResult


@dataclass(frozen=True)
class Origin:
    """One node of the DTensor program, as the joint graph's collectives refer to it."""

    name: str
    op: str
    inputs: tuple[tuple[str, ...], ...]  # each DTensor input's layout, a letter per mesh dim
    output: tuple[str, ...] | None  # the layout it writes (None: not a DTensor)
    module: str = ""  # the module path it came from, if Dynamo recorded one
    local_view: bool = False  # a traced autograd.Function (hca.collectives): its own backward
    mesh_names: tuple[str, ...] = ()  # the mesh's dimension names, where it has them

    def dim_label(self, dim: int) -> str:
        """``mesh dim 'tp'`` where the mesh names its dimensions, else ``mesh dim 0``."""
        return f"mesh dim {self.mesh_names[dim]!r}" if dim < len(self.mesh_names) else f"mesh dim {dim}"

    def transition(self, dim: int) -> list[tuple[str, str]]:
        """(src, dst) on mesh dim `dim` for each input: how this node changes that dimension.

        A tensor dim sharded over several mesh dims is cut outer to inner; when
        another mesh dim's cut of the same tensor dim changes, DTensor gathers
        this one and cuts it again (S -> R -> S), so both steps count.
        """
        pairs = [(i[dim], i[dim] if self.output is None else self.output[dim]) for i in self.inputs]
        pairs = pairs or ([(self.output[dim], self.output[dim])] if self.output is not None else [])
        steps = []
        for i, (src, dst) in enumerate(pairs):
            steps.append((src, dst))
            layout_in = self.inputs[i] if self.inputs else self.output
            layout_out = self.output if self.output is not None else layout_in
            if (
                src == dst
                and src.startswith("S")
                and any(a != b and src in (a, b) for k, (a, b) in enumerate(zip(layout_in, layout_out)) if k != dim)
            ):
                steps += [(src, "R"), ("R", dst)]
        return steps

    def forward_kinds(self, dim: int) -> set[Kind]:
        """The collectives this node's forward is meant to issue on mesh dim `dim` (the solver's costing)."""
        return {k for src, dst in self.transition(dim) if (k := move_kind(src, dst)) is not None}

    def backward_kinds(self, dim: int) -> set[Kind]:
        """The collectives its backward may issue on mesh dim `dim`, by the move table."""
        return set().union(*(backward_kinds(src, dst) for src, dst in self.transition(dim)))

    def describe(self, dim: int | None) -> str:
        if self.local_view or dim is None:
            return f"{self.name} ({self.op}{', ' + self.module if self.module else ''})"
        moves = sorted({f"{s} -> {d}" for s, d in self.transition(dim)})
        return f"{self.name} ({self.op}{', ' + self.module if self.module else ''}; {self.dim_label(dim)}: {', '.join(moves)})"


@dataclass
class Origins:
    """Every tagged node of one graph's DTensor program, and the mesh dim of each process group."""

    nodes: dict[str, Origin] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)  # group name -> mesh dim

    def get(self, name: str | None) -> Origin | None:
        return self.nodes.get(name) if name is not None else None


def _layout(v) -> tuple[str, ...] | None:
    return tuple(letter(p) for p in v.placements) if isinstance(v, DTensor) else None


def _op(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def _bodies(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The subgraphs a higher-order op such as ``autograd_function_apply`` runs."""
    return [
        getattr(gm, a.target)
        for a in node.args
        if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule)
    ]


def _module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return module_path(next(reversed(stack.values()))[0]) if stack else ""


def _mesh_names(gm: fx.GraphModule) -> tuple[str, ...]:
    for node in gm.graph.nodes:
        mesh = getattr(node.meta.get("example_value"), "device_mesh", None)
        if mesh is not None:
            return tuple(mesh.mesh_dim_names or ())
    return ()


class OriginPass:
    name = "origins"
    reads = "DTensor program"
    writes = "the same program, every call node tagged with its name (node.meta['custom'])"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        origins, names = Origins(), _mesh_names(gm)
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            set_origin(node, node.name)
            for body in _bodies(gm, node):  # a traced autograd.Function (hca.collectives): its fwd and bwd graphs
                for inner in body.graph.nodes:
                    if inner.op == "call_function":
                        set_origin(inner, node.name)
            value = node.meta.get("example_value")
            inputs = tuple(
                lay for a in node.all_input_nodes if (lay := _layout(a.meta.get("example_value"))) is not None
            )
            if node.target is dtensor_ops.to_output:
                output = tuple(letter(p) for p in node.args[1])
            elif node.target is dtensor_ops.from_local:
                output = tuple(letter(p) for p in node.args[2])
            else:
                output = _layout(value)
            origins.nodes[node.name] = Origin(
                node.name,
                _op(node),
                inputs,
                output,
                _module(node),
                local_view=bool(_bodies(gm, node)),
                mesh_names=names,
            )
            mesh = getattr(value, "device_mesh", None)
            if mesh is not None and not origins.dims:
                origins.dims = {mesh.get_group(d).group_name: d for d in range(mesh.ndim)}
        ctx.origins = origins
        return PassResult(gm, bool(origins.nodes), [f"{len(origins.nodes)} nodes tagged"])
