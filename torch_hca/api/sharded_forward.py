"""The forward of a sharded module (`hca.sharded`): plain tensors in, plain tensors out.

Eager calls run the user's forward over DTensors (`wrap_forward`); under Dynamo the
single-device program is traced (`call_logically`) for the backend to place, and a call
whose arguments are cut by shares runs outside the trace (`_call_uneven`).
`trace_over_dtensor` lets Dynamo trace over the DTensors instead (a baseline).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._pytree import tree_leaves, tree_map

from torch_hca.api.sharding_spec import ShardingSpec
from torch_hca.compiler.checks.agreement import EVERY_RANK_CALLS
from torch_hca.compiler.logical import call_logically, output_layout
from torch_hca.compiler.randomness import generator_digest
from torch_hca.compiler.rewrites import DTensorRewrites
from torch_hca.errors import CheckError
from torch_hca.runtime.exchange import exchange, needs_exchange
from torch_hca.spmd.shares import uneven_dims


def wrap_forward(forward):
    """`forward` as a sharded module runs it: plain tensors in and out, the work on DTensors."""

    @functools.wraps(forward)
    def sharded_forward(self, *args, **kwargs):
        spec: ShardingSpec | None = getattr(self, "_hca_spec", None)
        if spec is None:  # a subclass the decorator did not shard
            return forward(self, *args, **kwargs)
        if torch.compiler.is_compiling() and not self.__dict__.get("_hca_dtensor_trace"):
            if spec.uneven:
                return _call_uneven(self, spec, args, kwargs)
            # Dynamo traces the single-device program; the backend places it (docs/theory.md, section 1).
            return call_logically(self, spec, args, kwargs)
        if not torch.compiler.is_compiling():
            _check_every_rank_calls(self, spec)
        args = tuple(tree_map(lambda t, i=i: spec.to_dtensor(t, i), a) for i, a in enumerate(args))
        kwargs = tree_map(lambda t: spec.to_dtensor(t, None), kwargs)
        replicated = (Replicate(),) * spec.mesh.ndim
        buffers = {
            f"inner.{name}": DTensor.from_local(b, spec.mesh, replicated, run_check=False)
            for name, b in self.named_buffers()
        }  # views: in-place updates reach the buffers
        # Whether the forward draws random numbers: then every rank must have drawn from one state.
        drawn_from = None if torch.compiler.is_compiling() else generator_digest(spec.mesh.device_type)
        # Plain tensors the forward makes (positions, masks, a cache's indices) are the same on every
        # rank: the mode makes them replicated DTensors, and DTensor's implicit replication catches the
        # rest. Not under Dynamo (the bench's DTensor baseline, traced by torch.compile): traced, the
        # implicit replication broke later hca compiles in the process (a backend view's shape error,
        # or another program than the report's).
        plain_replicated = contextlib.nullcontext() if torch.compiler.is_compiling() else implicit_replication()
        with DTensorRewrites(), plain_replicated:
            out = torch.func.functional_call(self.__dict__["_hca_logical"], buffers, args, kwargs, strict=False)
        if drawn_from is not None and generator_digest(spec.mesh.device_type) != drawn_from:
            _check_one_generator_state(drawn_from)
        return tree_map(spec.to_local, out)

    sharded_forward._hca_wrapped = True
    return sharded_forward


def eager_call_text(module: nn.Module) -> str:
    """What an eager call is, as the input check names a call (``graph 0 (training)``)."""
    mode = "no_grad" if not torch.is_grad_enabled() else ("training" if module.training else "eval")
    return f"an eager call of {type(module).__name__} ({mode})"


def _check_every_rank_calls(module: nn.Module, spec: ShardingSpec) -> None:
    """An eager call of a module with a parameter stored split communicates, so every rank must be
    making it: `if rank == 0: evaluate(model)` would otherwise pair rank 0's collectives with the
    other ranks' training and wait out the timeout. The call posts under the input check's topic
    (`torch_hca.compiler.checks.agreement`), so a peer at a compiled step or another eager call
    meets it at once and both name the mismatch. Parameters all replicated (data parallelism): an
    eager call needs nothing from the others, and one rank may evaluate alone."""
    if not (spec.stores_split and needs_exchange()):
        return
    mine = eager_call_text(module)
    texts = exchange("step", f"{mine}\t-\t-", range(dist.get_world_size()), mine)
    for rank, text in sorted(texts.items()):
        theirs = text.split("\t")[0]
        if theirs != mine:
            raise CheckError(f"rank {dist.get_rank()} makes {mine} while rank {rank} runs {theirs}: {EVERY_RANK_CALLS}")


def _check_one_generator_state(digest: str) -> None:
    """The forward drew random numbers (dropout, or a plain tensor taken as replicated): every rank
    must have drawn from one generator state, or the draws that must be one differ by rank."""
    if not needs_exchange():
        return
    world = dist.get_world_size()
    digests = exchange("eager draws", digest, range(world), "an eager call's random draws") | {dist.get_rank(): digest}
    differ = [rank for rank in range(world) if digests[rank] != digests[0]]
    if differ:
        raise CheckError(
            f"a sharded forward called eagerly drew random numbers, and the default random number generator of "
            f"rank(s) {differ} differs from rank 0's (digests {sorted(set(digests.values()))}), so draws that must be one "
            "differ by rank. Seed every rank the same (torch.manual_seed(seed) with one seed on every rank), and "
            "draw rank-local randomness (data shuffling, augmentation) from a torch.Generator of its own"
        )


@torch._dynamo.disable(recursive=False)
def _call_uneven(module: nn.Module, spec: ShardingSpec, args: tuple, kwargs: dict) -> Any:
    """The compiled call of a module whose arguments are cut by shares (torch_hca.compiler.checks.uneven).

    Run outside Dynamo's trace, and only this frame: Dynamo compiles the frames it calls, so
    the two around `_traced_call` are disabled whole. Each uneven dimension is marked
    dynamic, so that every rank, whatever its rows, traces one program; each result's
    cotangent is weighted by this rank's share, which differs by rank and so stays out of it.
    """
    # This rank's rows of the cut dimension, for the report's per-rank view (hca.sharded(deployment=)).
    module.__dict__["_hca_uneven_rows"] = _mark_uneven(spec, args, kwargs)
    traced = module.__dict__.get("_hca_traced_call")
    if traced is None:
        # A code object of its own per module: Dynamo keys its cache by code object, and a frame
        # shared by modules would turn the ints they differ by (the mesh's index) symbolic.
        code = _traced_call.__code__.replace(co_name=f"_traced_call_{len(_TRACED_CALLS)}")
        traced = module.__dict__["_hca_traced_call"] = types.FunctionType(code, _traced_call.__globals__)
        _TRACED_CALLS.append(code.co_name)
    return _weighted(spec, traced(module, spec, args, kwargs))


_TRACED_CALLS: list[str] = []


def _traced_call(module: nn.Module, spec: ShardingSpec, args: tuple, kwargs: dict) -> Any:
    return call_logically(module, spec, args, kwargs)


@torch._dynamo.disable
def _mark_uneven(spec: ShardingSpec, args: tuple, kwargs: dict) -> int | None:
    """Mark each cut dimension dynamic; returns this rank's rows of the first (None: no tensor cut)."""
    pieces = [(a, spec.input_layout(i)) for i, a in enumerate(args)] + [
        (v, spec.input_layout(None)) for v in kwargs.values()
    ]
    rows = None
    for value, layout in pieces:
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                for _, p in uneven_dims(layout):
                    # maybe_: a piece of one row stays static (Dynamo specializes sizes 0 and 1).
                    torch._dynamo.maybe_mark_dynamic(t, p.dim % t.dim())
                    rows = t.shape[p.dim % t.dim()] if rows is None else rows
    return rows


@torch._dynamo.disable
def _weighted(spec: ShardingSpec, out: Any) -> Any:
    """The results, each cut by shares with its cotangent times this rank's `share_weight`."""

    def weighted(t):
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return t
        return spec.weighted(t, output_layout(t, spec.outputs, 1.0)[0])

    return tree_map(weighted, out)


def trace_over_dtensor(module: nn.Module) -> nn.Module:
    """Let Dynamo trace `module` over its DTensors, as torch.compile does without hca.

    For baselines (the bench's DTensor + Inductor contestant). The hca backend
    still compiles such a graph, but it inherits DTensor's limits: every value
    made in ``forward`` must be a DTensor, and DTensor's choices come first.
    """
    module.__dict__["_hca_dtensor_trace"] = True
    return module
