"""Where an `hca.collectives` call runs, and the check that its group's ranks make the same call.

`where_of` resolves the group argument (a ProcessGroup, a group name, a DeviceMesh
dimension, or the world) to its name, this rank's rank in it and its size.
`agree` is the cross-rank check each eager call goes through before gloo sees it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torch_hca._torch_private import group_members, group_rank, group_size
from torch_hca.errors import CollectiveError, MeshError
from torch_hca.runtime.exchange import exchange, needs_exchange
from torch_hca.runtime.mesh import current_mesh
from torch_hca.spmd.collective_kinds import RULES
from torch_hca.spmd.placements import dtype_str

Tensor = torch.Tensor


# ----------------------------------------------------------------- groups


@dataclass(frozen=True)
class Where:
    group_name: str
    rank: int
    size: int


def where_of(group: Any, mesh_dim: int | str | None) -> Where:
    """The group to communicate over: a ProcessGroup, a group name, a DeviceMesh
    dimension (``group=mesh, mesh_dim=...``, or the current mesh), or the world."""
    if isinstance(group, str):
        try:
            return Where(group, group_rank(group), group_size(group))
        except Exception:
            raise MeshError(
                f"hca.collectives: group={group!r} names no process group of this process; pass a ProcessGroup, "
                "a DeviceMesh with mesh_dim=, or the group_name of one"
            ) from None
    if not dist.is_initialized():
        raise MeshError(
            "hca.collectives: no process group is initialized; run under torchrun or "
            "hca.launch, and call hca.init_mesh() first"
        )
    if group is None and mesh_dim is not None:
        group = current_mesh()
        if group is None:
            raise MeshError(f"hca.collectives: mesh_dim={mesh_dim!r} given but no mesh; call hca.init_mesh(...) first")
    if hasattr(group, "get_group"):  # a DeviceMesh
        group = group.get_group(_mesh_dim(group, mesh_dim))
    group = dist.group.WORLD if group is None else group
    if not isinstance(group, dist.ProcessGroup):
        raise MeshError(
            f"hca.collectives: group={group!r} is not a group; pass a ProcessGroup, a DeviceMesh (with mesh_dim=), "
            "a group name, or nothing for the world"
        )
    return Where(group.group_name, dist.get_rank(group), dist.get_world_size(group))


def _mesh_dim(mesh: Any, mesh_dim: int | str | None) -> int | str:
    names = tuple(mesh.mesh_dim_names or ())
    if mesh_dim is None:
        return 0
    if isinstance(mesh_dim, str) and mesh_dim in names:
        return mesh_dim
    if isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool) and 0 <= mesh_dim < mesh.ndim:
        return mesh_dim
    raise MeshError(
        f"hca.collectives: mesh_dim={mesh_dim!r} is not a dimension of the {mesh.ndim}-D mesh "
        f"{tuple(mesh.shape)}; use 0..{mesh.ndim - 1}" + (f" or one of the names {names}" if names else "")
    )


# ------------------------------------------------------ cross-rank agreement

# gloo aborts the process (SIGABRT) when the ranks of a group disagree on a
# collective's size or dtype, and waits for a rank that never calls. So before
# gloo sees a call, the group's ranks post what they are about to do through the
# store and compare: a mismatch is a CollectiveError naming the ranks, a rank
# that never comes a CheckError naming it after `torch_hca.runtime.mesh.timeout_s()`.
# Only eagerly: under torch.compile the graph was traced from a checked program.
# Per call, not per distinct call: a rank-dependent shape alternates between
# shapes every rank has already shown (an uneven last batch), so a cache of
# checked signatures would let the abort through.

_unchecked_depth = 0


@contextlib.contextmanager
def unchecked():
    """Skip the cross-rank check of each call inside this block.

    The check costs one store exchange per eager call (about 1 ms on 2 gloo
    ranks, docs/reliability.md). Use this only around calls known to agree on
    every rank: a disagreement then aborts the process in gloo, or hangs.
    """
    global _unchecked_depth
    _unchecked_depth += 1
    try:
        yield
    finally:
        _unchecked_depth -= 1


def _plan_text(plan: tuple) -> str:
    steps = (f"{k.value}({', '.join(f'{n}={v}' for n, v in params)})" for k, params in plan)
    return " then ".join(steps) or "nothing"


def _communicates(plan: tuple) -> bool:
    return any(RULES[kind].communicates for kind, _ in plan)


def agree(where: Where, direction: str, plan: tuple, x: Tensor, then: tuple = ()) -> None:
    """Every rank of the group is about to run `plan` on a tensor of x's shape and dtype, or raise."""
    if torch.compiler.is_compiling() or _unchecked_depth or not _communicates(plan) or not needs_exchange():
        return
    call = f"{direction} {_plan_text(plan)} on {dtype_str(x.dtype)}{list(x.shape)}"
    if direction == "forward":
        call += f", backward {_plan_text(then)}"  # the roles: dst R and I differ only here
    members = group_members(where.group_name)
    group = "the world" if len(members) == dist.get_world_size() else f"group {where.group_name} (ranks {members})"
    texts = exchange(f"collectives/{where.group_name}", call, members, f"hca.collectives ({call}) over {group}")
    texts[dist.get_rank()] = call
    if len(set(texts.values())) == 1:
        return
    calls: dict[str, list[int]] = {}
    for r in sorted(texts):
        calls.setdefault(texts[r], []).append(r)
    raise CollectiveError(
        f"hca.collectives: the ranks of {group} disagree on the collective they call: "
        + "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {c}" for c, rs in calls.items())
        + ". Every rank of the group must make the same call (op, roles, root or shift) on a tensor of the "
        "same local shape and dtype (gloo would abort the process); look for a rank-dependent shape, such as "
        "an uneven last batch, or a rank-dependent branch"
    )
