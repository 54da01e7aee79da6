"""The strategy file: what the compiler decided for one compiled module, as versioned JSON.

Written by `CompileReport.save_strategy` (`build`, `save`); read back by the layout pass
under ``options={"strategy": path}`` (`torch_hca.report.strategy_replay`); checked on its own
by `torch_hca.verify`, which shares no code with this module. The schema is docs/strategy.md.

    hca.report(c).save_strategy("s.json")                 # rank 0 is enough: every rank's is the same
    torch.compile(model, backend="hca", options={"strategy": "s.json"})
    hca.verify("s.json")
"""

from __future__ import annotations

import json
import math
import os
from importlib.metadata import version
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Placement

from torch_hca._torch_private import group_size, origin_of, redistribute_plan
from torch_hca.compiler import dtensor_ops
from torch_hca.errors import StrategyError
from torch_hca.spmd.chunks import rank_pieces
from torch_hca.spmd.collective_kinds import RULES, Kind, bytes_per_rank, move_kind
from torch_hca.spmd.collective_nodes import OPS, node_group, node_kind, node_payload, payload_bytes
from torch_hca.spmd.placements import (
    PLAIN_PLACEMENT,
    dtype_str,
    layout_str,
    layout_texts,
    parse_placement,
    placement_str,
    text_letter,
)

from torch_hca.report.strategy_digest import logical_digest, model_digest, op_text
from torch_hca.report.strategy_issued import issued_collectives
from torch_hca.report.strategy_residuals import residuals

SCHEMA = "torch_hca.strategy"
VERSION = 1
SOLVER_REASON = " reads it so ("  # passes/layout.py's reason for a move the solver (or a strategy file) chose

# ----------------------------------------------------------------------------- facts of a graph


def graph_facts(gm: fx.GraphModule, mesh) -> dict[str, Any]:
    """What the layout pass notes for the strategy file before it changes the graph."""
    facts: dict[str, Any] = {"logical_digest": logical_digest(gm)}
    if mesh is not None:
        facts["mesh_ranks"] = mesh.mesh.tolist()
        facts["device_type"] = mesh.device_type
        facts["groups"] = {mesh.get_group(d).group_name: d for d in range(mesh.ndim)}
    return facts


# ----------------------------------------------------------------------------- writing


def dim_groups(ranks: Any, dim: int) -> list[list[int]]:
    """The rank lists of mesh dim `dim` of a mesh given as nested rank lists."""
    t = torch.tensor(ranks)
    return t.movedim(dim, -1).reshape(-1, t.shape[dim]).tolist()


def _move_steps(src: list[str], dst: list[str], shape: list[int], dtype: str, mesh: dict) -> list[dict]:
    """One entry per step of DTensor's redistribute, in the order it runs them: the move table's
    collective, its bytes and transpose. A dim cut by two mesh dims is taken apart from the inner
    mesh dim out (its pieces nest in mesh-dim order), so the order is DTensor's own plan's."""
    sizes, steps = mesh["shape"], []
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    current = list(src)
    for d, a, b in _plan(src, dst, shape, sizes):
        kind = move_kind(text_letter(a), text_letter(b))
        # The payload: the value's buffer on one rank of this dim's group (other dims' shards cut it);
        # all_to_all moves this rank's own shard (collective_kinds' convention).
        local = math.prod(shape) * element
        local //= math.prod(sizes[e] for e, p in enumerate(current) if e != d and p.startswith("S"))
        if kind is Kind.ALL_TO_ALL:
            local //= sizes[d]
        current[d] = b
        steps.append(
            {
                "mesh_dim": d,
                "src": a,
                "dst": b,
                "kind": kind.value if kind else None,
                "participants": dim_groups(mesh["ranks"], d),
                "bytes": local if kind else 0,
                "wire_bytes": bytes_per_rank(kind, local, sizes[d]) if kind else 0.0,
                "transpose": RULES[kind].transpose.value if kind else None,
                "collective": None,
                "backward": None,
            }
        )
    return steps


