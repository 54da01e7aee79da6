"""Before a compiled graph first runs, check every rank would issue the same collectives.

Ranks that compiled different programs (another batch size on one rank, a
rank-dependent branch) would otherwise meet in mismatched collectives: gloo
aborts the process or the job hangs. Each rank posts its graph's collective
sequence per group (from the schedule checker's summary) through
`torch_hca.exchange` and reads the others'; a difference is a `CheckError` naming the first differing
collective on both sides, a rank that never posts is one after the mesh's timeout.
"""

from __future__ import annotations

import torch.distributed as dist

from ._torch_private import group_members
from .errors import CheckError
from .exchange import exchange, needs_exchange


def check_same_collectives(mine: dict[str, list[str]], what: str) -> None:
    """Raise `CheckError` unless every member of each group this graph uses issues that group's collectives alike.

    ``mine``: group name -> its collectives in issue order (the schedule
    checker's `ScheduleSummary.per_group`). Group names are per rank (on a 2-D
    mesh, ranks 0-1 and 2-3 hold different tp groups), so each rank compares a
    group's sequence only with that group's members.
    """
    if not needs_exchange():
        return
    rank = dist.get_rank()
    text = "\n".join(f"{g}\t{d}" for g, seq in mine.items() for d in seq)
    peers = {r for g in mine for r in group_members(g)}
    for other, posted in exchange("first_run", text, peers, f"{what} (first run)").items():
        theirs: dict[str, list[str]] = {}
        for line in filter(None, posted.split("\n")):
            group, desc = line.split("\t", 1)
            theirs.setdefault(group, []).append(desc)
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
