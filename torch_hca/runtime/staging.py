"""Host staging: collectives run on gloo through a pair of host buffers, bounded and reused.

A job whose ranks mix CPU and CUDA devices moves data between them over gloo, a CPU
transport: each collective a CUDA rank takes part in is copied to host memory, run there and
copied back. The emitter (`backends/staging.py`) replaces a graph's `_c10d_functional`
collectives by the ops below, which do that through two buffers of at most `cap_bytes` each
(pinned where CUDA is present, so the copies can use DMA), allocated once per process and
reused by every call: a 500 MB gradient all-reduce runs in slices of the buffer, not through
500 MB of fresh pinned memory. On a CPU-only job the same ops run with the copies host to
host (option `staging="on"`), which is how the tests exercise the path without a GPU.

The ops are synchronous: a staged collective does not overlap the compute after it. `stats()`
counts what went through (collectives by kind, bytes staged each way, buffer allocations),
which the tests assert and `bench` reports as the staging bandwidth.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from torch_hca._torch_private import process_group
from torch_hca.errors import UnsupportedError

DEFAULT_CAP_BYTES = 32 * 2**20  # two 32 MiB buffers: gloo's throughput here is flat above a few MiB

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided by the group's size after: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


@dataclass
class StagingStats:
    collectives: Counter = field(default_factory=Counter)  # kind -> calls
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    allocations: int = 0  # host buffers made: 2 per process while no collective needs more
    oversize: int = 0  # all_to_alls larger than the buffers, staged through memory of their own
    seconds: float = 0.0  # inside the staged ops, copies and collectives together


class HostBuffers:
    """A send and a receive buffer of `cap_bytes` each on the host, made on first use."""

    def __init__(self, cap_bytes: int = DEFAULT_CAP_BYTES):
        self.cap_bytes = cap_bytes
        self._send: Tensor | None = None
        self._recv: Tensor | None = None

    def pair(self, stats: StagingStats) -> tuple[Tensor, Tensor]:
        if self._send is None:
            pin = torch.cuda.is_available()  # pinned memory needs a CUDA context to register with
            self._send = torch.empty(self.cap_bytes, dtype=torch.uint8, pin_memory=pin)
            self._recv = torch.empty(self.cap_bytes, dtype=torch.uint8, pin_memory=pin)
            stats.allocations += 2
        return self._send, self._recv


_buffers = HostBuffers()
_stats = StagingStats()


def stats() -> StagingStats:
    """What the staged collectives of this process did since the last `reset`."""
    return _stats


def reset(cap_bytes: int | None = None) -> None:
    """Zero the counts; with `cap_bytes`, drop the buffers and use buffers of that size next."""
    global _buffers, _stats
    _stats = StagingStats()
    if cap_bytes is not None:
        if not (isinstance(cap_bytes, int) and cap_bytes >= 64):
            raise UnsupportedError(f"staging: cap_bytes must be an int of at least 64, got {cap_bytes!r}")
        _buffers = HostBuffers(cap_bytes)


def _typed(buf: Tensor, dtype: torch.dtype, numel: int) -> Tensor:
    return buf[: numel * dtype.itemsize].view(dtype)


def _slices(numel: int, per_slice: int):
    for start in range(0, numel, per_slice):
        yield start, min(numel, start + per_slice)


def _per_slice(dtype: torch.dtype, parts: int) -> int:
    """Elements a slice may carry when the receive buffer holds `parts` of them."""
    return max(1, _buffers.cap_bytes // (dtype.itemsize * parts))


def _run(kind: str, body) -> Tensor:
    start = time.perf_counter()
    out = body()
    _stats.collectives[kind] += 1
    _stats.seconds += time.perf_counter() - start
    return out


def _through_slices(x: Tensor, collective) -> Tensor:
    """`collective(piece)` on each slice of `x` copied into the send buffer, in place there, and
    the slices copied back: for the collectives whose result is `x`'s shape, element by element."""
    flat, out = x.contiguous().view(-1), torch.empty_like(x, memory_format=torch.contiguous_format)
    flat_out = out.view(-1)
    send, _ = _buffers.pair(_stats)
    for a, b in _slices(flat.numel(), _per_slice(x.dtype, 1)):
        piece = _typed(send, x.dtype, b - a)
        piece.copy_(flat[a:b])
        collective(piece)
        flat_out[a:b].copy_(piece)
    _stats.bytes_to_host += flat.numel() * x.dtype.itemsize
    _stats.bytes_from_host += flat.numel() * x.dtype.itemsize
    return out


def _all_reduce(x: Tensor, reduce_op: str, group_name: str) -> Tensor:
    if reduce_op not in _REDUCE_OPS:
        raise UnsupportedError(f"staging: all_reduce with reduce op {reduce_op!r}; staged are {sorted(_REDUCE_OPS)}")
    group = process_group(group_name)
    out = _through_slices(x, lambda piece: dist.all_reduce(piece, _REDUCE_OPS[reduce_op], group=group))
    return out.div_(group.size()) if reduce_op == "avg" else out


