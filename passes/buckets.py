"""Bucketing, the first half of the schedule pass: merge small collectives into flat ones.

Which collectives may merge (`candidates`):

* backward graph: ``all_reduce`` and ``reduce_scatter_tensor`` (gradient and
  cotangent reductions);
* forward graph: ``all_gather_into_tensor`` of a graph input, directly or
  through one-input ops such as views and casts (the weight all-gathers of
  sharded parameters).

Two merge only when they share a key: op, process group, reduce op, group
size, dtype and device. Each must be waited by exactly one ``wait_tensor``
and have static shapes and fake values in ``meta["val"]``.

Formation (`form_buckets`) walks the candidates in the order their inputs are
ready in the traced graph (the position of a collective's latest input, then
its name), one open bucket per key. A candidate joins the open bucket when
(1) the payload stays within the cap, (2) its input is not computed from a
member's result (else the merge is a cycle), and (3) its input is ready before
any member's result is first needed (the first consumer of its wait that is
not itself late, events.py; the graph output counts as the end). Rule (3) is
the choice made here: a merge never delays a consumer past where the traced
order already had it, so no overlap the traced order allowed is lost to a
bucket. Otherwise the bucket closes and the candidate opens a new one.
Buckets of one collective are not rewritten; in the backward graph each is moved
as a bucket is, its start right after its input, its wait directly after it
(`place_singles`): the transpose pass emits the gradient reductions at the end of
the graph, and a group issues its collectives in graph order, so a large
reduction left there would wait for the last bucket (on GPT-2 small every weight
gradient waited for the first block's biases, at the end of the backward). The
forward graph's weight gathers stay where they are: gathering every weight at the
start is the memory FSDP-style storage exists to save.

The rewrite (`merge`), per kind, for members ``x_i`` of shape ``s_i``, ``n``
the group size::

    all_reduce       x_i -view(-1)-> cat -all_reduce-> wait -split(m_i)-> view(s_i)
    reduce_scatter   x_i -view(n,-1)-> cat(dim 1) -view(-1)-> reduce_scatter -> wait
                       -split(m_i / n)-> view(s_i[0] / n, *s_i[1:])
    all_gather       x_i -view(-1)-> cat -all_gather-> wait -view(n, total)
                       -split(m_i, dim 1)-> clone -view(n * s_i[0], *s_i[1:])

(a non-contiguous ``x_i`` is cloned contiguous before its view). The merged
nodes are inserted right after the latest member input, the wait directly
after its start: the reordering that follows moves the wait late. Late nodes
that finish a member's result and sat before that point move after it. When
one candidate's input depends on another's result, buckets are merged one at
a time, each formed again on the graph the previous merge left. Every new
node carries ``meta["val"]`` (computed on the fake values under the graph's
fake mode) and ``meta["hca_bucket"]``, the names of the collectives merged.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from torch_hca._torch_private import fake_mode_of
from torch_hca.spmd.collective_nodes import OPS, WAIT, payload_bytes

from torch_hca.spmd.events import is_view, late_nodes, written
from .transpose import PARTNER, RULE

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKET = "hca_bucket"

ALL_REDUCE = c10d.all_reduce.default
ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
MERGEABLE = {"backward": (ALL_REDUCE, REDUCE_SCATTER), "forward": (ALL_GATHER,)}


@dataclass
class Member:
    coll: fx.Node
    wait: fx.Node
    key: tuple
    ready: int  # position of the latest input in the traced graph
    need: int  # position of the first consumer of the result
    nbytes: int  # payload bytes (collective_nodes.payload_bytes)
    bit: int = 0  # this candidate's bit
    upstream: int = 0  # bits of the candidates whose results its input is computed from


def _static_val(node: fx.Node) -> Any:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    ok = isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape)
    return val if ok else None


def _from_graph_input(node: fx.Node) -> bool:
    """`node` is a graph input, or comes from one through one-input, non-collective ops."""
    while node.op == "call_function" and node.target not in OPS and node.target is not WAIT:
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return node.op == "placeholder"


def _first_need(wait: fx.Node, pos: dict[fx.Node, int], late: dict[fx.Node, None]) -> int:
    """Position of the first consumer of `wait`'s result that is not itself late (events.py)."""
    need, frontier = len(pos), list(wait.users)
    while frontier:
        user = frontier.pop()
        if user.op == "output":
            continue
        if user in late:
            frontier.extend(user.users)
        else:
            need = min(need, pos[user])
    return need


