"""What one training step communicates and allocates, read from `torch.profiler`.

Every way of training a model here reaches the process group through the same
c10d dispatcher ops (``c10d::allreduce_``, ``c10d::_allgather_base_``, ...):
functional collectives, DTensor, DDP's reducer, FSDP2, and Inductor's and
hca's compiled graphs alike. So one profiled step counts every contestant's
collectives the same way, with no hook inside any of them::

    with StepProfile(world_size) as prof:
        step()
    prof.wire_bytes, prof.collectives, prof.by_kind, prof.peak_alloc_bytes

Bytes are those one rank sends in a ring implementation
(`collective_kinds.bytes_per_rank`) of the logical collective, not what the
backend does underneath (gloo runs a reduce-scatter as a whole all-reduce).
"""

from __future__ import annotations

import math

from torch.profiler import ProfilerActivity, profile

from .._torch_private import ProfiledEvent, profiled_events
from ..spmd.collective_kinds import Kind, bytes_per_rank

# c10d op -> (its kind, the argument whose bytes are `bytes_per_rank`'s payload:
# the full buffer for gathers and reductions, this rank's buffer for all_to_all).
C10D_OPS = {
    "c10d::allreduce_": (Kind.ALL_REDUCE, 0),
    "c10d::allreduce_coalesced_": (Kind.ALL_REDUCE, 0),
    "c10d::_allgather_base_": (Kind.ALL_GATHER, 0),
    "c10d::allgather_into_tensor_coalesced_": (Kind.ALL_GATHER, 0),
    "c10d::_reduce_scatter_base_": (Kind.REDUCE_SCATTER, 1),
    "c10d::reduce_scatter_tensor_coalesced_": (Kind.REDUCE_SCATTER, 1),
    "c10d::alltoall_base_": (Kind.ALL_TO_ALL, 1),
    "c10d::broadcast_": (Kind.BROADCAST, 0),
}

# The profiler's dtype names (C++ scalar type names) -> bytes per element.
_ITEMSIZE = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


class StepProfile:
    """Collectives and CPU allocations while active (one training step).

    After exit: ``collectives`` (c10d ops issued; a coalesced op is one),
    ``by_kind`` ({kind: count}), ``wire_bytes`` (ring-model bytes one rank
    sent), ``peak_alloc_bytes`` (highest running total of CPU allocator
    allocations minus frees, over allocations made while active), and
    ``unknown`` (c10d ops whose bytes are not counted, by name).
    """

    def __init__(self, world_size: int):
        self.n = world_size
        self.collectives, self.wire_bytes, self.peak_alloc_bytes = 0, 0.0, 0
        self.by_kind: dict[str, int] = {}
        self.unknown: dict[str, int] = {}
        self.notes: list[str] = []
        self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True)

    def __enter__(self) -> "StepProfile":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            events = profiled_events(self._prof)
            self._count_collectives(events)
            self._peak_memory(events)
        return False

    def _count_collectives(self, events: list[ProfiledEvent]) -> None:
        list_itemsize = self._list_itemsize(events)
        for e in events:
            name = e.name
            if not name.startswith("c10d::"):
                continue
            self.collectives += 1
            if name not in C10D_OPS:
                if name != "c10d::barrier":
                    self.unknown[name] = self.unknown.get(name, 0) + 1
                self.by_kind[name] = self.by_kind.get(name, 0) + 1
                continue
            kind, arg = C10D_OPS[name]
            shape, dtype = e.shapes[arg], e.dtypes[arg]
            if dtype == "TensorList":
                payload = sum(math.prod(s) for s in shape) * list_itemsize
            else:
                payload = math.prod(shape) * self._itemsize(dtype)
            self.by_kind[kind.value] = self.by_kind.get(kind.value, 0) + 1
            self.wire_bytes += bytes_per_rank(kind, payload, self.n)

    def _list_itemsize(self, events: list[ProfiledEvent]) -> int:
        """Element size for tensor-list arguments, whose dtype the profiler does not record.

        The backend's own events (``gloo:all_reduce``, ...) do record it: one
        dtype across them all is that size; mixed dtypes fall back to 4 bytes.
        """
        dtypes = {d for e in events if e.name.startswith(("gloo:", "nccl:")) for d in e.dtypes if d}
        if len(dtypes) == 1:
            return self._itemsize(dtypes.pop())
        if dtypes:
            self.notes.append(f"collectives on mixed dtypes {sorted(dtypes)}: tensor-list payloads counted at 4 bytes")
        return 4

    def _itemsize(self, dtype: str) -> int:
        if dtype not in _ITEMSIZE:
            self.notes.append(f"collective on dtype {dtype!r}: counted at 4 bytes per element")
        return _ITEMSIZE.get(dtype, 4)

    def _peak_memory(self, events: list[ProfiledEvent]) -> None:
        total = peak = 0
        allocs = sorted((e.start_ns, e.nbytes) for e in events if e.name == "[memory]" and e.on_cpu)
        for _, nbytes in allocs:
            total += nbytes
            peak = max(peak, total)
        self.peak_alloc_bytes = peak
