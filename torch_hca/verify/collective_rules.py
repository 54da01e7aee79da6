"""The verifier's rules on a graph's collectives: kinds and groups, wire bytes, transpose pairs,
what the backward owes and that nothing owed is missing, what the program issues and in which order.

Like `torch_hca.verify.rules`, each reads the strategy file alone and yields `Problem`s.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from torch_hca.spmd.collective_kinds import RULES, Kind, backward_kinds, bytes_per_rank

from .rules import Graph, Problem, dim_groups, kind_of, letter


def collectives(G: Graph) -> Iterator[Problem]:
    """Each collective: its group and mesh dim, its wire bytes, its transpose partner, why backward owes it."""
    for cid, c in G.collectives.items():
        where = f"{G.where}, collective {cid!r}"
        kind = kind_of(c.get("kind"))
        if kind is None:
            yield Problem(where, "collective kind", c.get("kind"), f"one of {sorted(k.value for k in Kind)}")
            continue
        group = G.g["groups"].get(c.get("group"))
        d = c.get("mesh_dim")
        if group is None or group.get("mesh_dim") != d or not isinstance(d, int) or not 0 <= d < len(G.sizes):
            yield Problem(
                where, "group", f"group {c.get('group')} on mesh dim {d}", "a group of the file on that mesh dim"
            )
            continue
        if c.get("group_size") != G.sizes[d]:
            yield Problem(where, "group", f"{c.get('group_size')} ranks", f"{G.sizes[d]} (mesh dim {d})")
        wire = bytes_per_rank(kind, c.get("bytes", 0), G.sizes[d])
        if not math.isclose(c.get("wire_bytes", -1), wire):
            yield Problem(where, "wire bytes", c.get("wire_bytes"), f"{wire} ({kind.value} of {c.get('bytes')} bytes)")
        partner = G.collectives.get(c.get("partner")) if c.get("partner") else None
        if c.get("partner") and (partner is None or partner.get("partner") != cid):
            yield Problem(where, "transpose pair", c.get("partner"), f"a collective naming {cid!r} as its partner")
        elif partner is not None and c.get("direction") == "backward":
            pk = kind_of(partner.get("kind"))
            allowed = {RULES[pk].transpose.value} if pk else set()
            if pk is Kind.ALL_GATHER:
                allowed.add("all_gather")  # gloo's all_to_all: all_gather and keep a piece, both ways
            if kind.value not in allowed:
                yield Problem(
                    where,
                    "transpose pair",
                    f"{kind.value} transposing {partner.get('kind')}",
                    f"{' or '.join(sorted(allowed))} (the table's transpose of {partner.get('kind')})",
                )
        if c.get("recomputes") is not None:
            yield from _recomputed(G, where, c)
        elif c.get("direction") == "backward":
            yield from _owed(G, where, c, kind, d)


def _recomputed(G: Graph, where: str, c: dict) -> Iterator[Problem]:
    """A backward collective that issues a forward one again (the partition recomputed it): the
    forward one is in the file, and this is the same collective (kind, group, bytes, origin)."""
    first = G.collectives.get(c["recomputes"])
    if first is None or first.get("direction") != "forward":
        yield Problem(where, "recomputed", c["recomputes"], "a forward collective of this graph")
        return
    for key in ("kind", "group", "bytes", "shape", "origin"):
        if c.get(key) != first.get(key):
            yield Problem(where, "recomputed", f"{key} {c.get(key)}", f"{first.get(key)}, as {c['recomputes']!r}")


def _owed(G: Graph, where: str, c: dict, kind: Kind, d: int) -> Iterator[Problem]:
    """A backward collective is one the move table lets its origin's backward issue on that mesh dim."""
    origin = c.get("origin")
    move = G.moves.get(origin)
    if move is not None:
        pairs = [(move["src"][d], move["dst"][d])]
    elif origin in G.values:
        v = G.values[origin]
        ins = [G.values[r]["placements"] for r in v.get("reads", []) if r in G.values] or [v["placements"]]
        pairs = [(i[d], v["placements"][d]) for i in ins]
    else:
        yield Problem(where, "cotangent reduction owed", f"origin {origin!r}", "a value or move of this graph")
        return
    owed = set().union(*(backward_kinds(letter(a), letter(b)) for a, b in pairs))
    if kind not in owed:
        yield Problem(
            where,
            "cotangent reduction owed",
            f"{kind.value} in the backward of {origin!r} {pairs}",
            f"one of {sorted(k.value for k in owed) or ['no collective']}",
        )