def _plan(src: list[str], dst: list[str], shape: list[int], sizes: list[int]) -> list[tuple[int, str, str]]:
    """(mesh dim, from, to) per step of DTensor's plan; mesh-dim order where it cannot be asked (a
    placement with no plain text, a size not known)."""
    if all(PLAIN_PLACEMENT.fullmatch(p) for p in (*src, *dst)) and all(isinstance(n, int) for n in shape):
        plan = redistribute_plan(sizes, shape, [parse_placement(p) for p in src], [parse_placement(p) for p in dst])
        return [(d, placement_str(a), placement_str(b)) for d, a, b in plan]
    return [(d, a, b) for d, (a, b) in enumerate(zip(src, dst)) if a != b]


def _value_entry(node: fx.Node, kind: str) -> dict | None:
    meta = node.meta.get("hca_layout")
    v = node.meta.get("example_value")
    if meta is None and isinstance(v, DTensor):
        meta = {"shape": list(v.shape), "dtype": dtype_str(v.dtype), "placements": layout_str(v.placements)}
    if meta is None:
        return None
    entry = {
        "kind": kind,
        "op": op_text(node) if node.op != "placeholder" else "placeholder",
        "shape": list(meta["shape"]),
        "dtype": meta["dtype"],
        "placements": layout_texts(meta["placements"]),
        "reads": [],
    }
    if isinstance(v, torch.Tensor):  # a value without a cotangent (a mask, token ids) owes no backward
        entry["requires_grad"] = bool(v.requires_grad)
    return entry


def _graph_entry(g: Any, mesh: dict) -> dict:
    facts = g.layout.strategy_facts or {}
    program = g.dtensor_program
    inputs_of_params = {p.get("graph_input"): name for name, p in g.parameters.items()}
    values: dict[str, dict] = {}
    outputs = []
    for node in program.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "call_function" and node.target is dtensor_ops.to_output:
            src = node.args[0]
            outputs.append({"value": src.name, "placements": [_placement_text(p) for p in node.args[1]]})
            continue
        kind = (
            ("parameter" if node.name in inputs_of_params else "input")
            if node.op == "placeholder"
            else ("move" if node.target is dtensor_ops.redistribute else "op")
        )
        entry = _value_entry(node, kind)
        if entry is None:
            continue
        if kind == "parameter":
            entry["parameter"] = inputs_of_params[node.name]
            entry["cotangent_role"] = g.parameters[entry["parameter"]].get("grad_reduction")
        entry["reads"] = [a.name for a in node.all_input_nodes if a.name in values]
        # Declared, so that a size changed by one is not taken for an uneven cut.
        if (pieces := rank_pieces(entry["shape"], entry["placements"] or [], mesh["shape"], mesh["ranks"])) is not None:
            entry["pieces"] = pieces
        values[node.name] = entry
    issued = issued_collectives(g, facts, BUCKET_TAG)
    collectives = _collectives(g, facts, issued)
    moves = []
    for r in g.redistributions:
        node = next((n for n in program.graph.nodes if n.name == r.node), None)
        readers = [u.name for u in node.users] if node is not None else []
        value = values.get(r.value) or values.get(r.node) or {}
        moves.append(
            {
                "node": r.node,
                "value": r.value,
                "src": layout_texts(r.src),
                "dst": layout_texts(r.dst),
                "origin": "solver"
                if SOLVER_REASON in r.reason
                else ("program" if r.reason == "explicit in the program" else "dtensor"),
                "readers": readers,
                "steps": _move_steps(
                    layout_texts(r.src),
                    layout_texts(r.dst),
                    value.get("shape", []),
                    value.get("dtype", "float32"),
                    mesh,
                ),
            }
        )
    _link(moves, collectives)
    return {
        "logical_digest": facts.get("logical_digest"),
        "values": values,
        "outputs": outputs,
        "moves": moves,
        "collectives": collectives,
        "issued": issued,
        "groups": _groups(g, issued, mesh),
        "residuals": residuals(g),
        "shares": shares_entry(g),
        "schedule": _schedule_rules(g),
        "cost_model": _cost_model(g),
    }


