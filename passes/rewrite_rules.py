"""The collective rewrite rules: identities that replace chains of collectives by cheaper programs.

Reads the joint graph (local tensors, `_c10d_functional` ops, each collective
read only through its `wait_tensor`, functional: no op writes an
intermediate). Each rule is named after the identity that justifies it; with
r this rank's coordinate along the op's group, n the group's size and
shard_k(x) the k-th of n equal pieces of x along one dimension:

    reduce_scatter_of_all_reduce     shard_r(all_reduce x)                  = reduce_scatter x
    local_shard_of_all_gather        shard_r(all_gather x)                  = x
    all_to_all_round_trip            all_to_all(b->a)(all_to_all(a->b) x)   = x
    all_reduce_of_gathered_scatter   all_gather(reduce_scatter x)           = all_reduce x
    all_reduce_of_sum                all_reduce a + all_reduce b            = all_reduce (a + b)
    piece_of_cat (local)             shard_k(cat(x_0, ..., x_{n-1}))        = x_k

A rule is a small function keyed by the OpOverload its pattern starts from;
it returns a `Match` (the nodes it matched and how to build the replacement)
or None. Each removes a collective or replaces it by a cheaper one (the local
rule only exposes such chains); a rewrite that would leave the collective in
place for another use is not made. The driver
(`torch_hca.passes.collective_rewrites`) runs them to a fixed point; a rule marked
``rank_dependent`` reads something particular to this rank, and the driver applies its
matches only where every rank found them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map_only

from torch_hca._torch_private import group_rank, group_size
from torch_hca.spmd.collective_nodes import WAIT
from torch_hca.errors import CheckError


REWRITE = "hca_rewrite"  # node.meta key on every node a rewrite made: the identity it used
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


@dataclass(frozen=True)
class Piece:
    """`node` is piece `index` of `pieces` equal pieces of `source` along `dim`."""

    node: fx.Node
    source: fx.Node
    dim: int
    index: int
    pieces: int


@dataclass(frozen=True)
class Match:
    nodes: tuple[fx.Node, ...]  # what the rule matched
    build: Callable[["Builder"], dict[fx.Node, fx.Node]]  # makes the new nodes: old -> replacement


@dataclass(frozen=True)
class Rule:
    name: str
    identity: str
    fn: Callable[[fx.Node], Match | None]
    rank_dependent: bool


RULES: dict[torch._ops.OpOverload, list[Rule]] = {}


def rule(op: torch._ops.OpOverload, identity: str, rank_dependent: bool = False):
    def register(fn):
        if any(r.name == fn.__name__ for rules in RULES.values() for r in rules):
            raise CheckError(f"collective rewrite rule {fn.__name__!r} registered twice")
        RULES.setdefault(op, []).append(Rule(fn.__name__, identity, fn, rank_dependent))
        return fn

    return register


# ---------------------------------------------------------------- reading the graph


def _shape(node) -> tuple[int, ...] | None:
    """The static shape of a tensor node; None when unknown or symbolic."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(type(s) is int for s in val.shape):
        return None
    return tuple(val.shape)


def _ints(sizes) -> list[int] | None:
    """Split sizes, when all are known (not symbolic)."""
    return list(sizes) if all(type(s) is int for s in sizes) else None


def _arg(node: fx.Node, i: int, name: str, default):
    return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)


def _users(node: fx.Node) -> list[fx.Node]:
    # A traced split names every piece; the unused ones are dead, not uses.
    return [u for u in node.users if u.users or u.target is not operator.getitem]


def _sole_user(node: fx.Node | None, target=None) -> fx.Node | None:
    users = _users(node) if isinstance(node, fx.Node) else []
    return users[0] if len(users) == 1 and target in (None, users[0].target) else None


def _waited(node, op) -> fx.Node | None:
    """The `op` collective whose only use is the wait `node`."""
    coll = node.args[0] if isinstance(node, fx.Node) and node.target is WAIT else None
    return coll if isinstance(coll, fx.Node) and coll.target is op and _sole_user(coll) is node else None