def _all_gather(x: Tensor, group_size: int, group_name: str) -> Tensor:
    """Rank blocks along dim 0, as `all_gather_into_tensor`: each slice of this rank's piece is
    gathered into the receive buffer and its n blocks copied to their places."""
    group = process_group(group_name)
    flat = x.contiguous().view(-1)
    m = flat.numel()
    out = torch.empty((group_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    flat_out = out.view(group_size, m)
    send, recv = _buffers.pair(_stats)
    for a, b in _slices(m, _per_slice(x.dtype, group_size)):
        mine, every = _typed(send, x.dtype, b - a), _typed(recv, x.dtype, group_size * (b - a))
        mine.copy_(flat[a:b])
        dist.all_gather_single(every, mine, group=group)
        flat_out[:, a:b].copy_(every.view(group_size, b - a))
    _stats.bytes_to_host += m * x.dtype.itemsize
    _stats.bytes_from_host += group_size * m * x.dtype.itemsize
    return out


def _reduce_scatter(x: Tensor, reduce_op: str, group_size: int, group_name: str) -> Tensor:
    """The sum of every rank's `x`, of which this rank keeps its block of dim 0: gloo has no
    reduce-scatter of its own and runs torch's as an all-reduce too (backends/emit.py)."""
    rows = x.shape[0] // group_size
    start = process_group(group_name).rank() * rows
    return _all_reduce(x, reduce_op, group_name)[start : start + rows].clone()


def _broadcast(x: Tensor, src: int, group_name: str) -> Tensor:
    group = process_group(group_name)
    return _through_slices(x, lambda piece: dist.broadcast(piece, group_src=src, group=group))


def _all_to_all(x: Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str) -> Tensor:
    """One exchange through the buffers (not sliced: each rank's part of the receive buffer is
    fixed by the split sizes). A payload larger than the buffers goes through host memory of its
    own size, counted in `stats().oversize`: the sizes differ by rank, so refusing on one rank
    would leave the others waiting in the collective."""
    group = process_group(group_name)
    n = group.size()
    outs = list(output_split_sizes) or [x.shape[0] // n] * n
    ins = list(input_split_sizes) or [x.shape[0] // n] * n
    rest = tuple(x.shape[1:])
    sent, got = x.numel(), sum(outs) * math.prod(rest)
    if max(sent, got) * x.dtype.itemsize <= _buffers.cap_bytes:
        send, recv = _buffers.pair(_stats)
        mine = _typed(send, x.dtype, sent).view(x.shape[0], *rest)
        theirs = _typed(recv, x.dtype, got).view(sum(outs), *rest)
    else:
        _stats.oversize += 1
        pin = torch.cuda.is_available()
        mine = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
        theirs = torch.empty((sum(outs), *rest), dtype=x.dtype, pin_memory=pin)
    mine.copy_(x)
    dist.all_to_all_single(theirs, mine, outs, ins, group=group)
    _stats.bytes_to_host += sent * x.dtype.itemsize
    _stats.bytes_from_host += got * x.dtype.itemsize
    return theirs.to(x.device, copy=True)


@torch.library.custom_op("hca::staged_all_reduce", mutates_args=())
def staged_all_reduce(x: Tensor, reduce_op: str, group_name: str) -> Tensor:
    return _run("all_reduce", lambda: _all_reduce(x, reduce_op, group_name))


@torch.library.custom_op("hca::staged_all_gather", mutates_args=())
def staged_all_gather(x: Tensor, group_size: int, group_name: str) -> Tensor:
    return _run("all_gather", lambda: _all_gather(x, group_size, group_name))


@torch.library.custom_op("hca::staged_reduce_scatter", mutates_args=())
def staged_reduce_scatter(x: Tensor, reduce_op: str, group_size: int, group_name: str) -> Tensor:
    return _run("reduce_scatter", lambda: _reduce_scatter(x, reduce_op, group_size, group_name))


@torch.library.custom_op("hca::staged_broadcast", mutates_args=())
def staged_broadcast(x: Tensor, src: int, group_name: str) -> Tensor:
    return _run("broadcast", lambda: _broadcast(x, src, group_name))


@torch.library.custom_op("hca::staged_all_to_all", mutates_args=())
def staged_all_to_all(
    x: Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str
) -> Tensor:
    return _run("all_to_all", lambda: _all_to_all(x, output_split_sizes, input_split_sizes, group_name))


@staged_all_reduce.register_fake
def _(x, reduce_op, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@staged_all_gather.register_fake
def _(x, group_size, group_name):
    return x.new_empty((group_size * x.shape[0], *x.shape[1:]))


@staged_reduce_scatter.register_fake
def _(x, reduce_op, group_size, group_name):
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


@staged_broadcast.register_fake
def _(x, src, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@staged_all_to_all.register_fake
def _(x, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes) if output_split_sizes else x.shape[0]
    return x.new_empty((rows, *x.shape[1:]))
