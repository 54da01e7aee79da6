"""The transpose pass and the backward check on programs the backend traced (fake process group).

Every collective of the joint graph names the DTensor program node it came
from (passes/origins.py). The transpose pass looks each backward collective's
partner up by that tag and checks its kind against the move table; the
backward check then makes sure no later pass changed what was derived. The
mutation tests break a traced backward the ways a buggy pass could, between
the two, and expect strict mode to name the broken node.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

import torch_hca as hca
from torch_hca._torch_private import set_origin
from torch_hca.spmd.collective_kinds import Kind
from torch_hca.spmd.collective_nodes import OPS, WAIT, node_group, node_kind
from torch_hca.compiler.options import Options
from torch_hca.passes import collective_rewrites
from torch_hca.passes.infra import PassContext
from torch_hca.passes.origins import Origin, Origins
from torch_hca.passes.transpose import PARTNER, RULE, BackwardKeptPass, TransposePass, backward_nodes
from torch_hca.report.records import GraphReport

c10d = torch.ops._c10d_functional
LAYERS = 4


class Block(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    """Four identical blocks: every layer's collectives have the same kind, group and size."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


# FSDP-style storage on 4 ranks: each weight gathered forward, its gradient reduce-scattered backward;
# the biases replicated, so their gradients are all-reduced (the eager role).
FSDP = {"blocks.*.weight": Shard(0), "blocks.*.bias": Replicate()}
# On a (dp=2, tp=2) mesh: weights sharded over both dims, so backward collectives run on both groups.
TWO_D = {
    "blocks.*.fc1.*": (Shard(0), Shard(0)),
    "blocks.*.fc2.weight": (Shard(0), Shard(1)),
    "blocks.*.fc2.bias": (Replicate(), Replicate()),
}


def compile_stack(two_d: bool = False, **options) -> hca.CompileReport:
    torch.manual_seed(0)
    if two_d:
        # DTensor's per-op layouts: the solver's probing takes about 70 s on this 2-D stack.
        options.setdefault("layout", "dtensor")
        mesh = hca.init_mesh((2, 2), ("dp", "tp"))
        model = hca.sharded(TWO_D, mesh=mesh, inputs=(Shard(0), Replicate()), outputs=(Shard(0), Replicate()))(Stack())
        x = torch.randn(4, 16)
    else:
        model = hca.sharded(FSDP, inputs=Shard(0), outputs=Shard(0))(Stack())
        x = torch.randn(2, 16)
    compiled = torch.compile(model, backend="hca", options={"strict": True, **options})
    compiled(x).sum().backward()
    return hca.report(compiled)


def _layer(stack: dict | None) -> int | None:
    for path, _ in reversed(list((stack or {}).values())):
        m = re.search(r"blocks(?:\.|, ')(\d+)", path)
        if m:
            return int(m.group(1))
    return None


def layer_read_by(node: fx.Node) -> int | None:
    """The block whose forward reads `node`, found by following its users (not its tags)."""
    frontier, seen = [node], set()
    while frontier:
        n = frontier.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if n is not node and (layer := _layer(n.meta.get("nn_module_stack"))) is not None:
            return layer
        frontier += list(n.users)
    return None


def layer_written_by(node: fx.Node) -> int | None:
    """The block whose backward computed `node`'s input, found by following its inputs (not its tags)."""
    frontier, seen = list(node.all_input_nodes), set()
    while frontier:
        n = frontier.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if (layer := _layer(n.meta.get("fwd_nn_module_stack"))) is not None:
            return layer
        frontier += n.all_input_nodes
    return None


def test_each_backward_collective_pairs_with_its_own_layer(fake_pg):
    joint = compile_stack().graph.joint
    backward = backward_nodes(joint.graph)
    pairs = [
        (n, joint.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default))
        for n in joint.graph.nodes
        if n in backward and n.target in OPS and node_kind(n) is Kind.REDUCE_SCATTER
    ]
    assert len(pairs) == 2 * LAYERS  # the two weights of each block
    by_name = {n.name: n for n in joint.graph.nodes}
    seen_layers = []
    for bw, _ in pairs:
        fw = by_name[bw.meta[PARTNER]]
        assert fw.meta[PARTNER] == bw.name and node_kind(fw) is Kind.ALL_GATHER
        assert layer_read_by(fw) == layer_written_by(bw) is not None, (fw.name, bw.name)
        seen_layers.append(layer_written_by(bw))
    assert sorted(seen_layers) == sorted(list(range(LAYERS)) * 2)


def test_every_backward_collective_of_a_two_d_stack_is_proven(fake_pg):
    joint = compile_stack(two_d=True).graph.joint  # strict: an unproven one would have raised
    backward = backward_nodes(joint.graph)
    rules = [n.meta[RULE] for n in joint.graph.nodes if n in backward and n.target in OPS]
    groups = {node_group(n) for n in joint.graph.nodes if n in backward and n.target in OPS}
    assert groups and rules
    assert all(r.startswith(("transpose of", "cotangent reduction")) for r in rules), rules


# ----------------------------------------------------------------------------- hand-made joint graphs