def _varies(G: Graph, name: str, d: int) -> bool:
    """Whether the cotangent of replicated value `name` surely differs per rank on mesh dim `d`:
    some reader writes a shard there (its cotangent comes back sharded, so this one is partial).
    Readers that stay replicated are not followed: "not sure" never raises a problem."""
    return any(
        name in v.get("reads", []) and (v.get("placements") or [""] * (d + 1))[d].startswith("S")
        for v in G.values.values()
    )


def owed(G: Graph) -> Iterator[Problem]:
    """Nothing owed is missing: a gathered value whose cotangent is surely partial has its backward
    transpose (S -> R forward owes P -> S back), and an eager-role parameter replicated over a mesh dim
    on which its gradient is surely partial has a cotangent reduction there."""
    for node, m in G.moves.items():
        for s in m.get("steps", []):
            d = s.get("mesh_dim")
            if (
                s.get("kind") == "all_gather"
                and (m.get("dst") or [])[d] == "R"
                and G.values.get(node, {}).get("requires_grad", True) is not False  # no cotangent, none owed
                and _varies(G, node, d)
                and s.get("backward") is None
            ):
                yield Problem(
                    f"{G.where}, move {node!r} of {m.get('value')!r}, mesh dim {d}",
                    "nothing owed is missing",
                    "no backward collective",
                    f"{RULES[Kind.ALL_GATHER].transpose.value}: its readers write "
                    f"shards on mesh dim {d}, so its cotangent is partial",
                )
    origins = {
        (c.get("origin"), c.get("mesh_dim"))
        for c in G.collectives.values()
        if c.get("direction") == "backward" and c.get("recomputes") is None  # a recomputation reduces nothing
    }
    for name, p in G.values.items():
        if p.get("kind") != "parameter" or p.get("cotangent_role") != "eager" or p.get("requires_grad") is False:
            continue
        # The parameter's read, and the eager-gradient reads the compiler marks with the same layout.
        reads = [name] + [
            n
            for n, v in G.values.items()
            if v.get("reads") == [name] and v.get("kind") == "op" and v.get("placements") == p.get("placements")
        ]
        for d, placement in enumerate(p.get("placements") or []):
            varying = [r for r in reads if _varies(G, r, d)]
            if placement == "R" and varying and not any((r, d) in origins for r in reads):
                yield Problem(
                    f"{G.where}, value {name!r} (parameter {p.get('parameter')!r}), mesh dim {d}",
                    "nothing owed is missing",
                    "no gradient reduction in the backward",
                    f"an all_reduce (eager role): {varying[0]!r} is read by an op that writes shards on "
                    f"mesh dim {d}, so the gradient is partial",
                )


