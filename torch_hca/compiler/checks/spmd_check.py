"""Before a compiled graph first runs, check every rank would issue the same collectives.

Ranks that compiled different programs (another batch size on one rank, a
rank-dependent branch) would otherwise meet in mismatched collectives: gloo
aborts the process or the job hangs. Each rank posts its graph's collective
sequence per group (from the schedule checker's summary) through
`torch_hca.runtime.exchange` and reads the others'; a difference is a `CheckError` naming the first differing
collective on both sides, a rank that never posts is one after the mesh's timeout.
"""

from __future__ import annotations

import torch.distributed as dist

from torch_hca._torch_private import group_members
from torch_hca.errors import CheckError
from torch_hca.runtime.exchange import exchange, first_difference, needs_exchange


def check_same_collectives(mine: dict[str, list[str]], what: str) -> dict[str, dict[int, list[str]]]:
    """Raise `CheckError` unless every member of each group this graph uses issues that group's collectives alike;
    else each group's sequence as each of its members posted it (group -> rank -> sequence: the
    strategy file's per-rank orders; without peers, this rank's alone).

    ``mine``: group name -> its collectives in issue order (the schedule
    checker's `ScheduleSummary.per_group`). Group names are per rank (on a 2-D
    mesh, ranks 0-1 and 2-3 hold different tp groups), so a pair of ranks is
    compared on the groups both belong to. Every rank posts (a graph with no
    collective too) and judges every pair, so all ranks reach the same verdict:
    none goes on to wait in a collective its peers will never issue.
    """
    if not needs_exchange():
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {group: {rank: list(seq)} for group, seq in mine.items()}
    rank = dist.get_rank()
    # Each group's members travel with it: a rank outside a group cannot look its name up.
    members = [f"#{g}\t{','.join(map(str, group_members(g)))}" for g in mine]
    text = "\n".join(members + [f"{g}\t{d}" for g, seq in mine.items() for d in seq])
    posted = exchange("first_run", text, range(dist.get_world_size()), f"{what} (first run)")
    posted[rank] = text
    per_rank: dict[int, dict[str, list[str]]] = {}
    in_group: dict[tuple[int, str], set[int]] = {}  # (rank, group) -> the members that rank sees
    for r, t in sorted(posted.items()):
        per_rank[r] = {}
        for line in filter(None, t.split("\n")):
            group, desc = line.split("\t", 1)
            if group.startswith("#"):
                in_group[r, group[1:]] = {int(m) for m in desc.split(",")}
            else:
                per_rank[r].setdefault(group, []).append(desc)
    for a in sorted(per_rank):
        for b in sorted(per_rank):
            if a == b:
                continue
            for group, seq in per_rank[a].items():
                theirs = per_rank[b].get(group, [])
                if b in in_group.get((a, group), ()) and theirs != seq:
                    first, second = (a, b) if a < b else (b, a)
                    seqs = {a: seq, b: theirs}
                    raise CheckError(
                        _describe_difference(f"{what}, group {group}", first, seqs[first], second, seqs[second])
                    )
    return {
        group: {r: per_rank[r].get(group, []) for r in sorted(per_rank) if r in in_group.get((rank, group), ())}
        for group in mine
    }


def _describe_difference(what: str, rank: int, mine: list[str], other: int, theirs: list[str]) -> str:
    i, ours, other_one = first_difference(mine, theirs, "no collective")
    return (
        f"{what}: rank {rank} and rank {other} compiled different collectives; the first difference is "
        f"collective #{i}: rank {rank} issues {ours}, rank {other} issues {other_one}. Give every rank "
        "the same local shapes (e.g. the same batch size per rank) and no rank-dependent branches"
    )