def _rank_orders(g: Any, group: str) -> dict[str, dict[str, list[str]]]:
    """What each member of `group` posted as its issue order on the graph's first call, per
    direction ("kind:dtype:shape" per collective; `torch_hca.compiler.checks.spmd_check`): the
    orders every rank compiled, which the verifier compares with the file's. Only this rank's
    where it had no peers to ask (a fake process group); none before the first call."""
    out: dict[str, dict[str, list[str]]] = {}
    for direction in ("forward", "backward"):
        posted = (g.schedules.get(direction) or {}).get("per_rank") or {}
        for rank, seq in (posted.get(group) or {}).items():
            out.setdefault(str(rank), {"forward": [], "backward": []})[direction] = list(seq)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _placement_text(p: Placement) -> str:
    return layout_str((p,))[1:-1]


# Tags the passes leave on collective nodes (passes/transpose.py PARTNER, passes/buckets.py BUCKET):
# read by name, as the report room may not import the passes.
PARTNER_TAG, BUCKET_TAG = "hca_partner", "hca_bucket"


def _collectives(g: Any, facts: dict, issued: list[dict]) -> list[dict]:
    """One entry per collective the joint graph derived (before bucketing): kind, group, bytes,
    origin (the DTensor program node it comes from), transpose partner, and the issue it rides in."""
    issued_as = {m: i["id"] for i in issued for m in i["members"]}
    directions: dict[str, list[str]] = {}  # joint node name -> the graphs that issue it
    for m in issued_as:
        which, name = m.split(":", 1)
        directions.setdefault(name, []).append(which)
    out = []
    if g.joint is None:
        return out
    for node in g.joint.graph.nodes:
        if node.op != "call_function" or node.target not in OPS or node.name not in directions:
            continue
        vals = node_payload(node)
        payload = payload_bytes(node)
        group = node_group(node)
        n = group_size(group)
        partner = node.meta.get(PARTNER_TAG)
        for which in sorted(directions[node.name], key=("forward", "backward").index):
            # A forward collective the backward graph issues again (AOTAutograd's partition
            # recomputed it there rather than saving its result): the same collective, once more.
            again = which == "backward" and "forward" in directions[node.name]
            other = "backward" if which == "forward" else "forward"
            out.append(
                {
                    "id": f"{which}:{node.name}",
                    "direction": which,
                    "kind": node_kind(node).value,
                    "group": group,
                    "mesh_dim": facts.get("groups", {}).get(group),
                    "group_size": n,
                    "bytes": payload,
                    "wire_bytes": bytes_per_rank(node_kind(node), payload, n),
                    "dtype": dtype_str(vals[0].dtype),
                    "shape": list(vals[0].shape),
                    "origin": origin_of(node),
                    "partner": None
                    if again or not (isinstance(partner, str) and "," not in partner)
                    else f"{other}:{partner}",
                    "issued_as": issued_as[f"{which}:{node.name}"],
                    **({"recomputes": f"forward:{node.name}"} if again else {}),
                }
            )
    return out


def _link(moves: list[dict], collectives: list[dict]) -> None:
    """Each move step to the forward collective it issued, and that one's backward partner's kind."""
    by_id = {c["id"]: c for c in collectives}
    taken = set()
    for m in moves:
        for step in m["steps"]:
            fw = next(
                (
                    c
                    for c in collectives
                    if c["direction"] == "forward"
                    and c["origin"] == m["node"]
                    and c["mesh_dim"] == step["mesh_dim"]
                    and c["id"] not in taken
                ),
                None,
            )
            if fw is None:
                continue
            taken.add(fw["id"])
            step["collective"] = fw["id"]
            partner = by_id.get(fw["partner"]) if fw["partner"] else None
            step["backward"] = partner["kind"] if partner else None


