"""The verifier's rules: each reads the strategy file alone and names what it finds wrong.

Independent of the code that wrote the file: this room imports only torch, the spmd
algebra (the move table, the transposes, the wire bytes) and the errors. A rule returns
`Problem`s; `torch_hca.verify.verify` runs them all. Here: the file as a whole, and each graph's
values and moves; its collectives are `torch_hca.verify.collective_rules`.
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

from . import pieces as P

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


def kind_of(name: Any) -> Kind | None:
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
        return [
            Problem("file", "schema version", data.get("version"), f"{VERSION} (the only version this verifier reads)")
        ]
    need = {"mesh": dict, "world_size": int, "model": dict, "graphs": list}
    bad = [
        Problem("file", "schema", f"{k}: {type(data.get(k)).__name__}", t.__name__)
        for k, t in need.items()
        if not isinstance(data.get(k), t)
    ]
    for i, g in enumerate(data.get("graphs") or []):
        for k in ("values", "moves", "collectives", "issued", "groups", "outputs"):
            if not isinstance(g, dict) or k not in g:
                bad.append(Problem(f"graph {i}", "schema", f"no '{k}'", f"a '{k}' field"))
    return bad


def mesh_and_model(data: dict) -> list[Problem]:
    mesh, problems = data["mesh"], []
    shape = list(mesh.get("shape") or [])
    if math.prod(shape) != data["world_size"]:
        problems.append(
            Problem(
                "mesh",
                "world size",
                f"world_size {data['world_size']}",
                f"{math.prod(shape)} (the product of mesh shape {shape})",
            )
        )
    ranks = mesh.get("ranks")
    try:
        t = torch.tensor(ranks)
        if list(t.shape) != shape or sorted(t.flatten().tolist()) != list(range(math.prod(shape))):
            problems.append(
                Problem("mesh", "mesh ranks", ranks, f"each rank 0..{math.prod(shape) - 1} once, shaped {shape}")
            )
    except (TypeError, ValueError, RuntimeError):
        problems.append(Problem("mesh", "mesh ranks", ranks, f"nested rank lists shaped {shape}"))
    model = data["model"]
    body = {k: v for k, v in model.items() if k != "digest"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]
    if model.get("digest") != digest:
        problems.append(
            Problem(
                "model",
                "model digest",
                model.get("digest"),
                f"{digest} (the digest of the model section: stale or hand-edited)",
            )
        )
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
        self.mesh = P.Mesh(self.sizes, data["mesh"]["ranks"])

    def at(self, name: str) -> str:
        return f"{self.where}, value {name!r}"


def placements(G: Graph) -> Iterator[Problem]:
    """Every placement parses, one per mesh dim, and shards divide the logical shape evenly
    or are torch.chunk's pieces, declared, none empty."""
    for name, v in G.values.items():
        ps, shape = v.get("placements"), v.get("shape") or []
        if (
            not isinstance(ps, list)
            or len(ps) != len(G.sizes)
            or not all(isinstance(p, str) and _PLACEMENT.fullmatch(p) for p in ps)
        ):
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
            if not isinstance(shape[d], int) or shape[d] % n == 0:
                continue
            # A cut that does not divide is torch.chunk's, and the file declares each rank's piece.
            if "pieces" not in v:
                yield Problem(
                    G.at(name),
                    "shard divides",
                    f"shape {shape} split {n} ways on dim {d}, no pieces declared",
                    f"a size divisible by {n} on dim {d}, or each rank's piece (torch.chunk's) in 'pieces'",
                )
                continue
            mine = [P.local_shape(shape, ps, G.mesh, r) for r in range(G.mesh.world)]
            if v["pieces"] != mine or any(0 in piece for piece in mine):
                yield Problem(
                    G.at(name),
                    "shard pieces",
                    f"pieces {v['pieces']} of shape {shape}",
                    f"torch.chunk's pieces {mine}, none empty",
                )


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
            yield Problem(
                G.at(name),
                "parameter storage",
                f"{v.get('placements')} {v.get('shape')}",
                f"{p.get('placements')} {p.get('shape')} (model section, {v.get('parameter')})",
            )


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
                    yield Problem(
                        G.at(name),
                        "partial reduced before use",
                        f"{v.get('op')} reads {read!r} as {a} on mesh dim {m} and writes {b}",
                        f"a move reducing {read!r} ({a} -> R or S) before {name!r} reads it",
                    )
    # The caller reads a result as the outputs say; under shares each rank hands back its own
    # weighted summand over the uneven mesh dim (share_rules checks those).
    by_shares = (G.g.get("shares") or {}).get("mesh_dim")
    for i, out in enumerate(G.g.get("outputs") or []):
        v = G.values.get(out.get("value")) or {}
        for m, (a, b) in enumerate(zip(v.get("placements") or [], out.get("placements") or [])):
            if a.startswith("P") and not b.startswith("P") and m != by_shares:
                yield Problem(
                    f"{G.where}, output {i}",
                    "partial reduced before use",
                    f"the caller receives {out.get('value')!r}, {a} on mesh dim {m}, as {b}",
                    f"a move reducing {out.get('value')!r} ({a} -> {b}) before it is returned",
                )


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
        yield from _steps(G, where, value, list(src), dst, m.get("steps", []))