def _key(coll: fx.Node, val: torch.Tensor) -> tuple:
    args = coll.args
    if coll.target is ALL_REDUCE:
        return ("all_reduce", str(args[2]), args[1], None, val.dtype, str(val.device))
    if coll.target is REDUCE_SCATTER:
        return ("reduce_scatter", str(args[3]), args[1], args[2], val.dtype, str(val.device))
    return ("all_gather", str(args[2]), None, args[1], val.dtype, str(val.device))


def candidates(graph: fx.Graph, which: str) -> list[Member]:
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    late = late_nodes(nodes)
    found = []
    for coll in nodes:
        if coll.op != "call_function" or coll.target not in MERGEABLE.get(which, ()):
            continue
        if len(coll.users) != 1 or next(iter(coll.users)).target is not WAIT or coll.kwargs or BUCKET in coll.meta:
            continue
        x = coll.args[0]
        if not isinstance(x, fx.Node) or _static_val(x) is None or _static_val(coll) is None:
            continue
        if coll.target is ALL_GATHER and not _from_graph_input(x):
            continue
        wait = next(iter(coll.users))
        nbytes = payload_bytes(coll)
        found.append(Member(coll, wait, _key(coll, x.meta["val"]), pos[x], _first_need(wait, pos, late), nbytes))
    _mark_upstream(nodes, found)
    return found


def _mark_upstream(nodes: list[fx.Node], members: list[Member]) -> None:
    """Set each candidate's `upstream`: which candidates' results its input depends on."""
    bits = {m.wait: 1 << i for i, m in enumerate(members)}
    up: dict[fx.Node, int] = {}
    for n in nodes:
        v = bits.get(n, 0)
        for a in n.all_input_nodes:
            v |= up.get(a, 0)
        if v:
            up[n] = v
    for m in members:
        m.bit, m.upstream = bits[m.wait], up.get(m.coll.args[0], 0)


def form_buckets(members: list[Member], cap_bytes: float) -> list[list[Member]]:
    """Greedy, in input-ready order, one open bucket per key (see the module docstring)."""
    open_: dict[tuple, list[Member]] = {}
    closed: list[list[Member]] = []
    for m in sorted(members, key=lambda m: (m.ready, m.coll.name)):
        bucket = open_.get(m.key)
        if bucket is not None:
            fits = sum(b.nbytes for b in bucket) + m.nbytes <= cap_bytes
            independent = not any(m.upstream & b.bit for b in bucket)  # else the merge is a cycle
            if fits and independent and m.ready < min(b.need for b in bucket):
                bucket.append(m)
                continue
            closed.append(bucket)
        open_[m.key] = [m]
    closed.extend(open_.values())
    merged = [b for b in closed if len(b) > 1 and sum(m.nbytes for m in b) <= cap_bytes]
    return sorted(merged, key=lambda b: (b[-1].ready, b[0].coll.name))


