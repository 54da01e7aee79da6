"""Uneven shares: each rank runs the even program of its own rows, and what that cannot run.

DTensor keeps no per-rank sizes: a ``Shard`` is even. So a forward argument cut
by shares (``hca.Shard(0, shares=(1, 3))``, docs/heterogeneous.md) enters the
logical program as ``n`` times this rank's piece, its batch dimension symbolic
(the sharded module marks it dynamic), and every rank traces one program: the
even program of its own rows. That program is exact for everything that reads
rows one by one, and for sums over rows (each rank's partial sum is its share
of the whole). A mean over the rows is a partial mean DTensor would average
over the ranks; `weight_partial_means` makes each explicit one the weighted sum
it is (`dtensor_ops.weighted_sum`: the move table's weighted all-reduce). What
reads the whole's size otherwise, a gather of the uneven pieces, a mean moved
inside another op (an ``avg`` all-reduce left), the batch size computed with
(``loss / x.shape[0]``), the checks here find in the graphs and refuse by
name. The gradients of a mean the ranks take *outside* the module are weighted
by each rank's share too (`torch_hca.api.plan`, ``loss_reduction="mean"``).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from torch_hca.compiler.layout.candidates import source_line
from torch_hca.compiler.logical import ENTER, decode_shares, mesh_of
from torch_hca.errors import UnsupportedError
from torch_hca.spmd.collective_nodes import OPS, node_group

# Ops that read a symbolic size only as a size: the program's shapes follow it, not its values.
SIZE_METHODS = {
    "view",
    "reshape",
    "expand",
    "new_empty",
    "new_zeros",
    "new_ones",
    "unflatten",
    "flatten",
    "size",
    "repeat",
    "expand_as",
    "view_as",
    "reshape_as",
}
# ``arange`` too: its values index the rows of the program's own whole (HF builds masks from
# ``arange(batch)``), and indexing a piece of another rank's rows would gather, which
# `check_forward_collectives` refuses.
SIZE_FUNCTIONS = {ENTER, torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn, torch.reshape, torch.arange}


@dataclass(frozen=True)
class UnevenShares:
    """A graph's uneven dimension: the mesh dim, its shares, and this rank's place among them."""

    mesh_dim: int
    shares: tuple[int, ...]
    coordinate: int  # this rank's coordinate on `mesh_dim`
    group: str  # the process group of `mesh_dim`, as collective nodes name it

    @property
    def text(self) -> str:
        return ":".join(map(str, self.shares))


def uneven_shares(gm: fx.GraphModule) -> UnevenShares | None:
    """The shares the graph's forward arguments are cut by (None: every piece even)."""
    found = set()
    for node in gm.graph.find_nodes(op="call_function", target=ENTER):
        for mesh_dim, shares in enumerate(decode_shares(node.args[1])):
            if shares is not None:
                found.add((mesh_dim, shares, node.args[3]))
    if not found:
        return None
    if len({(d, s) for d, s, _ in found}) > 1:
        raise UnsupportedError(
            f"uneven shares: the forward arguments are cut by different shares {sorted((d, s) for d, s, _ in found)}; "
            "cut every argument by the same shares on the same mesh dim"
        )
    mesh_dim, shares, index = found.pop()
    mesh = mesh_of(index)
    return UnevenShares(mesh_dim, shares, mesh.get_coordinate()[mesh_dim], mesh.get_group(mesh_dim).group_name)


