"""One sentence per graph: what the user stored, what the program does, what it is predicted to
cost, and the user's layout as written priced by the same model.

    graph 0: data parallel: stored 8 parameters replicated, inputs (S(0)); 100% of the compute split
        over 4 ranks, the replicated parameters' gradients summed over them; moves: none; predicted
        0.18 ms a step, as written the same cost

Read from the layout pass's record (`GraphReport.layout`, `.parameters`, `.redistributions`), so it
is known when the graph compiles, before any step runs.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from torch_hca.compiler.layout.uneven_moves import UNEVEN_MOVE_S
from torch_hca.compiler.layout.value_row import ValueRow
from torch_hca.spmd.placements import layout_texts, text_letter

# A move on one mesh dimension, by its source and destination letters.
_MOVE_NAMES = {
    ("S", "R"): "gather",
    ("P", "R"): "sum",
    ("P", "S"): "reduce-scatter",
    ("S", "S"): "all-to-all",
    ("R", "S"): "free chunk",
    ("R", "P"): "free",
}


# How the solver's record names a value the user passed in (torch_hca.compiler.layout.candidates).
INPUT_WHY = ("graph input", "made from a local tensor")


def placements(layout: str | None) -> list[str]:
    """``"(S(0), R)"`` -> ``["S(0)", "R"]``; none for no layout."""
    return layout_texts(layout) or []


def _letter(p: str) -> str:
    """S, R or P."""
    return text_letter(p)[0]


def _moves(redistributions: list[Any], parameters: set[str]) -> Counter:
    """(what, of parameters or activations) -> count, over every mesh dimension of every move;
    `parameters`: the graph inputs that are parameters."""
    moves: Counter = Counter()
    for r in redistributions:
        for a, b in zip(placements(r.src), placements(r.dst)):
            if a != b:
                what = _MOVE_NAMES.get((_letter(a), _letter(b)), f"{a}->{b}")
                moves[what, "weight" if r.value in parameters else "activation"] += 1
    return moves


def _split_share(rows: list[ValueRow]) -> float | None:
    """The share of the predicted compute that runs split (some piece a Shard) over the ranks."""
    total = sum(r.compute_us for r in rows)
    if not total:
        return None
    split = sum(
        r.compute_us for r in rows if any(_letter(p) == "S" for lay in (r.placement, *r.reads) for p in placements(lay))
    )
    return split / total


def _storage(parameters: dict[str, dict[str, Any]]) -> tuple[str, bool]:
    """("24 parameters replicated" or "12 of 24 parameters sharded (S(0) 8, S(1) 4)", any sharded)."""
    kinds = Counter(p for info in parameters.values() for p in placements(info["placements"]) if p != "R")
    sharded = sum(any(p != "R" for p in placements(info["placements"])) for info in parameters.values())
    if not sharded:
        return f"{len(parameters)} parameters replicated", False
    by = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    return f"{sharded} of {len(parameters)} parameters sharded ({by})", True


def _label(sharded: bool, share: float | None, moves: Counter) -> str:
    gathers = sum(v for (what, of), v in moves.items() if what == "gather" and of == "activation")
    weight_gathers = sum(v for (what, of), v in moves.items() if what == "gather" and of == "weight")
    sums = sum(v for (what, _), v in moves.items() if what in ("sum", "reduce-scatter"))
    if share is not None and share < 0.05:
        return "replicated compute (every rank computes everything)"
    if not sharded:
        return "data parallel" if not gathers else "data parallel with activations gathered"
    if weight_gathers and not sums:
        return "FSDP-style (weights gathered to compute)"
    if sums:
        return "tensor parallel" + (" with activations gathered" if gathers else "")
    return "weights stay sharded, activations moved to them" if moves else "sharded storage, no moves"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def sentence(g: Any) -> str:
    """The summary of one `GraphReport`."""
    lay = g.layout
    mesh = g.mesh or {}
    ranks = math.prod(mesh.get("shape") or [1])
    stored, sharded = _storage(g.parameters)
    inputs = sorted({r.placement for r in lay.values if r.why in INPUT_WHY})
    if inputs:
        stored += f", inputs {' '.join(inputs)}"
    moves = _moves(g.redistributions, {info["graph_input"] for info in g.parameters.values()})
    share = _split_share(lay.values)
    moved = ", ".join(f"{v} {what} of {of}s" for (what, of), v in sorted(moves.items())) or "none"
    parts = [f"graph {g.index}: {_label(sharded, share, moves)}: stored {stored}"]
    if g.uneven is not None:
        u = g.uneven
        parts.append(
            f"batch cut by shares {u.text} over mesh dim {u.mesh_dim}, this rank {u.shares[u.coordinate]}/"
            f"{sum(u.shares)} of the rows"
        )
    if share is not None:
        parts.append(f"{share:.0%} of the compute split over {ranks} ranks")
        if not sharded and share > 0 and g.parameters:
            parts[-1] += ", the replicated parameters' gradients summed over them"
    parts.append(f"moves: {moved}")
    if getattr(g, "staged", False):
        parts.append("collectives staged through host buffers on gloo (option staging)")
    if lay.solved:
        predicted = f"predicted {_ms(lay.objective_s)} a step"
        alt = lay.as_written_s
        if alt is not None:
            same = math.isclose(alt, lay.objective_s, rel_tol=1e-6)
            if alt >= UNEVEN_MOVE_S:  # priced out: a move of uneven pieces that is not built
                predicted += ", as written not possible (it moves uneven pieces: a gather of a parameter or a scatter)"
            else:
                predicted += ", as written the same cost" if same else f", as written {_ms(alt)} (rejected)"
        parts.append(predicted)
    else:
        parts.append(f"layout by {lay.solver}")
    return "; ".join(parts)
