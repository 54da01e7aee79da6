"""The verifier's rules: each reads the strategy file alone and names what it finds wrong.

Independent of the code that wrote the file: this room imports only torch, the spmd
algebra (the move table, the transposes, the wire bytes) and the errors. A rule returns
`Problem`s; `torch_hca.verify.verify` runs them all.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from torch_hca.spmd.collective_kinds import RULES, Kind, backward_kinds, bytes_per_rank, move_kind

SCHEMA, VERSION = "torch_hca.strategy", 1
_PLACEMENT = re.compile(r"S\((\d+)\)|R|P\((\w+)\)")


@dataclass(frozen=True)
class Problem:
    """What is wrong: where (graph, value), by which rule, what the file says, what it should say."""

    where: str
    rule: str
    says: Any
    should: Any

    def __str__(self) -> str:
        return f"{self.where}: rule '{self.rule}': the file says {self.says}, it should be {self.should}"


def letter(p: str) -> str:
    """A placement as the move table reads it: R, P or S<d>."""
    return "R" if p == "R" else ("P" if p.startswith("P") else "S" + p[2:-1])


def _kind(name: Any) -> Kind | None:
    try:
        return Kind(name)
    except ValueError:
        return None


def dim_groups(ranks: Any, dim: int) -> list[list[int]]:
    t = torch.tensor(ranks)
    return t.movedim(dim, -1).reshape(-1, t.shape[dim]).tolist()


# ----------------------------------------------------------------------------- the file as a whole

def structure(data: Any) -> list[Problem]:
    """Schema and version, the fields every later rule reads."""
    if not isinstance(data, dict):
        return [Problem("file", "schema", type(data).__name__, "a JSON object")]
    if data.get("schema") != SCHEMA:
        return [Problem("file", "schema", data.get("schema"), SCHEMA)]
    if data.get("version") != VERSION:
        return [Problem("file", "schema version", data.get("version"), f"{VERSION} (the only version this verifier reads)")]
    need = {"mesh": dict, "world_size": int, "model": dict, "graphs": list}
    bad = [Problem("file", "schema", f"{k}: {type(data.get(k)).__name__}", t.__name__)
           for k, t in need.items() if not isinstance(data.get(k), t)]
    for i, g in enumerate(data.get("graphs") or []):
        for k in ("values", "moves", "collectives", "issued", "groups", "outputs"):
            if not isinstance(g, dict) or k not in g:
                bad.append(Problem(f"graph {i}", "schema", f"no '{k}'", f"a '{k}' field"))
    return bad


def mesh_and_model(data: dict) -> list[Problem]:
    mesh, problems = data["mesh"], []
    shape = list(mesh.get("shape") or [])
    if math.prod(shape) != data["world_size"]:
        problems.append(Problem("mesh", "world size", f"world_size {data['world_size']}",
                                f"{math.prod(shape)} (the product of mesh shape {shape})"))
    ranks = mesh.get("ranks")
    try:
        t = torch.tensor(ranks)
        if list(t.shape) != shape or sorted(t.flatten().tolist()) != list(range(math.prod(shape))):
            problems.append(Problem("mesh", "mesh ranks", ranks, f"each rank 0..{math.prod(shape) - 1} once, shaped {shape}"))
    except (TypeError, ValueError, RuntimeError):
        problems.append(Problem("mesh", "mesh ranks", ranks, f"nested rank lists shaped {shape}"))
    model = data["model"]
    body = {k: v for k, v in model.items() if k != "digest"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]
    if model.get("digest") != digest:
        problems.append(Problem("model", "model digest", model.get("digest"),
                                f"{digest} (the digest of the model section: stale or hand-edited)"))
    return problems


# ----------------------------------------------------------------------------- one graph

class Graph:
    """One graph of the file, with the mesh: what the rules look up."""

    def __init__(self, index: int, g: dict, data: dict):
        self.where = f"graph {index}"
        self.g, self.data = g, data
        self.sizes = list(data["mesh"]["shape"])
        self.values: dict[str, dict] = g["values"]
        self.moves = {m.get("node"): m for m in g["moves"]}
        self.collectives = {c.get("id"): c for c in g["collectives"]}
        self.issued = {c.get("id"): c for c in g["issued"]}

    def at(self, name: str) -> str:
        return f"{self.where}, value {name!r}"


def placements(G: Graph) -> Iterator[Problem]:
    """Every placement parses, one per mesh dim, and shards divide the logical shape evenly."""
    for name, v in G.values.items():
        ps, shape = v.get("placements"), v.get("shape") or []
        if not isinstance(ps, list) or len(ps) != len(G.sizes) or not all(
                isinstance(p, str) and _PLACEMENT.fullmatch(p) for p in ps):
            yield Problem(G.at(name), "placement", ps, f"one of R, S(d), P(sum) per mesh dim ({len(G.sizes)})")
            continue
        cuts: dict[int, int] = {}
        for m, p in enumerate(ps):
            if p.startswith("S"):
                d = int(p[2:-1])
                if d >= len(shape):
                    yield Problem(G.at(name), "shard dim", f"{p} on mesh dim {m}", f"a dim of its shape {shape}")
                    continue
                cuts[d] = cuts.get(d, 1) * G.sizes[m]
        for d, n in cuts.items():
            if shape[d] % n:
                yield Problem(G.at(name), "shard divides", f"shape {shape} split {n} ways on dim {d}",
                              f"a size divisible by {n} on dim {d}")


def parameters(G: Graph) -> Iterator[Problem]:
    """A parameter's value is stored as the model section says."""
    known = G.data["model"].get("parameters", {})
    for name, v in G.values.items():
        if v.get("kind") != "parameter":
            continue
        p = known.get(v.get("parameter"))
        if p is None:
            yield Problem(G.at(name), "parameter storage", v.get("parameter"), "a parameter of the model section")
        elif (p.get("placements"), p.get("shape")) != (v.get("placements"), v.get("shape")):
            yield Problem(G.at(name), "parameter storage", f"{v.get('placements')} {v.get('shape')}",
                          f"{p.get('placements')} {p.get('shape')} (model section, {v.get('parameter')})")


