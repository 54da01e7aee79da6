"""Which cotangents arrive whole, for the numerical refinement check (`torch_hca.verify.numeric`).

Where the backward sums a value's cotangent over a mesh dim (an all_reduce the file states) and
the value's readers mix whole and partial cotangents (a tied weight read by a replicated lookup
and by a batch-split head), DTensor adds a whole one as a partial of its own, whole / n on each
rank, before the sum. The simulation runs every rank's pieces through autograd, where a whole
contribution is the same on every rank, so it divides that reader's by n likewise; reduced as it
is, it would count n times. Decided from the file's placements, reads, reductions and outputs.
"""

from __future__ import annotations

from typing import Any

from . import pieces as P


def counted_once(run: Any, name: str, reader: str | None) -> list:
    """The pieces of file value `name` as file value `reader` reads them (`run`: a `numeric._Run`)."""
    parts = run.pieces(name)
    if reader is None:
        return parts
    for dim, kind in run.reduced.get(name, []):
        if kind == "all_reduce" and whole(run, reader, dim):
            if not all(whole(run, r, dim) for r in run.readers.get(name, [])):
                parts = P.divide_in_backward(parts, run.mesh.sizes[dim])
    return parts


def whole(run: Any, name: str, dim: int) -> bool:
    """Whether value `name`'s cotangent is whole and the same on every rank of mesh dim `dim`:
    replicated there, and reduced at it, or a replicated output's, or each reader's contribution
    whole (a replicated reader's, or a cut R -> S whose cotangent the program gathers)."""
    key = (name, dim)
    if key not in run.whole:
        run.whole[key] = False  # ends a loop, which a program's values do not make
        run.whole[key] = _from_readers(run, name, dim)
    return run.whole[key]


def _from_readers(run: Any, name: str, dim: int) -> bool:
    v = run.values.get(name)
    if v is None or v["placements"][dim] != "R":
        return False
    if any(d == dim for d, _ in run.reduced.get(name, [])):
        return True
    given = [o["placements"][dim] for o in run.outputs if o["value"] == name]
    if any(not p.startswith(("R", "P")) for p in given):  # a Partial output's cotangent is given whole
        return False
    readers = run.readers.get(name, [])
    if not readers:
        return bool(given)
    return all((r, dim) in run.gathered or (run.values[r]["kind"] != "move" and whole(run, r, dim)) for r in readers)
