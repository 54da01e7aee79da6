"""Each rank's rows and predicted step under a deployment (``hca.sharded(..., deployment=)``).

With the batch cut by shares, the report says what the deployment predicts (``fixed_s + rows /
speed`` per rank, `hca.Deployment.step_s`) for the cut that runs, for the even cut, and for the
deployment's own best cut (`hca.Deployment.shares`): why the shares are what they are, or that
they are not the best. Read from the module's spec and its last call's rows; nothing is solved.
"""

from __future__ import annotations

from typing import Any


def _ranks_along(mesh: Any, mesh_dim: int) -> list[int]:
    """The global ranks on this rank's line of `mesh_dim`, in mesh order."""
    index = list(mesh.get_coordinate() or [0] * mesh.ndim)
    index[mesh_dim] = slice(None)
    return mesh.mesh[tuple(index)].flatten().tolist()


def per_rank(uneven: Any, spec: Any, local_rows: int | None) -> dict | None:
    """The deployment's view of a graph cut by `uneven` (`UnevenShares`), this rank holding
    `local_rows`; None without a deployment or a call."""
    dep = getattr(spec, "deployment", None)
    if dep is None or local_rows is None or uneven is None:
        return None
    ranks = _ranks_along(spec.mesh, uneven.mesh_dim)
    unit = local_rows / uneven.shares[uneven.coordinate]
    rows = [round(s * unit) for s in uneven.shares]
    total, n = sum(rows), len(rows)
    best = list(dep.shares(total, ranks)) if total >= 2 * n else None
    return {
        "ranks": ranks,
        "rows": rows,
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
    text = (
        f"by the deployment{when}, {what}: {each}; slowest {cost(max(view['predicted_s']))}, "
        f"the even cut's {cost(view['even_s'])}"
    )
    best = view["best_rows"]
    if best is None:
        return text
    if best == view["rows"]:
        return text + "; this is the deployment's best cut"
    return text + f"; the deployment's best cut {':'.join(map(str, best))}: {cost(view['best_s'])}"
