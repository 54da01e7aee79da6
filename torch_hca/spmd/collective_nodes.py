"""Collective nodes read back from graphs (and from the dispatcher), each op by its schema.

`OPS` maps every `_c10d_functional` collective op to the kind it carries
(`collective_kinds.Kind`), which of its tensors is the payload, and where its
group argument sits. The report, the timeline, the buckets, the scheduler,
the schedule check and the transpose pass read a node through these helpers;
nobody indexes ``node.args`` for a group or sums payload bytes on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._torch_private import group_size
from ..errors import CheckError
from .collective_kinds import Kind, bytes_per_rank

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class OpInfo:
    kind: Kind
    payload: str  # which tensor is the full logical buffer: "input" or "output"
    group_arg: int  # position of the group name argument
    coalesced: bool = False  # takes and returns a list of tensors


# Keyed by OpOverload, never by name. Coalesced forms count as one collective
# per tensor they carry (the wire sees the same bytes). An op serves several
# kinds (all_reduce also emits reduce and scaled all_reduce; all_to_all_single
# also emits permute); a graph reports it under its main kind.
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


def payload_tensors(op, inputs, output) -> list:
    """The tensors that are a collective's payload (the full logical buffers), as a list.

    ``inputs`` is the op's first argument and ``output`` its result: real
    tensors at run time, or the fake values ``node.meta["val"]`` in a graph.
    """
    info = OPS[op]
    chosen = inputs if info.payload == "input" else output
    return list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]


def node_kind(node) -> Kind:
    """The kind of a collective node of an FX graph."""
    return OPS[node.target].kind


def node_group(node) -> str:
    """The process group a collective node runs on, bound by the op's schema (positional or keyword)."""
    i = OPS[node.target].group_arg
    return str(node.args[i] if i < len(node.args) else node.kwargs[node.target._schema.arguments[i].name])


def node_payload(node) -> list:
    """`payload_tensors` for a collective node of an FX graph, from its recorded values."""
    first = node.args[0]
    inputs = [a.meta.get("val") for a in first] if isinstance(first, (list, tuple)) else first.meta.get("val")
    return payload_tensors(node.target, inputs, node.meta.get("val"))


class CollectiveCounter(TorchDispatchMode):
    """Counts the `_c10d_functional` collectives the dispatcher sees while active.

    ``counts``: collectives by kind; ``wire_bytes``: bytes one rank sent (ring model).
    Collectives inside a compiled graph are not seen: count those from the report.
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.wire_bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        info = OPS.get(func)
        if info is not None:
            tensors = payload_tensors(func, args[0], out)
            n = group_size(args[info.group_arg])
            self.counts[info.kind.value] = self.counts.get(info.kind.value, 0) + len(tensors)
            self.wire_bytes += sum(bytes_per_rank(info.kind, nbytes(t), n) for t in tensors)
        return out


def nbytes(t) -> int:
    """Bytes a tensor (real or fake) holds; 0 for anything else."""
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def payload_bytes(node) -> int:
    """Payload bytes of a collective node of an FX graph (its full logical buffers)."""
    return sum(nbytes(v) for v in node_payload(node))