def partial_reduced(G: Graph) -> Iterator[Problem]:
    """A Partial value is reduced (by a move) before an op that is not itself partial reads it."""
    for name, v in G.values.items():
        if v.get("kind") in ("move", "parameter", "input"):
            continue
        for read in v.get("reads", []):
            u = G.values.get(read)
            if u is None:
                yield Problem(G.at(name), "reads", read, "a value of this graph")
                continue
            for m, (a, b) in enumerate(zip(u.get("placements") or [], v.get("placements") or [])):
                if a.startswith("P") and not b.startswith("P"):
                    yield Problem(G.at(name), "partial reduced before use",
                                  f"{v.get('op')} reads {read!r} as {a} on mesh dim {m} and writes {b}",
                                  f"a move reducing {read!r} ({a} -> R or S) before {name!r} reads it")


def moves(G: Graph) -> Iterator[Problem]:
    """Each move: from its value's placement to its own; per mesh dim the move table's step."""
    for node, m in G.moves.items():
        where = f"{G.where}, move {node!r} of {m.get('value')!r}"
        src, dst = m.get("src") or [], m.get("dst") or []
        value = G.values.get(m.get("value"))
        if value is None:
            yield Problem(where, "move source", m.get("value"), "a value of this graph")
            continue
        if value.get("placements") != src:
            yield Problem(where, "move source", src, f"{value.get('placements')} (the placement of {m.get('value')!r})")
        own = G.values.get(node)
        if own is not None and own.get("placements") != dst:
            yield Problem(where, "move destination", dst, f"{own.get('placements')} (the placement of {node!r})")
        for r in m.get("readers", []):
            if node not in (G.values.get(r) or {}).get("reads", [node]):
                yield Problem(where, "move readers", f"{r!r} reads it", f"{r!r} listing {node!r} among its reads")
        changed = [d for d, (a, b) in enumerate(zip(src, dst)) if a != b]
        steps = m.get("steps", [])
        if [s.get("mesh_dim") for s in steps] != changed:
            yield Problem(where, "move steps", [s.get("mesh_dim") for s in steps], f"one step per changed mesh dim {changed}")
            continue
        for s in steps:
            yield from _step(G, where, value, s)