def issued(G: Graph) -> Iterator[Problem]:
    """What the program issues: each collective once, alone or in a bucket of its own kind and group."""
    seen: dict[str, str] = {}
    for iid, i in G.issued.items():
        where = f"{G.where}, issued collective {iid!r}"
        kind = kind_of(i.get("kind"))
        members = [G.collectives.get(m) for m in i.get("members", [])]
        if kind is None or None in members or not members:
            yield Problem(
                where, "issued", f"{i.get('kind')} of {i.get('members')}", "a known kind of collectives of this graph"
            )
            continue
        for m in members:
            if seen.setdefault(m["id"], iid) != iid or m.get("issued_as") != iid:
                yield Problem(where, "issued once", f"{m['id']} issued as {m.get('issued_as')}", f"{iid} alone")
            for key in ("kind", "group", "direction"):
                if m.get(key) != i.get(key):
                    yield Problem(
                        where, "issued", f"member {m['id']} {key} {m.get(key)}", f"{i.get(key)} (the issue's)"
                    )
        total = sum(m.get("bytes", 0) for m in members)
        if i.get("bytes") != total:
            yield Problem(where, "bytes", i.get("bytes"), f"{total} (the sum of its {len(members)} collective(s))")
        yield from _bucket_cap(G, i, where, len(members), total)
        d = i.get("mesh_dim")
        if (
            isinstance(d, int)
            and 0 <= d < len(G.sizes)
            and not math.isclose(i.get("wire_bytes", -1), bytes_per_rank(kind, i.get("bytes", 0), G.sizes[d]))
        ):
            yield Problem(where, "wire bytes", i.get("wire_bytes"), bytes_per_rank(kind, i.get("bytes", 0), G.sizes[d]))
    for cid in G.collectives:
        if cid not in seen:
            yield Problem(
                f"{G.where}, collective {cid!r}", "issued once", "never issued", "issued alone or in a bucket"
            )


def _bucket_cap(G: Graph, i: dict, where: str, members: int, total: int) -> Iterator[Problem]:
    """A bucket (several collectives issued as one) is at most its direction's stated cap; one
    collective over the cap runs alone. A file written before ``schedule`` existed is not checked."""
    if "schedule" not in G.g or members < 2:
        return
    rules = (G.g["schedule"] or {}).get(i.get("direction"))
    cap = (rules or {}).get("bucket_cap_bytes")
    if rules is None:
        yield Problem(
            where,
            "bucket cap",
            f"a bucket of {members} collectives, {total} bytes",
            "collectives issued alone (the file states no schedule for this direction)",
        )
    elif cap is not None and total > cap:
        yield Problem(
            where,
            "bucket cap",
            f"a bucket of {members} collectives, {total} bytes",
            f"at most the {i.get('direction')} schedule's bucket cap ({cap} bytes)",
        )


def groups(G: Graph) -> Iterator[Problem]:
    """Each group: its ranks follow from the mesh; its order (the same on every rank of the group:
    one SPMD program) is the program's issue order of that group's collectives."""
    for name, grp in G.g["groups"].items():
        where = f"{G.where}, group {name!r}"
        d = grp.get("mesh_dim")
        if _dim_ok(G, grp) and grp.get("participants") != dim_groups(G.data["mesh"]["ranks"], d):
            yield Problem(where, "participants", grp.get("participants"), dim_groups(G.data["mesh"]["ranks"], d))
        for direction in ("forward", "backward"):
            program = [iid for iid, c in G.issued.items() if c.get("group") == name and c.get("direction") == direction]
            order = grp.get(direction, [])
            if order != program:
                first = _first_difference(order, program)
                yield Problem(
                    f"{where}, {direction}",
                    "group order",
                    f"position {first}: {order[first] if first < len(order) else 'nothing'}",
                    f"{program[first] if first < len(program) else 'nothing'} (the program's issue order)",
                )
        yield from _rank_orders(G, name, grp, where)


