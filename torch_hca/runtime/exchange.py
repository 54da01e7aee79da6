"""One cross-rank exchange of short texts through the rendezvous store.

Every check that ranks must agree on (the collectives a compiled graph issues,
the inputs of a step, the plan a module was sharded with, the collective
rewrites they apply) goes through `exchange`: each rank posts one text under
a topic and round, waits for its peers' and reads them. No collective runs
(nothing interleaves with the programs' own collectives), nothing is pickled,
and a peer that never posts is an error naming it after the mesh's timeout
(`torch_hca.runtime.mesh.timeout_s`), not a hang.
"""

from __future__ import annotations

import collections
import datetime
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

from torch_hca._torch_private import default_store
from torch_hca.errors import CheckError

# Per topic, the round each rank is at: equal on every rank that runs the same program.
_rounds: dict[str, itertools.count] = collections.defaultdict(itertools.count)
# Per topic, this rank's key of the previous round: deleted once every peer has moved past it.
_previous: dict[str, str] = {}


def first_difference(mine: list[str], theirs: list[str], missing: str) -> tuple[int, str, str]:
    """(index, our line, their line) of the first place two ranks' posted lines differ; `missing` past an end."""
    i = next(
        i for i in range(max(len(mine), len(theirs))) if i >= len(mine) or i >= len(theirs) or mine[i] != theirs[i]
    )
    return i, mine[i] if i < len(mine) else missing, theirs[i] if i < len(theirs) else missing


def needs_exchange() -> bool:
    """False without a real multi-rank process group (one rank, or the fake one standing for all)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def exchange(topic: str, text: str, peers: Iterable[int], what: str, timeout_s: float | None = None) -> dict[int, str]:
    """Post `text` under `topic`; return each peer's text of the same round.

    ``what`` names the check in the error a missing peer raises. Every rank
    must call this for a topic the same number of times.
    """
    return post(topic, text, peers).collect(what, timeout_s)


@dataclass
class Posted:
    """One rank's post of one round, whose peers' texts `collect` waits for."""

    topic: str
    prefix: str
    peers: list[int]

    def collect(self, what: str, timeout_s: float | None = None) -> dict[int, str]:
        """Each peer's text of this round (waiting for them); a peer that never posts is a
        CheckError after the mesh's timeout, naming it."""
        from torch_hca.runtime.mesh import timeout_s as mesh_timeout_s

        timeout = mesh_timeout_s() if timeout_s is None else timeout_s
        store, rank = default_store(), dist.get_rank()
        keys = [self.prefix + str(r) for r in self.peers]
        before = store.timeout
        store.set_timeout(datetime.timedelta(seconds=timeout))  # client-side: no round trip
        try:
            values = store.multi_get(keys) if keys else []  # waits for every key: one round trip
        except Exception as e:
            store.set_timeout(before)
            late = [r for r, k in zip(self.peers, keys) if not store.check([k])]
            raise CheckError(
                f"{what}: rank(s) {late or self.peers} did not get there within {timeout:.0f} s (rank {rank} did). "
                "Either they are late (still starting, compiling or in a long step: raise the timeout with "
                "hca.init_mesh(timeout=...)) or they run a different program (another plan, input or branch)"
            ) from e
        store.set_timeout(before)
        texts = {r: v.decode() for r, v in zip(self.peers, values)}
        # Every peer has posted this round, so each has read our previous key.
        if self.topic in _previous:
            store.delete_key(_previous[self.topic])
        _previous[self.topic] = self.prefix + str(rank)
        return texts


def post(topic: str, text: str, peers: Iterable[int]) -> Posted:
    """Post `text` under `topic` for this round without waiting: `collect` reads the peers' later,
    so that work in between hides the wait (the input check runs the forward meanwhile)."""
    store, rank = default_store(), dist.get_rank()
    prefix = f"hca/{topic}/{next(_rounds[topic])}/"
    store.set(prefix + str(rank), text)
    return Posted(topic, prefix, sorted(set(peers) - {rank}))