def _step(G: Graph, where: str, value: dict, s: dict) -> Iterator[Problem]:
    d, a, b = s["mesh_dim"], s.get("src"), s.get("dst")
    where = f"{where}, mesh dim {d} ({a} -> {b})"
    kind = move_kind(letter(a), letter(b)) if a and b else None
    if s.get("kind") != (kind.value if kind else None):
        yield Problem(where, "move table", s.get("kind"), kind.value if kind else "no collective (a local step)")
        return
    if s.get("participants") != dim_groups(G.data["mesh"]["ranks"], d):
        yield Problem(where, "participants", s.get("participants"), dim_groups(G.data["mesh"]["ranks"], d))
    if kind is None:
        return
    src = value.get("placements") or []
    element = torch.empty((), dtype=getattr(torch, value.get("dtype", "float32"))).element_size()
    payload = math.prod(value.get("shape") or []) * element
    payload //= math.prod(G.sizes[e] for e, p in enumerate(src) if e != d and p.startswith("S"))
    payload //= G.sizes[d] if kind is Kind.ALL_TO_ALL else 1
    if s.get("bytes") != payload:
        yield Problem(where, "bytes", s.get("bytes"), f"{payload} ({kind.value} of {value.get('shape')} {value.get('dtype')})")
    wire = bytes_per_rank(kind, payload, G.sizes[d])
    if not math.isclose(s.get("wire_bytes", -1), wire):
        yield Problem(where, "wire bytes", s.get("wire_bytes"), wire)
    if s.get("transpose") != RULES[kind].transpose.value:
        yield Problem(where, "transpose", s.get("transpose"), f"{RULES[kind].transpose.value} (the transpose of {kind.value})")
    owed = backward_kinds(letter(a), letter(b))
    if s.get("backward") is not None and _kind(s["backward"]) not in owed:
        yield Problem(where, "backward owed", s["backward"], f"one of {sorted(k.value for k in owed)} or none")
    c = G.collectives.get(s.get("collective"))
    if c is None:
        yield Problem(where, "move issues its collective", s.get("collective"), f"the id of the forward {kind.value} it issues")
        return
    for key, should in (("kind", kind.value), ("mesh_dim", d), ("bytes", payload), ("direction", "forward")):
        if c.get(key) != should and not (key == "kind" and kind is Kind.ALL_TO_ALL and c.get(key) == "all_gather"):
            yield Problem(where, "emitted collective", f"{c.get('id')} {key} {c.get(key)}", should)
    partner = G.collectives.get(c.get("partner"))
    if (partner or {}).get("kind") != s.get("backward"):
        yield Problem(where, "backward owed", f"backward {s.get('backward')}",
                      f"{(partner or {}).get('kind')} (the kind of {c.get('id')}'s partner {c.get('partner')})")


def collectives(G: Graph) -> Iterator[Problem]:
    """Each collective: its group and mesh dim, its wire bytes, its transpose partner, why backward owes it."""
    for cid, c in G.collectives.items():
        where = f"{G.where}, collective {cid!r}"
        kind = _kind(c.get("kind"))
        if kind is None:
            yield Problem(where, "collective kind", c.get("kind"), f"one of {sorted(k.value for k in Kind)}")
            continue
        group = G.g["groups"].get(c.get("group"))
        d = c.get("mesh_dim")
        if group is None or group.get("mesh_dim") != d or not isinstance(d, int) or not 0 <= d < len(G.sizes):
            yield Problem(where, "group", f"group {c.get('group')} on mesh dim {d}", "a group of the file on that mesh dim")
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
            pk = _kind(partner.get("kind"))
            allowed = {RULES[pk].transpose.value} if pk else set()
            if pk is Kind.ALL_GATHER:
                allowed.add("all_gather")  # gloo's all_to_all: all_gather and keep a piece, both ways
            if kind.value not in allowed:
                yield Problem(where, "transpose pair", f"{kind.value} transposing {partner.get('kind')}",
                              f"{' or '.join(sorted(allowed))} (the table's transpose of {partner.get('kind')})")
        if c.get("direction") == "backward":
            yield from _owed(G, where, c, kind, d)


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
        yield Problem(where, "cotangent reduction owed", f"{kind.value} in the backward of {origin!r} {pairs}",
                      f"one of {sorted(k.value for k in owed) or ['no collective']}")


def _varies(G: Graph, name: str, d: int) -> bool:
    """Whether the cotangent of replicated value `name` surely differs per rank on mesh dim `d`:
    some reader writes a shard there (its cotangent comes back sharded, so this one is partial).
    Readers that stay replicated are not followed: "not sure" never raises a problem."""
    return any(name in v.get("reads", []) and (v.get("placements") or [""] * (d + 1))[d].startswith("S")
               for v in G.values.values())


