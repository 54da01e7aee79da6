"""Each rank's rows and predicted step under a deployment (``hca.sharded(..., deployment=)``).

With the batch cut by rows (by shares, or evenly), the report says what the deployment predicts
(``fixed_s + rows / speed`` per rank, `hca.Deployment.step_s`) for the cut that runs, for the
even cut, and for the deployment's own best cut (`hca.Deployment.shares`, which an even cut is
told how to ask for): why the shares are what they are, or that they are not the best. Read from
the module's spec, its last call's rows under shares and the layout's record of its inputs;
nothing is solved here.
"""

from __future__ import annotations

from typing import Any

from torch_hca.report.parallelism import INPUT_WHY, placements
from torch_hca.spmd.chunks import piece_size


def _ranks_along(mesh: Any, mesh_dim: int) -> list[int]:
    """The global ranks on this rank's line of `mesh_dim`, in mesh order."""
    index = list(mesh.get_coordinate() or [0] * mesh.ndim)
    index[mesh_dim] = slice(None)
    return mesh.mesh[tuple(index)].flatten().tolist()


def _even_cut(g: Any) -> tuple[int, int] | None:
    """(mesh dim, whole rows) of the batch an even-cut graph's inputs are split by rows over, from
    the layout's record of its inputs; None where no input is cut by rows on one mesh dim."""
    for r in g.layout.values:
        if r.why in INPUT_WHY and r.shape:
            dims = [d for d, p in enumerate(placements(r.placement)) if p == "S(0)"]
            if len(dims) == 1:
                return dims[0], int(r.shape[0])
    return None


def per_rank(g: Any, spec: Any, local_rows: int | None) -> dict | None:
    """The deployment's view of graph report `g`: under shares (this rank holding `local_rows`)
    the cut that runs, else the even cut of its inputs' rows; None without a deployment, or
    without a batch cut by rows."""
    dep = getattr(spec, "deployment", None)
    if dep is None:
        return None
    if g.uneven is not None:
        if local_rows is None:
            return None
        ranks = _ranks_along(spec.mesh, g.uneven.mesh_dim)
        unit = local_rows / g.uneven.shares[g.uneven.coordinate]
        rows = [round(s * unit) for s in g.uneven.shares]
    else:
        cut = _even_cut(g)
        if cut is None:
            return None
        ranks = _ranks_along(spec.mesh, cut[0])
        rows = [piece_size(cut[1], len(ranks), i) for i in range(len(ranks))]  # DTensor's even Shard
    total, n = sum(rows), len(rows)
    best = list(dep.shares(total, ranks)) if total >= 2 * n else None
    return {
        "ranks": ranks,
        "rows": rows,
        "cut": "shares" if g.uneven is not None else "even",
        "unit": dep.unit,
        "measured_at": dep.measured_at,
        "predicted_s": list(dep.step_s(rows, ranks)),
        "even_s": max(dep.step_s([total / n] * n, ranks)),
        "best_rows": best,
        "best_s": max(dep.step_s(best, ranks)) if best else None,
        "deployment": dep.to_dict(),
    }


def sentence(view: dict) -> str:
    """The view as one clause of the parallelism sentence."""
    timed = view["unit"] == "rows/s"

    def cost(t: float) -> str:
        return f"{t * 1e3:.3g} ms" if timed else f"{t:.3g}"

    when = f", measured {view['measured_at']}" if view["measured_at"] else ""
    what = "predicted step" if timed else f"relative time (rows / speed in {view['unit']})"
    each = ", ".join(
        f"rank {r} {n} rows {cost(t)}" for r, n, t in zip(view["ranks"], view["rows"], view["predicted_s"])
    )
    text = f"by the deployment{when}, {what}: {each}; slowest {cost(max(view['predicted_s']))}"
    if view["cut"] == "shares":
        text += f", the even cut's {cost(view['even_s'])}"
    best = view["best_rows"]
    if best is None:
        return text
    if best == view["rows"]:
        return text + "; this is the deployment's best cut"
    text += f"; the deployment's best cut {':'.join(map(str, best))}: {cost(view['best_s'])}"
    if view["cut"] == "even":  # the inputs are cut evenly: say how to cut them by the deployment
        text += f" (inputs=hca.Shard(0, shares={tuple(best)}), each rank its rows)"
    return text