def _groups(g: Any, issued: list[dict], mesh: dict) -> dict[str, dict]:
    """Per process group: its mesh dim and rank lists, its issue order per direction, and (once the
    module has run) what each rank posted."""
    groups: dict[str, dict] = {}
    for c in issued:  # one order per group: every rank of the group issues it (one SPMD program)
        grp = groups.setdefault(
            c["group"],
            {
                "mesh_dim": c["mesh_dim"],
                "participants": (dim_groups(mesh["ranks"], c["mesh_dim"]) if c["mesh_dim"] is not None else None),
                "forward": [],
                "backward": [],
            },
        )
        grp[c["direction"]].append(c["id"])
    for name, grp in groups.items():
        ranks = _rank_orders(g, name)
        if ranks:
            grp["ranks"] = ranks
    return groups


def _schedule_rules(g: Any) -> dict | None:
    """Per direction, the rules the schedule pass kept: the bucket cap and the bound on bytes in
    flight (a bound of null: none; no entry: the schedule is off, or the direction has no graph)."""
    bytes_or_none = lambda x: int(x) if math.isfinite(x) else None  # None: no bound
    rules = {}
    for which in ("forward", "backward"):
        s = g.schedules.get(which) or {}
        if s.get("bucket_cap_bytes") is not None:
            rules[which] = {k: bytes_or_none(s[k]) for k in ("bucket_cap_bytes", "in_flight_bytes")}
    return rules or None


def _cost_model(g: Any) -> dict | None:
    """The deployment's figures the solver priced this graph with, and where they came from (null:
    no solve, the layout as written or loaded)."""
    if not g.layout.cost_model:
        return None
    return {"source": g.layout.cost_model_source, "figures": dict(g.layout.cost_model)}


def shares_entry(g: Any) -> dict | None:
    """The shares graph report `g`'s forward arguments are cut by (docs/heterogeneous.md), or None:
    the file's ``shares``, and what a compile that loads a file compares with it."""
    u = g.uneven
    if u is None:
        return None
    return {
        "mesh_dim": u.mesh_dim,
        "shares": list(u.shares),
        "group": u.group,
        "weights": [s / sum(u.shares) for s in u.shares],
        "weighted_means": list(g.weighted_means),
    }


def _plain(obj: Any) -> Any:
    """`obj` with every symbolic size as its text: under shares the traced program's rows are a
    symbol (``2*s0``: n times this rank's piece), the same text on every rank."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (torch.SymInt, torch.SymFloat)):
        return str(obj)
    return obj


def laid_out(g: Any) -> bool:
    """Whether graph report `g` has a strategy to write: a DTensor program the layout pass laid out."""
    return g.dtensor_program is not None and g.layout.strategy_facts is not None


def build(rep: Any) -> dict:
    """The strategy file's content for a `CompileReport`."""
    graphs = [g for g in rep.graphs if g.dtensor_program is not None]
    if not graphs or not all(laid_out(g) for g in graphs):
        raise StrategyError(
            "save_strategy: no laid-out graph in this report (options inner='dtensor' and "
            "layout='solve' or 'as_written' all lay one out); compile and call the module once first"
        )
    first = graphs[0]
    facts = first.layout.strategy_facts
    mesh = {
        "shape": list(first.mesh["shape"]),
        "dim_names": list(first.mesh.get("names") or []) or None,
        "device_type": first.mesh.get("device_type"),
        "ranks": facts["mesh_ranks"],
    }
    parameters = {}
    for g in graphs:
        for name, p in g.parameters.items():
            parameters[name] = {"shape": p["shape"], "dtype": p["dtype"], "placements": layout_texts(p["placements"])}
    model = {
        "graph_digests": [g.layout.strategy_facts["logical_digest"] for g in graphs],
        "parameters": dict(sorted(parameters.items())),
    }
    model["digest"] = model_digest(model)
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "made_by": {"torch_hca": version("torch_hca"), "torch": torch.__version__},
        "mesh": mesh,
        "world_size": math.prod(mesh["shape"]),
        "model": model,
        "graphs": [_plain(_graph_entry(g, mesh)) for g in graphs],
        # Informative, as cost_model: which rank is which device and its capacity
        # (hca.sharded(..., deployment=)); loading and the verifier do not compare it.
        "deployment": rep.deployment(),
    }


def save(rep: Any, path: str | os.PathLike) -> dict:
    data = build(rep)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    return data