def owed(G: Graph) -> Iterator[Problem]:
    """Nothing owed is missing: a gathered value whose cotangent is surely partial has its backward
    transpose (S -> R forward owes P -> S back), and an eager-role parameter replicated over a mesh dim
    on which its gradient is surely partial has a cotangent reduction there."""
    for node, m in G.moves.items():
        for s in m.get("steps", []):
            d = s.get("mesh_dim")
            if s.get("kind") == "all_gather" and (m.get("dst") or [])[d] == "R" and _varies(G, node, d) \
                    and s.get("backward") is None:
                yield Problem(f"{G.where}, move {node!r} of {m.get('value')!r}, mesh dim {d}", "nothing owed is missing",
                              "no backward collective", f"{RULES[Kind.ALL_GATHER].transpose.value}: its readers write "
                              f"shards on mesh dim {d}, so its cotangent is partial")
    origins = {(c.get("origin"), c.get("mesh_dim")) for c in G.collectives.values() if c.get("direction") == "backward"}
    for name, p in G.values.items():
        if p.get("kind") != "parameter" or p.get("cotangent_role") != "eager":
            continue
        # The parameter's read, and the eager-gradient reads the compiler marks with the same layout.
        reads = [name] + [n for n, v in G.values.items() if v.get("reads") == [name] and v.get("kind") == "op"
                          and v.get("placements") == p.get("placements")]
        for d, placement in enumerate(p.get("placements") or []):
            varying = [r for r in reads if _varies(G, r, d)]
            if placement == "R" and varying and not any((r, d) in origins for r in reads):
                yield Problem(f"{G.where}, value {name!r} (parameter {p.get('parameter')!r}), mesh dim {d}",
                              "nothing owed is missing", "no gradient reduction in the backward",
                              f"an all_reduce (eager role): {varying[0]!r} is read by an op that writes shards on "
                              f"mesh dim {d}, so the gradient is partial")


def issued(G: Graph) -> Iterator[Problem]:
    """What the program issues: each collective once, alone or in a bucket of its own kind and group."""
    seen: dict[str, str] = {}
    for iid, i in G.issued.items():
        where = f"{G.where}, issued collective {iid!r}"
        kind = _kind(i.get("kind"))
        members = [G.collectives.get(m) for m in i.get("members", [])]
        if kind is None or None in members or not members:
            yield Problem(where, "issued", f"{i.get('kind')} of {i.get('members')}", "a known kind of collectives of this graph")
            continue
        for m in members:
            if seen.setdefault(m["id"], iid) != iid or m.get("issued_as") != iid:
                yield Problem(where, "issued once", f"{m['id']} issued as {m.get('issued_as')}", f"{iid} alone")
            for key in ("kind", "group", "direction"):
                if m.get(key) != i.get(key):
                    yield Problem(where, "issued", f"member {m['id']} {key} {m.get(key)}", f"{i.get(key)} (the issue's)")
        total = sum(m.get("bytes", 0) for m in members)
        if i.get("bytes") != total:
            yield Problem(where, "bytes", i.get("bytes"), f"{total} (the sum of its {len(members)} collective(s))")
        d = i.get("mesh_dim")
        if isinstance(d, int) and 0 <= d < len(G.sizes) and not math.isclose(
                i.get("wire_bytes", -1), bytes_per_rank(kind, i.get("bytes", 0), G.sizes[d])):
            yield Problem(where, "wire bytes", i.get("wire_bytes"), bytes_per_rank(kind, i.get("bytes", 0), G.sizes[d]))
    for cid in G.collectives:
        if cid not in seen:
            yield Problem(f"{G.where}, collective {cid!r}", "issued once", "never issued", "issued alone or in a bucket")


def groups(G: Graph) -> Iterator[Problem]:
    """Each group: its ranks follow from the mesh; its order (the same on every rank of the group:
    one SPMD program) is the program's issue order of that group's collectives."""
    for name, grp in G.g["groups"].items():
        where = f"{G.where}, group {name!r}"
        d = grp.get("mesh_dim")
        if isinstance(d, int) and 0 <= d < len(G.sizes) and grp.get("participants") != dim_groups(G.data["mesh"]["ranks"], d):
            yield Problem(where, "participants", grp.get("participants"), dim_groups(G.data["mesh"]["ranks"], d))
        for direction in ("forward", "backward"):
            program = [iid for iid, c in G.issued.items() if c.get("group") == name and c.get("direction") == direction]
            order = grp.get(direction, [])
            if order != program:
                first = next((i for i, (a, b) in enumerate(zip(order, program)) if a != b), min(len(order), len(program)))
                yield Problem(f"{where}, {direction}", "group order",
                              f"position {first}: {order[first] if first < len(order) else 'nothing'}",
                              f"{program[first] if first < len(program) else 'nothing'} (the program's issue order)")


GRAPH_RULES = (placements, parameters, partial_reduced, moves, collectives, owed, issued, groups)
