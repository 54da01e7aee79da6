"""Before a compiled graph first runs, check every rank would issue the same collectives.

Ranks that compiled different programs (another batch size on one rank, a
rank-dependent branch) would otherwise meet in mismatched collectives: gloo
aborts the process or the job hangs. Each rank posts its graph's collective
sequence to the rendezvous store (text, no pickle, no collective) and reads
the others'; a difference is a `CheckError` naming the first differing
collective on both sides, a rank that never posts is one after the timeout.
"""

from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist
import torch.fx as fx

from ._torch_private import default_store, group_members
from .collective_kinds import OPS
from .errors import CheckError

TIMEOUT_S = 120.0
_first_runs = itertools.count()  # one per compiled graph's first run, in the same order on every rank


def collective_sequence(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The graph's collectives in issue order: (group name, kind dtype shape)."""
    seq = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in OPS:
            info = OPS[node.target]
            vals = node.meta.get("val")
            vals = vals if isinstance(vals, (list, tuple)) else [vals]
            shapes = "+".join(f"{getattr(v, 'dtype', '?')}{tuple(getattr(v, 'shape', ()))}" for v in vals)
            seq.append((str(node.args[info.group_arg]), f"{info.kind.value} {shapes}".replace("torch.", "")))
    return seq


def _per_group(sequence: list[tuple[str, str]]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for group, desc in sequence:
        groups.setdefault(group, []).append(desc)
    return groups


def _needs_exchange() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def check_same_collectives(sequence: list[tuple[str, str]], what: str) -> None:
    """Raise `CheckError` unless every member of each group this graph uses issues that group's collectives alike.

    Group names are per rank (on a 2-D mesh, ranks 0-1 and 2-3 hold different tp
    groups), so each rank compares a group's sequence only with that group's members.
    """
    if not _needs_exchange():
        return
    store, rank = default_store(), dist.get_rank()
    prefix = f"hca/first_run/{next(_first_runs)}/"
    store.set(prefix + str(rank), "\n".join(f"{g}\t{d}" for g, d in sequence))  # every rank posts
    mine = _per_group(sequence)
    peers = sorted({r for g in mine for r in group_members(g)} - {rank})
    try:
        store.wait([prefix + str(r) for r in peers], datetime.timedelta(seconds=TIMEOUT_S))
    except Exception as e:
        raise CheckError(
            f"{what}: not every rank ran its compiled graph within {TIMEOUT_S:.0f} s ({e}); "
            "the ranks are running different programs"
        ) from e
    for other in peers:
        lines = [line.split("\t", 1) for line in store.get(prefix + str(other)).decode().split("\n") if line]
        theirs = _per_group([(g, d) for g, d in lines])
        for group, seq in mine.items():
            if other in group_members(group) and theirs.get(group, []) != seq:
                raise CheckError(_describe_difference(f"{what}, group {group}", rank, seq, other, theirs.get(group, [])))


def _describe_difference(what: str, rank: int, mine: list[str], other: int, theirs: list[str]) -> str:
    i = next(i for i in range(max(len(mine), len(theirs))) if i >= len(mine) or i >= len(theirs) or mine[i] != theirs[i])
    ours = mine[i] if i < len(mine) else "no collective"
    other_one = theirs[i] if i < len(theirs) else "no collective"
    return (
        f"{what}: rank {rank} and rank {other} compiled different collectives; the first difference is "
        f"collective #{i}: rank {rank} issues {ours}, rank {other} issues {other_one}. Give every rank "
        "the same local shapes (e.g. the same batch size per rank) and no rank-dependent branches"
    )
