"""The verifier's rules on a graph cut by uneven shares (the file's ``shares``, docs/heterogeneous.md).

Under shares each rank runs the even program of its own rows, and that is exact only for
what reads rows one by one or sums over them. So the file must say: which mesh dim is cut,
by shares that fit it, with each rank's weight its share of the rows; no parameter split over
that dim (each rank's even piece would be another rank's rows); over that dim, the forward
only sums (an all-reduce); and no partial *mean* over it is reduced as it stands: averaging
the ranks' means counts a rank of 1 row as much as one of 3, the silent wrong gradient that
uneven data parallelism is known for. Each must first be made the weighted sum it is.
"""

from __future__ import annotations

import math
from typing import Iterator

from .rules import Graph, Problem


def shares(G: Graph) -> Iterator[Problem]:
    """The shares fit the mesh, the weights are the shares' proportions, and what the shares forbid is absent."""
    s = G.g.get("shares")
    if s is None:
        return
    where = f"{G.where}, shares"
    d, cut = s.get("mesh_dim"), s.get("shares")
    if not isinstance(d, int) or not 0 <= d < len(G.sizes):
        yield Problem(where, "shares", f"mesh_dim {d}", f"a mesh dim of {G.sizes}")
        return
    if not (
        isinstance(cut, list)
        and len(cut) == G.sizes[d]
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in cut)
    ):
        yield Problem(where, "shares", cut, f"one positive integer per rank of mesh dim {d} ({G.sizes[d]})")
        return
    weights = s.get("weights")
    want = [x / sum(cut) for x in cut]
    if not (isinstance(weights, list) and len(weights) == len(want) and all(map(math.isclose, weights, want))):
        yield Problem(where, "share weights", weights, f"{want} (each rank's share of the rows)")
    yield from _parameters_whole(G, d)
    yield from _forward_sums(G, d)
    yield from _means_weighted(G, d, s.get("weighted_means") or [])


def _parameters_whole(G: Graph, d: int) -> Iterator[Problem]:
    for name, p in (G.data["model"].get("parameters") or {}).items():
        placement = (p.get("placements") or [None] * (d + 1))[d]
        if isinstance(placement, str) and placement.startswith("S"):
            yield Problem(
                f"{G.where}, parameter {name!r}",
                "shares: parameters whole",
                f"{placement} on mesh dim {d}, the dim cut by shares",
                "R on that dim (each rank's even piece would not be its share)",
            )


def _forward_sums(G: Graph, d: int) -> Iterator[Problem]:
    for c in G.collectives.values():
        if c.get("direction") == "forward" and c.get("mesh_dim") == d and c.get("kind") != "all_reduce":
            yield Problem(
                f"{G.where}, collective {c.get('id')!r}",
                "shares: forward sums",
                f"a {c.get('kind')} over mesh dim {d}, the dim cut by shares",
                "only all_reduce (sums) over that dim: a gather or a scatter needs the uneven pieces' sizes",
            )


def _means_weighted(G: Graph, d: int, weighted: list) -> Iterator[Problem]:
    """No P(avg) over the uneven dim is moved or returned; each weighted mean is one, read by a sum."""
    for m in G.moves.values():
        src, dst = m.get("src") or [], m.get("dst") or []
        if len(src) > d and len(dst) > d and src[d] == "P(avg)" and dst[d] != "P(avg)":
            yield _unweighted(G, m.get("value"), f"move {m.get('node')!r}", d)
    for out in G.g.get("outputs") or []:
        v = G.values.get(out.get("value")) or {}
        ps = v.get("placements") or []
        if len(ps) > d and ps[d] == "P(avg)":
            yield _unweighted(G, out.get("value"), "an output", d)
    readers: dict[str, list[str]] = {}
    for name, v in G.values.items():
        for r in v.get("reads") or []:
            readers.setdefault(r, []).append(name)
    for name in weighted:
        v = G.values.get(name)
        ps = (v or {}).get("placements") or []
        sums = [r for r in readers.get(name, []) if (G.values[r].get("placements") or [None] * (d + 1))[d] == "P(sum)"]
        if v is None or len(ps) <= d or ps[d] != "P(avg)" or not sums:
            yield Problem(
                f"{G.where}, value {name!r}",
                "shares: weighted means",
                f"listed as a weighted mean: {ps or 'no such value'}, read as a partial sum by {sums or 'nothing'}",
                f"a P(avg) on mesh dim {d} that a P(sum) value (its weighted sum) reads",
            )


def _unweighted(G: Graph, value, how: str, d: int) -> Problem:
    return Problem(
        f"{G.where}, value {value!r}",
        "shares: weighted means",
        f"a partial mean over mesh dim {d} reduced as it stands ({how}): each rank's mean counted alike",
        "its weighted sum (each rank's piece times its share of the rows) reduced instead",
    )
