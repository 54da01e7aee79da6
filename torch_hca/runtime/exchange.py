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
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_hca._torch_private import default_store
from torch_hca.errors import CheckError

# Per topic, the round each rank is at: equal on every rank that runs the same program.
_rounds: dict[str, itertools.count] = collections.defaultdict(itertools.count)
# Per topic, this rank's key of the previous round: deleted once every peer has moved past it.
_previous: dict[str, str] = {}
# Per topic, the last round this rank posted.
_posted: dict[str, int] = {}


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
        CheckError after the mesh's timeout, naming it, and a peer that waits at another check
        for this rank (one rank evaluates while the other trains) is one within a second."""
        from torch_hca.runtime.mesh import timeout_s as mesh_timeout_s, timeout_setting

        timeout = mesh_timeout_s() if timeout_s is None else timeout_s
        store, rank = default_store(), dist.get_rank()
        keys = [self.prefix + str(r) for r in self.peers]
        before = store.timeout
        # Where this rank waits, for a peer waiting elsewhere to read: posted only once a wait runs
        # past its first slice, so a check whose peers are on time costs no extra round trip.
        here = f"{self.topic}\t{self.prefix}\t{','.join(map(str, self.peers))}\t{what}\t{_mode()}"
        at_posted = False
        deadline = time.monotonic() + timeout
        try:
            while True:
                store.set_timeout(datetime.timedelta(seconds=max(0.01, min(WAIT_SLICE_S, deadline - time.monotonic()))))
                try:
                    values = store.multi_get(keys) if keys else []  # waits for every key: one round trip
                    break
                except Exception as e:
                    if not at_posted:
                        store.set(f"hca/at/{rank}", here)
                        at_posted = True
                    late = [r for r, k in zip(self.peers, keys) if not store.check([k])]
                    if mismatch := _waiting_elsewhere(store, rank, late, what):
                        here = None  # our place stays posted: the peer waiting for us reads it and stops too
                        raise mismatch from None
                    if time.monotonic() >= deadline:
                        raise CheckError(
                            f"{what}: rank(s) {late or self.peers} did not get there within {timeout:.0f} s (rank "
                            f"{rank} did). Either they are late (still starting, compiling or in a long step: raise "
                            f"the timeout with {timeout_setting()}) or they run a different program (another plan, "
                            "input or branch)"
                        ) from e
        finally:
            store.set_timeout(before)
            if at_posted and here is not None:
                store.set(f"hca/at/{rank}", "-")
        texts = {r: v.decode() for r, v in zip(self.peers, values)}
        # Every peer has posted this round, so each has read our previous key.
        if self.topic in _previous:
            store.delete_key(_previous[self.topic])
        _previous[self.topic] = self.prefix + str(rank)
        return texts


WAIT_SLICE_S = 1.0  # how often a waiting rank looks where its late peers wait


def _mode() -> str:
    return "training" if torch.is_grad_enabled() else "no_grad"


def _waiting_elsewhere(store, rank: int, late: list[int], what: str) -> CheckError | None:
    """A CheckError if a late peer waits, at another check, for a post of this rank's that has not
    been made: each rank waits for the other, so neither will get there (not a late rank)."""
    for r in late:
        key = f"hca/at/{r}"
        at = store.get(key).decode() if store.check([key]) else "-"
        if at == "-":
            continue
        topic, prefix, peers, their_what, their_mode = at.split("\t")
        round_ = int(prefix.split("/")[-2])
        if str(rank) not in peers.split(",") or _posted.get(topic, -1) >= round_:
            continue  # it does not wait for us, or for a post we made (it is about to go on)
        return CheckError(
            f"{what}: rank {rank} is calling a different graph from rank {r}: rank {rank} waits at {what} "
            f"({_mode()}) and rank {r} at {their_what} ({their_mode}), each for the other, so neither would get "
            "there. A sharded model is one program over every rank: every rank must make the same calls, e.g. "
            "not `if rank == 0: evaluate(model)`. Evaluate on every rank (each passes its piece of the batch), or "
            "on one device: gather a full state dict (model.save_pretrained(path) on every rank, or "
            "hca.save) and load it into an unsharded model"
        )
    return None


def post(topic: str, text: str, peers: Iterable[int]) -> Posted:
    """Post `text` under `topic` for this round without waiting: `collect` reads the peers' later,
    so that work in between hides the wait (the input check runs the forward meanwhile)."""
    store, rank = default_store(), dist.get_rank()
    _posted[topic] = round_ = next(_rounds[topic])
    prefix = f"hca/{topic}/{round_}/"
    store.set(prefix + str(rank), text)
    return Posted(topic, prefix, sorted(set(peers) - {rank}))