def _first_difference(a: list, b: list) -> int:
    """The first position where two sequences differ (the shorter's length where one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _dim_ok(G: Graph, grp: dict) -> bool:
    d = grp.get("mesh_dim")
    return isinstance(d, int) and 0 <= d < len(G.sizes)


def _kind_and_bytes(posted: str, n: int) -> tuple[str, int | None]:
    """A posted collective ("kind:dtype:shape", its result's) as (kind, payload bytes), the payload as
    the file counts it: the whole buffer, which a reduce_scatter's result is one n-th of."""
    kind, _, rest = posted.partition(":")
    total = 0
    for part in rest.split("+"):  # a collective of several results: each "dtype:shape"
        dtype, _, shape = part.partition(":")
        try:
            size = getattr(torch, dtype.removeprefix("torch.")).itemsize
            total += math.prod(int(x) for x in shape.strip("()").split(",") if x.strip()) * size
        except (AttributeError, TypeError, ValueError):
            return kind, None
    return kind, total * (n if kind == Kind.REDUCE_SCATTER.value else 1)


def _said(kind_bytes: tuple) -> str:
    return f"{kind_bytes[0]} of {kind_bytes[1]} bytes"


def _rank_orders(G: Graph, name: str, grp: dict, where: str) -> Iterator[Problem]:
    """The orders the group's ranks compiled (``ranks``, where the file has them): each rank is a
    member of the group, issues the group's collectives in the file's order (kind by kind), and
    all issue the same sequence, so that none waits in a collective its peers never start."""
    ranks = grp.get("ranks")
    if not ranks:
        return
    members = {r for part in grp.get("participants") or [] for r in part}
    first_rank, first = None, None
    for rank, orders in ranks.items():
        at = f"{where}, rank {rank}"
        if members and not (rank.isdigit() and int(rank) in members):
            yield Problem(
                at, "per-rank order", f"an order for rank {rank}", f"orders of the group's ranks {sorted(members)}"
            )
            continue
        for direction in ("forward", "backward"):
            seq = list((orders or {}).get(direction) or [])
            n = G.sizes[grp["mesh_dim"]] if _dim_ok(G, grp) else 1
            said = [_kind_and_bytes(str(d), n) for d in seq]
            want = [
                (G.issued[i].get("kind"), G.issued[i].get("bytes")) for i in grp.get(direction, []) if i in G.issued
            ]
            if said != want:
                k = _first_difference(said, want)
                yield Problem(
                    f"{at}, {direction}",
                    "per-rank order",
                    f"collective #{k} is {seq[k] if k < len(seq) else 'nothing'}",
                    f"{_said(want[k]) if k < len(want) else 'nothing'} (the group's order)",
                )
        if first is None:
            first_rank, first = rank, orders
        elif orders != first:
            direction = next(d for d in ("forward", "backward") if (orders or {}).get(d) != (first or {}).get(d))
            mine, theirs = list((orders or {}).get(direction) or []), list((first or {}).get(direction) or [])
            k = _first_difference(mine, theirs)
            yield Problem(
                f"{at}, {direction}",
                "per-rank order",
                f"collective #{k} is {mine[k] if k < len(mine) else 'nothing'}",
                f"{theirs[k] if k < len(theirs) else 'nothing'}, as rank {first_rank} issues it (one order on every rank)",
            )


def in_flight(G: Graph) -> Iterator[Problem]:
    """At each start, the bytes started and not yet waited on stay within the direction's
    ``in_flight_bytes`` (a collective may start alone over it, nothing in flight). Replayed from
    each issued collective's ``start`` and ``last_wait`` (node indices of its graph); a file
    without them, or without a schedule, is not checked."""
    for direction in ("forward", "backward"):
        bound = ((G.g.get("schedule") or {}).get(direction) or {}).get("in_flight_bytes")
        placed = [i for i in G.g["issued"] if i.get("direction") == direction and i.get("start") is not None]
        if bound is None or not placed:
            continue
        for i in placed:
            held = [
                o for o in placed if o is not i and o["start"] < i["start"] and (o.get("last_wait") or -1) > i["start"]
            ]
            total = sum(o.get("bytes", 0) for o in held)
            if held and total + i.get("bytes", 0) > bound:
                yield Problem(
                    f"{G.where}, issued collective {i.get('id')!r}",
                    "in flight",
                    f"starts with {len(held)} collective(s) of {total} bytes in flight, {i.get('bytes')} more",
                    f"at most the {direction} schedule's in_flight_bytes ({bound} bytes) in flight at once",
                )