class _Builder:
    """Appends nodes after an anchor, each with its fake value and the bucket's names."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, mode, names: list[str]):
        self.graph, self.last, self.mode, self.names = graph, anchor, mode, names

    def __call__(self, target, *args, name: str | None = None, **kwargs) -> fx.Node:
        name = name or "bucket_" + getattr(target, "__name__", "op").split(".")[0]
        with self.graph.inserting_after(self.last):
            node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        self.last = node

        def val(a):
            if isinstance(a, fx.Node):
                return a.meta["val"]
            return [val(x) for x in a] if isinstance(a, (list, tuple)) else a

        with self.mode:
            node.meta["val"] = target(*val(list(args)), **kwargs)
        node.meta[BUCKET] = list(self.names)
        return node

    def contiguous(self, x: fx.Node) -> fx.Node:
        if x.meta["val"].is_contiguous():
            return x
        return self(aten.clone.default, x, memory_format=torch.contiguous_format)


def _split_back(b: _Builder, coll: fx.Node, sizes: list[int], members: list[Member]) -> list[fx.Node]:
    """The bucket's waited result cut into the members' results, each in its own shape."""
    parts = b(aten.split_with_sizes.default, b(WAIT, coll), sizes)
    return [
        b(aten.view.default, b(operator.getitem, parts, i), list(m.wait.meta["val"].shape))
        for i, m in enumerate(members)
    ]


def _merge_all_reduce(b: _Builder, members: list[Member]) -> tuple[fx.Node, list[fx.Node]]:
    first = members[0].coll
    flat = [b(aten.view.default, b.contiguous(m.coll.args[0]), [-1]) for m in members]
    cat = b(aten.cat.default, flat)
    coll = b(first.target, cat, *first.args[1:], name="bucket_all_reduce")
    return coll, _split_back(b, coll, [f.meta["val"].numel() for f in flat], members)


def _merge_reduce_scatter(b: _Builder, members: list[Member]) -> tuple[fx.Node, list[fx.Node]]:
    first = members[0].coll
    n = first.args[2]
    rows = [b(aten.view.default, b.contiguous(m.coll.args[0]), [n, -1]) for m in members]
    cat = b(aten.view.default, b(aten.cat.default, rows, 1), [-1])
    coll = b(first.target, cat, *first.args[1:], name="bucket_reduce_scatter")
    return coll, _split_back(b, coll, [r.meta["val"].shape[1] for r in rows], members)


def _merge_all_gather(b: _Builder, members: list[Member]) -> tuple[fx.Node, list[fx.Node]]:
    first = members[0].coll
    n = first.args[1]
    flat = [b(aten.view.default, b.contiguous(m.coll.args[0]), [-1]) for m in members]
    cat = b(aten.cat.default, flat)
    coll = b(first.target, cat, *first.args[1:], name="bucket_all_gather")
    sizes = [f.meta["val"].numel() for f in flat]
    table = b(aten.view.default, b(WAIT, coll), [n, sum(sizes)])  # row r: rank r's shards, side by side
    parts = b(aten.split_with_sizes.default, table, sizes, 1)
    outs = []
    for i, m in enumerate(members):
        piece = b(aten.clone.default, b(operator.getitem, parts, i), memory_format=torch.contiguous_format)
        outs.append(b(aten.view.default, piece, list(m.wait.meta["val"].shape)))
    return coll, outs


MERGE = {ALL_REDUCE: _merge_all_reduce, REDUCE_SCATTER: _merge_reduce_scatter, ALL_GATHER: _merge_all_gather}


def _anchor(
    graph: fx.Graph, members: list[Member], after: dict[fx.Node, fx.Node], late: dict[fx.Node, None]
) -> tuple[fx.Node, fx.Node]:
    """Where a bucket goes: after its latest member input (after the placeholders), and
    after any bucket already placed there, so buckets keep the order they formed in,
    unless that bucket already reads one of these members' results."""
    inputs = [m.coll.args[0] for m in members]
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    latest = max(inputs, key=pos.__getitem__)
    if latest.op == "placeholder":
        latest = [n for n in nodes if n.op == "placeholder"][-1]
    need = min(_first_need(m.wait, pos, late) for m in members)
    behind = after.get(latest, latest)
    return (behind if pos[behind] < need else latest), latest


