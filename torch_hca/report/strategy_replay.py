"""A strategy file read back by a compile (``options={"strategy": path}``): load, match, replay, check.

The layout pass `load`s the file (its structure checked), takes this graph's entry
(`match_graph`: same world size, mesh, parameters and logical program), replays the moves
the solver chose (`moves_to_replay`) and checks that the values and moves came out as the
file says (`check_replayed`). Writing the file is `torch_hca.report.strategy_file`; the
schema is docs/strategy.md.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from torch.distributed.tensor import Placement

from torch_hca.errors import StrategyError
from torch_hca.report.strategy_digest import model_digest
from torch_hca.report.strategy_file import SCHEMA, VERSION
from torch_hca.spmd.placements import layout_texts, parse_placement

_TOP = {"schema": str, "version": int, "made_by": dict, "mesh": dict, "world_size": int, "model": dict, "graphs": list}
_GRAPH = {
    "logical_digest": str,
    "values": dict,
    "outputs": list,
    "moves": list,
    "collectives": list,
    "issued": list,
    "groups": dict,
}


def load(source: str | os.PathLike | dict) -> dict:
    """A strategy file read and its structure checked: StrategyError names what is wrong and the fix."""
    where = f"strategy file {os.fspath(source)!r}" if not isinstance(source, dict) else "strategy"
    if isinstance(source, dict):
        data = source
    else:
        try:
            with open(source) as f:
                data = json.load(f)
        except OSError as e:
            raise StrategyError(
                f"{where}: cannot read it ({e.strerror}); write one with hca.report(compiled).save_strategy(path)"
            ) from e
        except json.JSONDecodeError as e:
            raise StrategyError(
                f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): truncated or "
                "hand-edited? Save it again with hca.report(compiled).save_strategy(path)"
            ) from e
    structure_problem = _structure(data)
    if structure_problem:
        raise StrategyError(
            f"{where}: {structure_problem}; save it again with hca.report(compiled).save_strategy(path)"
        )
    return data


def _structure(data: Any) -> str | None:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return (
            f"not a torch_hca strategy (its 'schema' is {data.get('schema') if isinstance(data, dict) else data!r}, "
            f"not {SCHEMA!r})"
        )
    if data.get("version") != VERSION:
        return f"schema version {data.get('version')!r}, and this torch_hca reads version {VERSION} only"
    for key, typ in _TOP.items():
        if not isinstance(data.get(key), typ):
            return f"'{key}' is missing or not a {typ.__name__}"
    for i, g in enumerate(data["graphs"]):
        for key, typ in _GRAPH.items():
            if not isinstance(g, dict) or not isinstance(g.get(key), typ):
                return f"graphs[{i}].{key} is missing or not a {typ.__name__}"
    if not isinstance(data["model"].get("parameters"), dict) or not isinstance(data["model"].get("digest"), str):
        return "model.parameters or model.digest is missing"
    if model_digest(data["model"]) != data["model"]["digest"]:
        return "model.digest does not match the model section (hand-edited?)"
    return None


def match_graph(
    data: dict, facts: dict, mesh_shape: list[int], parameters: dict, graph: str, shares: dict | None = None
) -> dict:
    """The file's entry for this graph, or StrategyError naming the first difference. `shares`: this
    compile's uneven shares (`strategy_file.shares_entry`), None where the inputs are cut evenly."""
    world = math.prod(mesh_shape)

    def differ(what: str, says: Any, here: Any) -> StrategyError:
        return StrategyError(
            f"strategy file: made for another {what}: the file says {says}, this compile has {here} "
            f"({graph}); save a strategy for this model, mesh and world size, or leave the option out"
        )

    if data["world_size"] != world:
        raise differ("world size", data["world_size"], world)
    if list(data["mesh"]["shape"]) != list(mesh_shape):
        raise differ("mesh", f"shape {data['mesh']['shape']}", f"shape {list(mesh_shape)}")
    if "device_type" in facts and data["mesh"].get("device_type") != facts["device_type"]:
        raise differ("device type", data["mesh"].get("device_type"), facts["device_type"])
    if data["mesh"].get("ranks") != facts.get("mesh_ranks"):
        raise differ("mesh", f"ranks {data['mesh'].get('ranks')}", f"ranks {facts.get('mesh_ranks')}")
    known = data["model"]["parameters"]
    for name, p in parameters.items():
        if name not in known:
            raise differ("model", "no parameter " + repr(name), f"parameter {name!r} {p['shape']}")
        mine = {"shape": p["shape"], "dtype": p["dtype"], "placements": layout_texts(p["placements"])}
        for key in ("shape", "dtype", "placements"):
            if known[name][key] != mine[key]:
                raise differ("model", f"parameter {name!r} {key} {known[name][key]}", f"{mine[key]}")
    # Before the digest (which the shares change too): the difference as the user wrote it.
    cuts = [_cut(g.get("shares")) for g in data["graphs"]]
    if _cut(shares) not in cuts:
        said = " or ".join(sorted({c or "no shares (every piece even)" for c in cuts}))
        raise differ("cut of the inputs", said, _cut(shares) or "no shares (every piece even)")
    entry = next((g for g in data["graphs"] if g["logical_digest"] == facts["logical_digest"]), None)
    if entry is None:
        raise differ(
            "model",
            f"logical graph digest(s) {', '.join(g['logical_digest'] for g in data['graphs'])}",
            f"{facts['logical_digest']} (the forward's code, an input's shape or dtype differs)",
        )
    return entry


def _cut(shares: dict | None) -> str | None:
    """Shares as the refusal names them: ``shares (1, 3) on mesh dim 0``."""
    if not isinstance(shares, dict):
        return None
    return f"shares {tuple(shares.get('shares') or ())} on mesh dim {shares.get('mesh_dim')}"


def moves_to_replay(entry: dict) -> list[tuple[str, tuple[Placement, ...], tuple[Placement, ...], list[str]]]:
    """(value, source layout, destination layout, readers) of each move the solver chose, in the file's order."""
    layout = lambda texts: tuple(parse_placement(p) for p in texts)
    return [
        (m["value"], layout(m["src"]), layout(m["dst"]), list(m["readers"]))
        for m in entry["moves"]
        if m["origin"] == "solver"
    ]


def check_replayed(entry: dict, values: dict[str, dict], redistributions: list, graph: str) -> None:
    """After the layout pass replayed the file's moves: every value and move as the file says."""
    for name, meta in values.items():
        said = entry["values"].get(name)
        if said is None:
            raise StrategyError(
                f"strategy file: {graph}: value {name!r} {meta['placements']} is not in the file "
                "(the file does not lay this program out)"
            )
        here = layout_texts(meta["placements"])
        if said["placements"] != here:
            raise StrategyError(
                f"strategy file: {graph}: value {name!r} is {said['placements']} in the file, "
                f"{here} after replaying its moves (hand-edited, or another torch)"
            )
    mine = [(r.node, r.value, layout_texts(r.src), layout_texts(r.dst)) for r in redistributions]
    theirs = [(m["node"], m["value"], m["src"], m["dst"]) for m in entry["moves"]]
    if mine != theirs:
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        says = theirs[first] if first < len(theirs) else "nothing more"
        here = mine[first] if first < len(mine) else "nothing more"
        raise StrategyError(f"strategy file: {graph}: move {first} is {says} in the file, {here} after replaying")