def joint(fn, *shapes) -> fx.GraphModule:
    """A graph whose inputs are named like AOTAutograd's: primals, then tangents."""
    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for i, p in enumerate(placeholders):
        p.name = p.target = "tangents_1" if i == len(placeholders) - 1 else f"primals_{i + 1}"
    gm.recompile()
    return gm


def run(gm, origins=None, strict=False):
    ctx = PassContext(Options(strict=strict), GraphReport(index=0, options=None), origins=origins)
    TransposePass().run(gm, ctx)
    return {n.name: (n.meta.get(PARTNER), n.meta.get(RULE)) for n in gm.graph.nodes if RULE in n.meta}


def tag_all(gm: fx.GraphModule, origin: str) -> None:
    for n in gm.graph.nodes:
        set_origin(n, origin)


def origins_1d(origin: Origin) -> Origins:
    return Origins({origin.name: origin}, {dist.group.WORLD.group_name: 0})


def test_a_gather_pairs_with_the_backward_scatter_of_the_same_move(fake_pg):
    def fn(x, g):  # forward gathers x; backward scatters the cotangent g
        return funcol.all_gather_single(x, 0, dist.group.WORLD), funcol.reduce_scatter_single(
            g, "sum", 0, dist.group.WORLD
        )

    gm = joint(fn, (2, 3), (8, 3))
    tag_all(gm, "move")
    labels = run(gm, origins_1d(Origin("move", "redistribute", (("S0",),), ("R",))), strict=True)
    (fw,) = [k for k in labels if k.startswith("all_gather")]
    (bw,) = [k for k in labels if k.startswith("reduce_scatter")]
    assert labels[bw][0] == fw and labels[fw][0] == bw
    assert labels[bw][1] == f"transpose of {fw} (all_gather of move)"


def test_strict_mode_rejects_an_untagged_backward_collective(fake_pg):
    fn = lambda x, g: (x * 2, funcol.reduce_scatter_single(g, "sum", 0, dist.group.WORLD))
    assert "carries no origin tag" in next(iter(run(joint(fn, (4,), (8,))).values()))[1]
    with pytest.raises(hca.CheckError, match=r"backward reduce_scatter \w+ is unproven: it carries no origin tag"):
        run(joint(fn, (4,), (8,)), strict=True)


def test_strict_mode_rejects_a_kind_the_move_table_does_not_allow(fake_pg):
    # A value sharded in and out (S0 -> S0) owes nothing backward: an all_reduce there is unproven.
    gm = joint(lambda x, g: (x * 2, funcol.all_reduce(g, "sum", dist.group.WORLD)), (4,), (4,))
    tag_all(gm, "mul")
    with pytest.raises(hca.CheckError, match=r"all_reduce \w+ is unproven: only nothing may transpose mul"):
        run(gm, origins_1d(Origin("mul", "mul", (("S0",),), ("S0",))), strict=True)
    # The same all_reduce behind a replicated value is its cotangent reduction.
    gm = joint(lambda x, g: (x * 2, funcol.all_reduce(g, "sum", dist.group.WORLD)), (4,), (4,))
    tag_all(gm, "mul")
    labels = run(gm, origins_1d(Origin("mul", "mul", (("R",),), ("R",))), strict=True)
    assert next(iter(labels.values()))[1].startswith("cotangent reduction")


# ----------------------------------------------------------------------------- mutations


def _backward(gm: fx.GraphModule, kind: Kind, group: str | None = None) -> list[fx.Node]:
    backward = backward_nodes(gm.graph)
    return [
        n
        for n in gm.graph.nodes
        if n in backward and n.target in OPS and node_kind(n) is kind and (group is None or node_group(n) == group)
    ]


def _waited(node: fx.Node) -> fx.Node:
    (wait,) = [u for u in node.users if u.target is WAIT]
    return wait


def drop_a_reduction(gm):
    ar = _backward(gm, Kind.ALL_REDUCE)[0]
    _waited(ar).replace_all_uses_with(ar.args[0])
    gm.graph.erase_node(_waited(ar))
    gm.graph.erase_node(ar)
    return ar.name


def swap_a_partner(gm):
    """Hand two layers' reduced weight gradients (the same shape) to each other's parameters."""
    shape = lambda n: tuple(n.meta["val"].shape)
    a = _backward(gm, Kind.REDUCE_SCATTER)[0]
    b = next(n for n in _backward(gm, Kind.REDUCE_SCATTER)[1:] if shape(n) == shape(a))
    wait_a, wait_b = _waited(a), _waited(b)
    readers_a, readers_b = list(wait_a.users), list(wait_b.users)
    swap = {wait_a: wait_b, wait_b: wait_a}
    for r in {*readers_a, *readers_b}:
        r.args, r.kwargs = fx.node.map_arg((r.args, r.kwargs), lambda n: swap.get(n, n))
    later = max(wait_a, wait_b, key=_position)
    for r in readers_a + readers_b:
        if r.op != "output":
            later.append(r)  # read after both results exist
    return a.name


def wrong_kind(gm):
    ar = _backward(gm, Kind.ALL_REDUCE)[0]
    ar.target = c10d.all_gather_into_tensor.default  # same arity: (input, group size, group)
    ar.args = (ar.args[0], 4, ar.args[2])
    return ar.name