def drop_whole_slices(gm: fx.GraphModule) -> None:
    """Rewrite indexing that keeps every element: ``x[:, 0:, :]`` (HF's ``logits_to_keep=0``) is
    ``x``, ``x[:, :, None]`` (GQA's ``repeat_kv``) an ``unsqueeze``.

    Under a symbolic batch DTensor cannot tell that ``:`` covers the whole dimension and
    gathers the batch for it; the unsqueeze it places without communication."""
    for node in list(gm.graph.find_nodes(op="call_function", target=operator.getitem)):
        source, index = node.args
        index = index if isinstance(index, tuple) else (index,)
        whole = all(
            i is None or isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step in (None, 1)
            for i in index
        )
        if not (
            isinstance(source, fx.Node)
            and isinstance(source.meta.get("example_value"), torch.Tensor)
            and index
            and whole
        ):
            continue
        value = source
        with gm.graph.inserting_before(node):
            for position, i in enumerate(index):
                if i is None:
                    value = gm.graph.call_function(torch.unsqueeze, (value, position))
                    value.meta.update({k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
    gm.recompile()


def _symbolic(value) -> bool:
    """A symbolic size, or sizes (``x.size()[:-1] + (n,)``) holding one."""
    if isinstance(value, (tuple, list)):
        return any(_symbolic(v) for v in value)
    return isinstance(value, torch.SymInt)


def check_sizes_only_shape(gm: fx.GraphModule) -> None:
    """The symbolic batch size (this rank's rows times n) is read only as a shape, never as a number."""
    symbolic = {n for n in gm.graph.nodes if _symbolic(n.meta.get("example_value"))}
    for node in symbolic:
        for user in node.users:
            if (
                user in symbolic
                or user.target in SIZE_FUNCTIONS
                or (user.op == "call_method" and user.target in SIZE_METHODS)
            ):
                continue
            raise UnsupportedError(
                f"uneven shares: {user.name} computes with the size of the unevenly cut dimension "
                f"(source: {source_line(user)}); under shares each rank traces n times its own rows, so the "
                "number is not the whole's. Reduce with .sum() and divide outside the module, or return "
                "per-row results and take the mean outside (loss_reduction='mean' weights it by the shares)"
            )


def check_forward_collectives(forward: fx.GraphModule, uneven: UnevenShares) -> None:
    """Over the uneven mesh dim, the forward only sums (an all-reduce of a partial sum is exact at any shares)."""
    for node in forward.graph.nodes:
        if node.target not in OPS or node_group(node) != uneven.group:
            continue
        kind = OPS[node.target].kind.value
        op = node.args[1] if kind == "all_reduce" and len(node.args) > 1 else None
        if kind == "all_reduce" and op == "sum":
            continue
        what = f"an all_reduce({op})" if kind == "all_reduce" else f"a {kind}"
        raise UnsupportedError(
            f"uneven shares {uneven.text} on mesh dim {uneven.mesh_dim}: the forward has {what} ({node.name}) over "
            "the uneven ranks, which needs the whole's size (a mean over the batch, or a gather of the pieces): "
            "not supported yet. Keep the batch split to the end: return per-row results (or a sum over rows) and "
            "take the mean outside the module with loss_reduction='mean'"
        )


def weight_partial_means(gm: fx.GraphModule, uneven: UnevenShares) -> list[str]:
    """Before each explicit move of a partial mean over the uneven ranks to a whole value, make it
    the weighted partial sum it is (`dtensor_ops.weighted_sum`); the names of the values weighted.

    The laid-out DTensor program: each node's example value carries its placements. A mean
    DTensor moves implicitly (inside another op) stays an ``avg`` all-reduce, which
    `check_forward_collectives` refuses."""
    from torch_hca.compiler import dtensor_ops

    weight = uneven.shares[uneven.coordinate] / sum(uneven.shares)
    weighted = []
    for node in list(gm.graph.nodes):
        value = node.meta.get("example_value")
        if not isinstance(value, DTensor) or not _is_mean(value.placements[uneven.mesh_dim]):
            continue
        movers = [
            u
            for u in node.users
            if u.target in (dtensor_ops.to_output, dtensor_ops.redistribute)
            and not _is_mean(u.args[1][uneven.mesh_dim])
        ]
        if not movers:
            continue
        with gm.graph.inserting_after(node):
            summed = gm.graph.call_function(dtensor_ops.weighted_sum, (node, uneven.mesh_dim, weight))
        summed.meta.update(node.meta)
        summed.meta.pop("hca_layout", None)  # the mean's layout (Partial avg); the sum's is its example value's
        summed.meta["example_value"] = dtensor_ops.weighted_sum(value, uneven.mesh_dim, weight)
        for mover in movers:
            mover.replace_input_with(node, summed)
        weighted.append(node.name)
    gm.recompile()
    return weighted


def _is_mean(p) -> bool:
    return p.is_partial() and getattr(p, "reduce_op", None) == "avg"


def uneven_options(options):
    """`options` for a graph cut by shares: the layout as written (the batch stays split: the solver's
    other layouts would gather it), no refinement check (it runs the whole program, whose sizes no rank
    traced). A strategy file still applies: the layout pass checks its shares are these."""
    return dataclasses.replace(options, layout="dtensor", check=False)
