"""What the layout solver chooses from: each op's candidate strategies, found by asking DTensor.

Every combination of input layouts an op may read (`offered_read`, limited by
`MAX_COMBOS`) is run on fake DTensors (`probes.probe`; on a mesh of several dims, only
where each dim's part runs alone on that dim's 1-D mesh); the ones DTensor executes
without redistributing on its own are kept, with the output layout its sharding
rule gives and the op's compute time under the cost model. Parameters keep
their storage layout or are gathered; program inputs and explicit
redistributions are fixed (`build_ops`). `torch_hca.compiler.layout.solver` then picks
one strategy per op.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torch_hca.compiler import attention, dtensor_ops
from torch_hca.compiler.embedding import embedding
from torch_hca.spmd.chunks import is_uneven, uneven_mesh_dims
from torch_hca.spmd.cost_model import CostModel, smallest_matmul_dim
from torch_hca.spmd.collective_nodes import nbytes
from torch_hca.spmd.op_families import TORCH_MATMULS, TORCH_VIEWS, torch_flops
from torch_hca.errors import UnsupportedError
from torch_hca.compiler.logical import local_shape
from torch_hca.compiler.layout.probes import probe, submeshes

Layout = tuple[Placement, ...]
PARAMETER = "parameter storage"

# Beyond this many input-layout combinations for one op, activations only try
# the layouts their producer can write, their local chunks, and replicated.
MAX_COMBOS = 256

# Ops whose reads are fixed: a result's layout for the caller, or replicated for an op DTensor
# cannot shard (both move their inputs themselves).
FIXED_READS: dict[Callable, Callable[[fx.Node, DeviceMesh], Layout]] = {
    dtensor_ops.to_output: lambda node, mesh: tuple(node.args[1]),
    dtensor_ops.run_local: lambda node, mesh: (Replicate(),) * mesh.ndim,
}

# Ops linear in each argument, whose DTensor rules are trusted with Partial inputs. A rule is
# not trusted otherwise: DTensor's convolution rule accepts a partial weight and bias and
# returns conv(x, W/n) + b/n on each rank, which sums to the wrong value.
PARTIAL_OK = {
    "add",
    "iadd",
    "sub",
    "isub",
    "neg",
    "mul",
    "imul",
    "truediv",
    "div",
    "sum",
    "matmul",
    "mm",
    "bmm",
    "linear",
    "addmm",
    "baddbmm",
    "cat",
    "stack",
    "view",
    "reshape",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "flatten",
    "t",
    "contiguous",
    "narrow",
    "select",
    "getitem",
    "clone",
    "to",
    "float",
    "type_as",
}


# Ops whose DTensor rules are not trusted with any split: read whole on every rank. Batch
# norm's rule accepts channel-split inputs with replicated running statistics (the local op
# then fails), and a batch split would normalize each rank's rows by their own statistics.
REPLICATED_ONLY = {"batch_norm", "instance_norm"}
# Ops whose DTensor rule is trusted only for a batch split of the first input (the rest whole):
# the convolution rule also accepts a channel-split weight with a whole bias (the local op fails)
# and partial weights (wrong sums).
BATCH_SPLIT_ONLY = {"conv1d", "conv2d", "conv3d"}


def offered_read(name: str, slot: int, layout: Layout) -> bool:
    """Whether op `name` may read its `slot`-th DTensor input in `layout`: where its DTensor
    rule is trusted (PARTIAL_OK, REPLICATED_ONLY, BATCH_SPLIT_ONLY above)."""
    whole = all(isinstance(p, Replicate) for p in layout)
    if name in REPLICATED_ONLY:
        return whole
    if name in BATCH_SPLIT_ONLY:
        return (
            whole or slot == 0 and all(isinstance(p, Replicate) or isinstance(p, Shard) and p.dim == 0 for p in layout)
        )
    return name in PARTIAL_OK or not any(isinstance(p, Partial) for p in layout)


def op_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", "")


@dataclass(frozen=True)
class Strategy:
    inputs: tuple[Layout, ...]  # one per DTensor input (the op's `slots`)
    output: Layout
    varying: tuple[bool, ...]  # per mesh dimension: the op's work is split over it
    compute_s: float  # forward + backward
    memory_bytes: float  # this rank's bytes of the result


@dataclass
class Op:
    """One node of the program with its candidate strategies."""

    node: fx.Node
    slots: list[fx.Node]
    strategies: list[Strategy]
    fixed: str | None = None  # why there is a single choice
    redistributes_itself: bool = False  # an explicit `.redistribute` in the user's program
    requires_grad: bool = False
    value: Any = None  # the fake DTensor Dynamo traced
    is_parameter: bool = False  # its moves and gradient reductions are bucketed


# ----------------------------------------------------------------------------- candidates


def split_factor(p: Placement, n: int) -> int:
    return n if isinstance(p, Shard) else 1


def value_bytes(v: Any) -> float:
    return float(nbytes(v))


def candidate_layouts(value: DTensor, mesh: DeviceMesh, storage: Layout | None) -> list[Layout]:
    """Layouts a consumer may read `value` in.

    A parameter (``storage`` given) is read as stored, gathered on any of its
    sharded mesh dimensions, or as one summand where replicated (a bias added
    to a partial sum); anything else in every layout whose shards divide
    evenly.
    """
    if storage is not None:
        uneven = uneven_mesh_dims(value.shape, storage, mesh.shape)  # read only as stored
        options = [
            (p,) if m in uneven else (p, Replicate(), Partial()) if isinstance(p, Shard) else (p, Partial())
            for m, p in enumerate(storage)
        ]
        return list(dict.fromkeys(itertools.product(*options)))
    shape = value.shape
    # On a mesh dim of one rank every placement holds the same data: read it replicated.
    per_dim = [
        [Replicate(), Partial()] + [Shard(d) for d in range(len(shape)) if _divides(shape[d], n)]
        if n > 1
        else [Replicate()]
        for n in mesh.shape
    ]
    layouts = []
    for layout in itertools.product(*per_dim):
        ways = {}
        for m, p in enumerate(layout):
            if isinstance(p, Shard):
                ways[p.dim] = ways.get(p.dim, 1) * mesh.shape[m]
        if all(_divides(shape[d], w) for d, w in ways.items()):
            layouts.append(layout)
    return layouts


def _divides(size: Any, n: int) -> bool:
    return isinstance(size, int) and size % n == 0 and size >= n


def _smallest_matmul_dim(
    first: int,
    inputs: list[Any],
    out: Any,
    layouts: tuple[Layout, ...],
    out_layout: Layout,
    mesh_shape: tuple[int, ...],
) -> float | None:
    """`smallest_matmul_dim` of this rank's pieces under these layouts (`first`: the position of the
    first matmul operand). The backward's two matmuls have the same three dimensions, so one
    figure serves the forward and backward."""
    if not (len(inputs) > first and getattr(inputs[first], "ndim", 0) >= 1 and getattr(out, "ndim", 0) >= 1):
        return None
    against_weight = len(inputs) > first + 1 and getattr(inputs[first + 1], "ndim", 0) == 2
    return smallest_matmul_dim(
        local_shape(inputs[first].shape, layouts[first], mesh_shape),
        local_shape(out.shape, out_layout, mesh_shape),
        against_weight,
    )


# ----------------------------------------------------------------------------- the program as ops


# Bytes a stored parameter costs per byte of it: itself, its gradient, Adam's two moments.
STORAGE_COPIES = 4


def build_ops(
    gm: fx.GraphModule,
    mesh: DeviceMesh,
    model: CostModel,
    storage_of: Callable[[fx.Node], Layout | None],
    free_storage: Callable[[fx.Node], bool] = lambda node: False,
) -> list[Op]:
    """Every DTensor-valued node with its strategies, in graph order.

    ``storage_of``: a parameter placeholder's fixed storage layout (else None).
    ``free_storage``: placeholders whose storage the solver chooses (`hca.plan`).
    """
    value_of = lambda n: n.meta.get("example_value")
    ops: dict[fx.Node, Op] = {}
    sizes = tuple(mesh.shape)
    for node in gm.graph.nodes:
        value = value_of(node)
        if isinstance(value, (tuple, list)) and any(isinstance(v, DTensor) for v in value):
            raise UnsupportedError(f"layout solver: {node.name} returns several DTensors; not supported yet")
        if node.op == "call_function" and node.target in FIXED_READS:
            ops[node] = _fixed_reads(node, value_of, mesh)
            continue
        if not isinstance(value, DTensor):
            continue
        layout = tuple(value.placements)
        slots = [a for a in node.all_input_nodes if isinstance(value_of(a), DTensor)]
        requires_grad = bool(value.requires_grad)
        fixed_one = lambda why, inputs=(): Op(
            node,
            slots,
            [Strategy(tuple(inputs), layout, (False,) * len(sizes), 0.0, 0.0)],
            fixed=why,
            requires_grad=requires_grad,
            value=value,
        )
        if node.op == "placeholder" and free_storage(node):
            ops[node] = _storage_choices(node, value, mesh)
        elif node.op == "placeholder":
            op = fixed_one(PARAMETER if storage_of(node) is not None else "graph input")
            op.is_parameter = storage_of(node) is not None
            ops[node] = op
        elif not slots:
            ops[node] = fixed_one("made from a local tensor")
        elif node.op == "call_method" and node.target == "redistribute":
            op = fixed_one("explicit redistribute in the program", (layout,))
            op.slots, op.redistributes_itself = slots[:1], True
            ops[node] = op
        else:
            ops[node] = _probe_op(gm, node, slots, value, mesh, model, storage_of, ops)
    return list(ops.values())


def _fixed_reads(node: fx.Node, value_of, mesh: DeviceMesh) -> Op:
    """A sink or an op that moves its own inputs: one strategy, its reads fixed (the edges pay the moves)."""
    slots = [a for a in node.all_input_nodes if isinstance(value_of(a), DTensor)]
    layout = FIXED_READS[node.target](node, mesh)
    value = value_of(node) if isinstance(value_of(node), DTensor) else value_of(slots[0])
    strategy = Strategy(tuple(layout for _ in slots), layout, (False,) * mesh.ndim, 0.0, 0.0)
    why = (
        "the layout the caller receives" if node.target is dtensor_ops.to_output else "run replicated (no DTensor rule)"
    )
    return Op(node, slots, [strategy], fixed=why, requires_grad=bool(value.requires_grad), value=value)


def _storage_choices(node: fx.Node, value: DTensor, mesh: DeviceMesh) -> Op:
    """A parameter whose storage is free: one strategy per layout it can be stored in."""
    strategies = []
    for layout in candidate_layouts(value, mesh, None):
        if any(isinstance(p, Partial) for p in layout):
            continue
        local = value_bytes(value) / math.prod(split_factor(p, n) for p, n in zip(layout, mesh.shape))
        strategies.append(Strategy((), layout, (False,) * mesh.ndim, 0.0, STORAGE_COPIES * local))
    return Op(node, [], strategies, requires_grad=bool(value.requires_grad), value=value, is_parameter=True)


def _uneven_written(slot: fx.Node, ops: dict[fx.Node, Op], mesh: DeviceMesh) -> list[Layout]:
    """The layouts `slot`'s producer may write whose pieces are uneven (GPT-2's logits over a
    vocabulary cut 25,129 : 25,128): read as written, they are offered beside the even ones."""
    if slot not in ops or ops[slot].value is None:
        return []
    shape = ops[slot].value.shape
    written = dict.fromkeys(st.output for st in ops[slot].strategies)
    return [w for w in written if is_uneven(shape, w, mesh.shape)]


def _chunk_of(written: Layout, read: Layout) -> bool:
    """`read` is `written` itself or a local chunk of it (no communication): a mask made
    replicated is read batch-split by attention that splits the batch."""
    return all(w == r or isinstance(w, Replicate) and isinstance(r, Shard) for w, r in zip(written, read))


def _probe_op(gm, node, slots, value, mesh, model: CostModel, storage_of, ops: dict[fx.Node, Op]) -> Op:
    value_of = lambda n: n.meta.get("example_value")
    per_slot = [candidate_layouts(value_of(s), mesh, storage_of(s)) + _uneven_written(s, ops, mesh) for s in slots]
    name = op_name(node)
    per_slot = [[c for c in cands if offered_read(name, i, c)] for i, cands in enumerate(per_slot)]
    if math.prod(len(c) for c in per_slot) > MAX_COMBOS:
        narrowed = []
        for s, cands in zip(slots, per_slot):
            if storage_of(s) is None:
                written = {st.output for st in ops[s].strategies} if s in ops else set()
                cands = [
                    c
                    for c in cands
                    if any(_chunk_of(w, c) for w in written) or all(isinstance(p, Replicate) for p in c)
                ]
            narrowed.append(cands)
        per_slot = narrowed
    strategies = []
    inputs = [value_of(s) for s in slots]
    combos = list(itertools.product(*per_slot))
    if node.target is attention.sdpa:  # its rule is ours: rule out what it cannot run before probing
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), value_of)
        read_in = lambda layouts: {id(v): lay for v, lay in zip(inputs, layouts)}
        combos = [c for c in combos if attention.runs_in_place(args, kwargs, lambda t, r=read_in(c): r.get(id(t)))]
    meshes_1d = submeshes(mesh)
    each_dim_runs = [
        layouts
        for layouts in combos
        if all(
            probe(gm, node, slots, tuple((lay[m],) for lay in layouts), value_of, sub) is not None
            for m, sub in meshes_1d
        )
    ]
    for layouts in each_dim_runs or combos:  # none: probe every combination, as without the shortcut
        out = probe(gm, node, slots, layouts, value_of)
        if out is None:
            continue
        varying = tuple(not all(isinstance(l[m], Replicate) for l in (*layouts, out)) for m in range(mesh.ndim))
        first = TORCH_MATMULS.get(node.target)
        smallest = None if first is None else _smallest_matmul_dim(first, inputs, value, layouts, out, mesh.shape)
        compute = (
            0.0
            if node.target in TORCH_VIEWS
            else 3.0 * model.compute_s(*local_work(node.target, inputs, layouts, value, out, mesh.shape), smallest)
        )
        memory = (
            0.0
            if node.target in TORCH_VIEWS
            else value_bytes(value) / math.prod(split_factor(p, n) for p, n in zip(out, mesh.shape))
        )
        strategies.append(Strategy(tuple(layouts), out, varying, compute, memory))
    if not strategies:
        raise UnsupportedError(
            f"layout solver: DTensor runs {node.name} ({node.target}) in no layout of its inputs "
            f"without redistributing on its own; source: {source_line(node)}"
        )
    return Op(node, slots, strategies, requires_grad=bool(value.requires_grad), value=value)


def local_work(
    target: Any,
    inputs: list[Any],
    layouts: tuple[Layout, ...],
    out_value: Any,
    out: Layout,
    mesh_shape: tuple[int, ...],
) -> tuple[float, float]:
    """(FLOPs, bytes touched) of one rank's forward, from its local pieces' shapes.

    A rank does the work its pieces hold: a `Shard` read or result is its share, a `Partial` or
    `Replicate` one is whole. So a replicated weight read as `Partial` beside a replicated input
    (each rank holds the whole weight, halved) costs the whole matmul on every rank, while a
    batch split costs each rank its rows.
    """
    local_in = [local_shape(v.shape, lay, mesh_shape) for v, lay in zip(inputs, layouts)]
    local_out = local_shape(out_value.shape, out, mesh_shape)
    # The lifted attention (`attention.sdpa`) is torch's scaled_dot_product_attention to the cost model.
    target = F.scaled_dot_product_attention if target is attention.sdpa else target
    if target in (F.embedding, embedding):  # a row gather touches the rows it looks up, not the table
        local_in = local_in[:1]
    flops = torch_flops(target, [tuple(s) for s in local_in], math.prod(local_out))
    touched = sum(math.prod(s) * v.element_size() for s, v in zip(local_in, inputs))
    return flops, touched + math.prod(local_out) * out_value.element_size()


def source_line(node: fx.Node) -> str:
    """The user's line that made `node` (the last code line of its stack trace)."""
    lines = [l.strip() for l in (node.meta.get("stack_trace") or "").splitlines()]
    code = [l for l in lines if l and not set(l) <= set("^~ ") and not l.startswith("File ")]
    return code[-1] if code else "?"