def _steps(G: Graph, where: str, value: dict, current: list[str], dst: list[str], steps: list) -> Iterator[Problem]:
    """The steps, in the order the program runs them, take the value from its placement to the
    move's; each one is legal where it runs: a mesh dim gathers or cuts a tensor dim only while no
    later mesh dim cuts that dim too (the later one's pieces nest inside its own)."""
    for s in steps:
        d = s.get("mesh_dim")
        if not isinstance(d, int) or not 0 <= d < len(current) or s.get("src") != current[d]:
            at = current[d] if isinstance(d, int) and 0 <= d < len(current) else "no such mesh dim"
            yield Problem(where, "move steps", f"a step on mesh dim {d} from {s.get('src')}", f"a step from {at}")
            return
        cut = {P.parse(p)[1] for p in (s["src"], s.get("dst") or "R") if p.startswith("S")}
        inner = [e for e in range(d + 1, len(current)) if current[e].startswith("S") and P.parse(current[e])[1] in cut]
        if inner:
            yield Problem(
                f"{where}, mesh dim {d} ({s['src']} -> {s.get('dst')})",
                "nested order",
                f"this step while mesh dim {inner[0]} holds {current[inner[0]]}",
                f"mesh dim {inner[0]}'s step first (its pieces nest inside mesh dim {d}'s)",
            )
        yield from _step(G, where, value, s, current)
        current[d] = s.get("dst")
    if current != list(dst):
        yield Problem(where, "move steps", f"steps ending at {current}", f"steps ending at the move's {list(dst)}")


def _step(G: Graph, where: str, value: dict, s: dict, src: list[str]) -> Iterator[Problem]:
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
    element = torch.empty((), dtype=getattr(torch, value.get("dtype", "float32"))).element_size()
    payload = math.prod(value.get("shape") or []) * element
    payload //= math.prod(G.sizes[e] for e, p in enumerate(src) if e != d and p.startswith("S"))
    payload //= G.sizes[d] if kind is Kind.ALL_TO_ALL else 1
    if s.get("bytes") != payload:
        yield Problem(
            where, "bytes", s.get("bytes"), f"{payload} ({kind.value} of {value.get('shape')} {value.get('dtype')})"
        )
    wire = bytes_per_rank(kind, payload, G.sizes[d])
    if not math.isclose(s.get("wire_bytes", -1), wire):
        yield Problem(where, "wire bytes", s.get("wire_bytes"), wire)
    if s.get("transpose") != RULES[kind].transpose.value:
        yield Problem(
            where, "transpose", s.get("transpose"), f"{RULES[kind].transpose.value} (the transpose of {kind.value})"
        )
    owed = backward_kinds(letter(a), letter(b))
    if s.get("backward") is not None and kind_of(s["backward"]) not in owed:
        yield Problem(where, "backward owed", s["backward"], f"one of {sorted(k.value for k in owed)} or none")
    c = G.collectives.get(s.get("collective"))
    if c is None:
        yield Problem(
            where, "move issues its collective", s.get("collective"), f"the id of the forward {kind.value} it issues"
        )
        return
    uneven = uneven_cut(value, src, d, G.sizes)
    if uneven is not None and (kind is not Kind.ALL_GATHER or value.get("kind") == "parameter"):
        yield Problem(
            where,
            "uneven moves",
            f"{kind.value} of {value.get('shape')} cut unevenly on dim {uneven[0]}",
            "a gather of an activation (padded all_gather), the only move of an uneven value",
        )
    wire_payload = payload if uneven is None else payload // uneven[1] * uneven[2]
    if kind is Kind.ALL_TO_ALL and c.get("kind") == "all_gather":
        # gloo has no all_to_all: DTensor gathers the whole value and keeps its piece, so the
        # collective carries n times the all_to_all's bytes.
        wire_payload *= G.sizes[d]
    for key, should in (("kind", kind.value), ("mesh_dim", d), ("bytes", wire_payload), ("direction", "forward")):
        if c.get(key) != should and not (key == "kind" and kind is Kind.ALL_TO_ALL and c.get(key) == "all_gather"):
            yield Problem(where, "emitted collective", f"{c.get('id')} {key} {c.get(key)}", should)
    partner = G.collectives.get(c.get("partner"))
    if (partner or {}).get("kind") != s.get("backward"):
        yield Problem(
            where,
            "backward owed",
            f"backward {s.get('backward')}",
            f"{(partner or {}).get('kind')} (the kind of {c.get('id')}'s partner {c.get('partner')})",
        )


def uneven_cut(value: dict, src: list, d: int, sizes: list[int]) -> tuple[int, int, int] | None:
    """Where mesh dim `d` cuts `value` (laid out as `src`) unevenly: (its dim, size, the padded size,
    every piece padded to the largest as the emitted all_gather sends it); else None."""
    p = src[d] if d < len(src) else "R"
    shape = value.get("shape") or []
    if not p.startswith("S") or int(p[2:-1]) >= len(shape) or not isinstance(shape[int(p[2:-1])], int):
        return None
    dim = int(p[2:-1])
    size = shape[dim]
    for e, q in enumerate(src[:d]):  # mesh dims before d cut the dim first, as DTensor cuts
        if q == p:
            size = -(-size // sizes[e])
    if size % sizes[d] == 0:
        return None
    return dim, size, -(-size // sizes[d]) * sizes[d]
