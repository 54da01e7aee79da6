"""The collective kinds the backend emits and reads, each defined once.

For every kind: the placements it maps between, its transpose (DESIGN.md
section 1), the `_c10d_functional` ops that implement it, and the bytes one
rank puts on the wire in a ring implementation, as a function of the payload
S (the full logical buffer) and the group size n.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import CheckError

c10d = torch.ops._c10d_functional


class Kind(enum.Enum):
    BROADCAST = "broadcast"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class KindRule:
    kind: Kind
    placements: str          # "src -> dst"
    transpose: Kind | None   # None: R -> P, no communication (deferred role)
    wire_bytes: Callable[[int, int], float]  # (payload S, group size n) -> bytes per rank


# broadcast: R(root) -> R         transpose: sum-reduce to root (all_reduce then drop)
# all_reduce: P -> R              transpose: none (R -> P, deferred) or all_reduce (eager role)
# all_gather: S(d) -> R           transpose: reduce_scatter P -> S(d)
# reduce_scatter: P -> S(d)       transpose: all_gather S(d) -> R
# all_to_all: S(a) -> S(b)        transpose: all_to_all S(b) -> S(a)
RULES: dict[Kind, KindRule] = {
    Kind.BROADCAST: KindRule(Kind.BROADCAST, "R(root) -> R", Kind.ALL_REDUCE, lambda s, n: s * (n - 1) / n),
    Kind.ALL_REDUCE: KindRule(Kind.ALL_REDUCE, "P -> R", None, lambda s, n: 2 * s * (n - 1) / n),
    Kind.ALL_GATHER: KindRule(Kind.ALL_GATHER, "S(d) -> R", Kind.REDUCE_SCATTER, lambda s, n: s * (n - 1) / n),
    Kind.REDUCE_SCATTER: KindRule(Kind.REDUCE_SCATTER, "P -> S(d)", Kind.ALL_GATHER, lambda s, n: s * (n - 1) / n),
    Kind.ALL_TO_ALL: KindRule(Kind.ALL_TO_ALL, "S(a) -> S(b)", Kind.ALL_TO_ALL, lambda s, n: s * (n - 1) / n),
}


@dataclass(frozen=True)
class OpInfo:
    kind: Kind
    payload: str  # which tensor is the full logical buffer: "input" or "output"
    group_arg: int  # position of the group name argument
    coalesced: bool = False  # takes and returns a list of tensors


# Keyed by OpOverload, never by name. Coalesced forms count as one collective
# per tensor they carry (the wire sees the same bytes).
OPS: dict[torch._ops.OpOverload, OpInfo] = {}


def _register(op, info: OpInfo) -> None:
    if op in OPS:
        raise CheckError(f"collective op {op} registered twice")
    OPS[op] = info


_register(c10d.all_reduce.default, OpInfo(Kind.ALL_REDUCE, "input", 2))
_register(c10d.all_reduce_coalesced.default, OpInfo(Kind.ALL_REDUCE, "input", 2, coalesced=True))
_register(c10d.all_gather_into_tensor.default, OpInfo(Kind.ALL_GATHER, "output", 2))
_register(c10d.all_gather_into_tensor_coalesced.default, OpInfo(Kind.ALL_GATHER, "output", 2, coalesced=True))
_register(c10d.reduce_scatter_tensor.default, OpInfo(Kind.REDUCE_SCATTER, "input", 3))
_register(c10d.reduce_scatter_tensor_coalesced.default, OpInfo(Kind.REDUCE_SCATTER, "input", 3, coalesced=True))
_register(c10d.all_to_all_single.default, OpInfo(Kind.ALL_TO_ALL, "input", 3))
_register(c10d.broadcast.default, OpInfo(Kind.BROADCAST, "input", 2))

WAIT = c10d.wait_tensor.default


def is_collective(target) -> bool:
    return target in OPS