def piece(node: fx.Node | None) -> Piece | None:
    """Read `node` as an even piece of another value: split(x, s, d)[k] or x[.., k*s:(k+1)*s, ..]."""
    if node is None or node.op != "call_function":
        return None
    if node.target is operator.getitem and getattr(node.args[0], "target", None) in _SPLITS:
        split, index = node.args
        source, size, dim = split.args[0], split.args[1], _arg(split, 2, "dim", 0)
        if split.target is aten.split_with_sizes.default:
            size = size[0] if len(set(size)) == 1 else None
        if type(size) is not int or type(index) is not int:
            return None
        start, end, step = index * size, (index + 1) * size, 1
    elif node.target is aten.slice.Tensor:
        source, dim = node.args[0], _arg(node, 1, "dim", 0)
        start, end, step = _arg(node, 2, "start", None), _arg(node, 3, "end", None), _arg(node, 4, "step", 1)
    else:
        return None
    shape = _shape(source)
    if (
        shape is None
        or type(dim) is not int
        or step != 1
        or not all(type(v) in (int, type(None)) for v in (start, end))
    ):
        return None
    dim %= len(shape)
    start, end, _ = slice(start, end).indices(shape[dim])
    length = end - start
    if length <= 0 or shape[dim] % length or start % length:
        return None  # uneven, or not on a piece boundary
    return Piece(node, source, dim, start // length, shape[dim] // length)


def _uses(value: fx.Node | None) -> list[fx.Node]:
    """The uses of `value`, looking through a split to the pieces taken from it."""
    users = _users(value) if value is not None else []
    return [t for u in users for t in (_users(u) if u.target in _SPLITS else [u])]


def _pieces(value: fx.Node) -> list[Piece | None]:
    """Each use of `value` read as a piece of it; None for a use that is not one."""
    return [p if p is not None and p.source is value else None for p in map(piece, _uses(value))]


def _own(p: Piece | None, n: int, group) -> bool:
    """`p` is this rank's piece of a value laid out over `group`."""
    return p is not None and p.pieces == n and p.index == group_rank(group)


# ---------------------------------------------------------------- the rules


# all_reduce: P -> R. Its sum's own shard is what reduce_scatter (P -> S) computes, at half the wire bytes.
@rule(c10d.all_reduce.default, "shard_r(all_reduce x) = reduce_scatter x", rank_dependent=True)
def reduce_scatter_of_all_reduce(ar: fx.Node) -> Match | None:
    x, op, group = ar.args[:3]
    wait = _sole_user(ar, WAIT)
    pieces = _pieces(wait) if wait is not None else []
    p, n = pieces[0] if len(pieces) == 1 else None, group_size(group)
    if not _own(p, n, group):
        return None  # the whole sum is needed too, or this is not this rank's piece of it

    def build(b: Builder) -> dict[fx.Node, fx.Node]:
        src = x
        if p.dim != 0:  # reduce_scatter scatters dim 0: stack the pieces along it first (as funcol does)
            split = b(ar, aten.split.Tensor, x, _shape(x)[p.dim] // n, p.dim)
            src = b(ar, aten.cat.default, [b(ar, operator.getitem, split, k) for k in range(n)], 0)
        rs = b(ar, c10d.reduce_scatter_tensor.default, src, op, n, group)
        return {p.node: b(wait, WAIT, rs)}

    return Match((ar, wait, p.node), build)


# all_gather: S(0) -> R. Piece r of the gathered value is this rank's input, unchanged.
@rule(c10d.all_gather_into_tensor.default, "shard_r(all_gather x) = x", rank_dependent=True)
def local_shard_of_all_gather(ag: fx.Node) -> Match | None:
    x, n, group = ag.args[:3]
    wait = _sole_user(ag, WAIT)
    own = _pieces(wait) if wait is not None else []
    if not own or not all(_own(p, n, group) and p.dim == 0 for p in own):
        return None  # another use needs the gathered value: the gather stays, nothing to gain
    return Match((ag, wait, *(p.node for p in own)), lambda b: {p.node: x for p in own})


# all_to_all: S(a) -> S(b). Sending back what was received, with the split sizes swapped, restores the input.
# Rank dependent: with uneven splits the sizes can swap on one rank and not on another.
@rule(c10d.all_to_all_single.default, "all_to_all(b->a)(all_to_all(a->b) x) = x", rank_dependent=True)
def all_to_all_round_trip(there: fx.Node) -> Match | None:
    x, out_sizes, in_sizes, group = there.args[:4]
    wait = _sole_user(there, WAIT)
    back = [
        (u, _sole_user(u, WAIT))
        for u in (_users(wait) if wait is not None else [])
        if u.target is there.target
        and u.args[0] is wait
        and u.args[3] == group
        and _ints(u.args[1]) == _ints(in_sizes) is not None
        and _ints(u.args[2]) == _ints(out_sizes) is not None
    ]
    back = [(u, w) for u, w in back if w is not None]
    if not back:
        return None
    return Match((there, wait, *(n for pair in back for n in pair)), lambda b: {w: x for _, w in back})


# reduce_scatter then all_gather: P -> S(0) -> R is P -> R, one collective instead of two.
@rule(c10d.reduce_scatter_tensor.default, "all_gather(reduce_scatter x) = all_reduce x")
def all_reduce_of_gathered_scatter(rs: fx.Node) -> Match | None:
    x, op, n, group = rs.args[:4]
    wait = _sole_user(rs, WAIT)
    ag = _sole_user(wait, c10d.all_gather_into_tensor.default)
    ag_wait = _sole_user(ag, WAIT)
    if ag_wait is None or tuple(ag.args[1:3]) != (n, group):
        return None

    def build(b: Builder) -> dict[fx.Node, fx.Node]:
        ar = b(rs, c10d.all_reduce.default, x, op, group)
        return {ag_wait: b(ag_wait, WAIT, ar)}

    return Match((rs, wait, ag, ag_wait), build)


_LINEAR = ("sum", "avg")  # reductions that commute with addition


# all_reduce is linear: summing after reducing equals reducing the sum, one collective instead of two.
@rule(aten.add.Tensor, "all_reduce a + all_reduce b = all_reduce (a + b)")
def all_reduce_of_sum(add: fx.Node) -> Match | None:
    if len(add.args) != 2 or add.args[0] is add.args[1]:
        return None
    ars = [_waited(v, c10d.all_reduce.default) for v in add.args]
    if None in ars or any(_sole_user(w) is not add for w in add.args):
        return None
    (a, op, group), (c, op_c, group_c) = ars[0].args[:3], ars[1].args[:3]
    if (op, group) != (op_c, group_c) or op not in _LINEAR or _shape(a) is None:
        return None
    if _shape(a) != _shape(c) or a.meta["val"].dtype != c.meta["val"].dtype:
        return None  # broadcasting would grow the payload; promotion would change the precision

    def build(b: Builder) -> dict[fx.Node, fx.Node]:
        total = b(add, aten.add.Tensor, a, c, **add.kwargs)
        return {add: b(add, WAIT, b(add, c10d.all_reduce.default, total, op, group))}

    return Match((*ars, *add.args, add), build)


# Local: the k-th of n equal pieces of a cat of n equal parts is part k. Lets the rules above see
# through the chunk/cat funcol wraps around all_gather along a dimension other than 0.
@rule(aten.cat.default, "shard_k(cat(x_0, ..., x_{n-1})) = x_k")
def piece_of_cat(cat: fx.Node) -> Match | None:
    parts, dim = cat.args[0], _arg(cat, 1, "dim", 0)
    shapes = [_shape(v) for v in parts]
    if not shapes or None in shapes or len({s[dim % len(s)] for s in shapes}) != 1:
        return None
    hits = [p for p in _pieces(cat) if p is not None and p.dim == dim % len(shapes[0]) and p.pieces == len(parts)]
    if not hits:
        return None
    return Match((cat, *(p.node for p in hits)), lambda b: {p.node: parts[p.index] for p in hits})


class Builder:
    """Inserts the nodes a rule makes and gives each its ``meta["val"]`` by fake propagation."""

    def __init__(self, graph: fx.Graph, mode, rule: Rule, origin: fx.Node):
        self.graph, self.mode, self.rule, self.origin = graph, mode, rule, origin
        self.made: list[fx.Node] = []

    def __call__(self, before: fx.Node, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs)
        vals, kw = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        if target is operator.getitem:
            node.meta["val"] = vals[0][vals[1]]
        else:
            with self.mode:
                vals, kw = tree_map_only(torch.Tensor, self._in_mode, (vals, kw))
                node.meta["val"] = target(*vals, **kw)
        node.meta[REWRITE] = self.rule.identity
        for key in ("stack_trace", "custom"):  # "custom" holds the origin tag the transpose pass reads
            if key in self.origin.meta:
                node.meta[key] = self.origin.meta[key]
        self.made.append(node)
        return node

    def _in_mode(self, v: torch.Tensor) -> torch.Tensor:
        # make_fx (real mode) records each value under a fake mode of its own; ops cannot mix them.
        if getattr(v, "fake_mode", None) is self.mode:
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