def wrong_group(gm):
    rs = _backward(gm, Kind.REDUCE_SCATTER)[0]
    rs.args = (*rs.args[:3], "not-the-group")
    return rs.name


def wrong_mesh_dim(gm):
    groups = {node_group(n) for n in gm.graph.nodes if n.target in OPS}
    rs = _backward(gm, Kind.REDUCE_SCATTER)[0]
    (other,) = groups - {node_group(rs)}
    rs.args = (*rs.args[:3], other)
    return rs.name


def extra_collective(gm):
    rs = _backward(gm, Kind.REDUCE_SCATTER)[0]
    wait = _waited(rs)
    with gm.graph.inserting_after(wait):
        extra = gm.graph.call_function(c10d.all_reduce.default, (wait, "sum", node_group(rs)))
        extra.meta["val"] = wait.meta["val"]
    with gm.graph.inserting_after(extra):
        waited = gm.graph.call_function(WAIT, (extra,))
        waited.meta["val"] = wait.meta["val"]
    wait.replace_all_uses_with(waited, delete_user_cb=lambda u: u is not extra)
    return extra.name


def reorder_within_a_group(gm):
    first, second = _backward(gm, Kind.REDUCE_SCATTER)[:2]
    # Issue the second before the first: move it (and what it reads) just before the first.
    second_inputs = []
    frontier = list(second.all_input_nodes)
    while frontier:
        n = frontier.pop()
        if n.op != "placeholder" and n not in second_inputs and _before(first, n):
            second_inputs.append(n)
            frontier += n.all_input_nodes
    for n in sorted(second_inputs, key=_position) + [second]:
        first.prepend(n)
    return second.name


def _position(n: fx.Node) -> int:
    return list(n.graph.nodes).index(n)


def _before(a: fx.Node, b: fx.Node) -> bool:
    return _position(a) < _position(b)


def all_reduce_where_a_reduce_scatter_belongs(gm):
    rs = _backward(gm, Kind.REDUCE_SCATTER)[0]
    x, _, n, group = rs.args
    with gm.graph.inserting_before(rs):
        ar = gm.graph.call_function(c10d.all_reduce.default, (x, "sum", group))
        ar.meta.update(val=x.meta["val"], custom=rs.meta.get("custom"))
        waited = gm.graph.call_function(WAIT, (ar,))
        waited.meta["val"] = x.meta["val"]
        piece = gm.graph.call_function(torch.ops.aten.slice.Tensor, (waited, 0, 0, x.meta["val"].shape[0] // n))
        piece.meta["val"] = _waited(rs).meta["val"]
    _waited(rs).replace_all_uses_with(piece)
    gm.graph.erase_node(_waited(rs))
    gm.graph.erase_node(rs)
    return ar.name


MUTATIONS = {
    "drop a reduction": (drop_a_reduction, False, r"was dropped"),
    "swap a partner": (swap_a_partner, False, r"changed: readers"),
    "wrong kind": (wrong_kind, False, r"changed: kind all_reduce -> all_gather"),
    "wrong group": (wrong_group, False, r"changed: group"),
    "wrong mesh dim": (wrong_mesh_dim, True, r"changed: group"),
    "extra collective": (extra_collective, False, r"is extra"),
    "reorder within a group": (reorder_within_a_group, False, r"was reordered"),
    "all_reduce where a reduce_scatter belongs": (all_reduce_where_a_reduce_scatter_belongs, False, r"is extra"),
}


_TRACED: dict[bool, tuple[fx.GraphModule, PassContext]] = {}


def traced(two_d: bool) -> tuple[fx.GraphModule, PassContext]:
    """The stack's joint graph and pass context right after the collective rewrites (traced once)."""
    if two_d not in _TRACED:
        rewrite = collective_rewrites.CollectiveRewritePass.run

        def keep(self, gm, ctx):
            result = rewrite(self, gm, ctx)
            _TRACED.setdefault(two_d, (copy.deepcopy(gm), ctx))
            return result

        collective_rewrites.CollectiveRewritePass.run = keep
        try:
            compile_stack(two_d=two_d)
        finally:
            collective_rewrites.CollectiveRewritePass.run = rewrite
    gm, ctx = _TRACED[two_d]
    return copy.deepcopy(gm), ctx


@pytest.mark.filterwarnings("ignore::FutureWarning")  # deepcopy of the graph's pytree specs
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_strict_mode_names_the_node_a_mutation_broke(fake_pg, mutation):
    """A pass after tracing that breaks the backward (as if the collective rewrites had) is caught."""
    mutate, two_d, what = MUTATIONS[mutation]
    gm, ctx = traced(two_d)
    BackwardKeptPass().run(copy.deepcopy(gm), ctx)  # the control: unbroken, it passes
    broken = mutate(gm)
    gm.graph.lint()
    with pytest.raises(hca.CheckError, match=r"backward check") as caught:
        BackwardKeptPass().run(gm, ctx)
    assert re.search(rf"{broken}\b[^;]*{what}", str(caught.value)), str(caught.value)