def _late_descendants(bucket: list[Member], late: dict[fx.Node, None]) -> list[fx.Node]:
    """The late nodes computed from the members' results (events.py), in graph order."""
    found: dict[fx.Node, None] = {}
    frontier = [u for m in bucket for u in m.wait.users]
    while frontier:
        node = frontier.pop()
        if node in late and node not in found:
            found[node] = None
            frontier.extend(node.users)
    return [n for n in late if n in found]


def merge(
    graph: fx.Graph, bucket: list[Member], anchors: dict[fx.Node, fx.Node], mode, late: dict[fx.Node, None]
) -> fx.Node:
    """Rewrite one bucket into one collective under the graph's fake mode; returns it.

    What only finishes a member's result (views, chunks, copies: late nodes) may
    sit before the bucket in the traced graph; it moves to just after it.
    """
    anchor, latest = _anchor(graph, bucket, anchors, late)
    finishing = _late_descendants(bucket, late)
    b = _Builder(graph, anchor, mode, [m.coll.name for m in bucket])
    coll, outs = MERGE[bucket[0].coll.target](b, bucket)
    anchors[latest] = b.last
    rules = list(dict.fromkeys(m.coll.meta.get(RULE, "") for m in bucket))
    coll.meta[RULE] = f"bucket of {len(bucket)}: " + "; ".join(r for r in rules if r)
    partners = [m.coll.meta[PARTNER] for m in bucket if m.coll.meta.get(PARTNER)]
    if partners:
        coll.meta[PARTNER] = ", ".join(partners)
    for m, out in zip(bucket, outs):
        m.wait.replace_all_uses_with(out)
        graph.erase_node(m.wait)
        graph.erase_node(m.coll)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    end = pos[b.last]
    for node in finishing:
        if pos[node] < end:
            b.last.append(node)
            b.last = anchors[latest] = node
    return coll


def root_of(node: fx.Node) -> fx.Node:
    """The buffer a chain of views reads."""
    while is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def bucket_collectives(graph: fx.Graph, which: str, cap_bytes: float) -> list[dict[str, Any]]:
    """Merge the collectives of `graph` into buckets of at most `cap_bytes`; what was merged.

    A merge moves its members' results to where the bucket sits; when one
    candidate's input depends on another's result, that can change where the
    other is first needed, so buckets are then merged one at a time, each
    formed on the graph the previous merges left.
    """
    anchors: dict[fx.Node, fx.Node] = {}
    done = []
    while True:
        members = candidates(graph, which)
        buckets = form_buckets(members, cap_bytes)
        mode = fake_mode_of([m.coll.meta["val"] for m in members])
        late = late_nodes(list(graph.nodes))
        if mode is None:  # no fake mode: never run a collective to learn a shape
            return done
        if not buckets:
            break
        chained = any(m.upstream for m in members)
        for bucket in buckets[:1] if chained else buckets:
            members_bytes = [[m.coll.name, m.nbytes] for m in bucket]
            coll = merge(graph, bucket, anchors, mode, late)
            done.append(
                {
                    "collective": coll.name,
                    "kind": bucket[0].key[0],
                    "group": bucket[0].key[1],
                    "bytes": sum(nb for _, nb in members_bytes),
                    "members": members_bytes,
                }
            )
        if not chained:
            break
    if which == "backward":
        place_singles(graph, which, anchors)
    return done


def place_singles(graph: fx.Graph, which: str, anchors: dict[fx.Node, fx.Node]) -> None:
    """Move each candidate left unbucketed right after its input (after the buckets already
    placed there), its wait directly after it, in input-ready order, as `merge` places a bucket.
    A candidate whose input some node writes in place keeps its place."""
    nodes = list(graph.nodes)
    written_roots = {root_of(w) for n in nodes for w in written(n)}
    late = late_nodes(nodes)
    for m in sorted(candidates(graph, which), key=lambda m: (m.ready, m.coll.name)):
        if root_of(m.coll.args[0]) in written_roots:
            continue
        anchor, latest = _anchor(graph, [m], anchors, late)
        anchor.append(m.coll)
        m.coll.append(m.wait)
        anchors[latest] = m.wait
