"""An eager call of a sharded forward over DTensors: ops DTensor cannot shard replaced by
equivalents it can, the plain tensors the forward makes taken as replicated, and an op DTensor
has no rule for run whole on every rank (as the compiled program runs it, docs/huggingface.md).

A table keyed by the torch function; a rewrite applies only when one of the
arguments is a DTensor. Applied through a `TorchFunctionMode` entered by the
sharded ``forward``, so Dynamo sees (and traces) the replacement and the
eager module behaves the same.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from torch_hca.compiler import dtensor_ops
from torch_hca.errors import UnsupportedError

REWRITES = {
    F.scaled_dot_product_attention: dtensor_ops.attention,
    F.dropout: dtensor_ops.dropout,  # the masks one device draws (torch_hca.compiler.randomness)
    torch.cat: dtensor_ops.cat,  # a KV cache starts from an empty 1-D tensor
    **{conv: dtensor_ops.convolution(conv) for conv in (F.conv1d, F.conv2d, F.conv3d)},  # weights split
    F.batch_norm: dtensor_ops.batch_norm,  # weights split over channels
}


class DTensorRewrites(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next((a for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor)), None)
        if first is None:
            return func(*args, **kwargs)
        # A plain tensor next to a DTensor (a position index, a mask, a cache) was made the same on
        # every rank: made a replicated DTensor here, not at dispatch (DTensor's implicit
        # replication), so that autograd saves the DTensor and the backward can use it too.
        args, kwargs = tree_map_only(torch.Tensor, lambda a: dtensor_ops.replicated_like(a, first), (args, kwargs))
        try:
            return REWRITES.get(func, func)(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            if not _NO_RULE.search(str(e)):
                raise
            return _run_whole(func, args, kwargs, e)


# DTensor's words for an op it cannot shard: no strategy registered, or none that propagates
# (a data-dependent shape, nonzero's).
_NO_RULE = re.compile(r"does not have a sharding strategy|Sharding propagation failed")


def _run_whole(func, args, kwargs, error: BaseException):
    """`func` on every rank's whole inputs (gathered where split, summed where partial), its
    results replicated: each rank computes the logical value. An op that writes into a value laid
    out over the mesh would write into a gathered copy instead, so it is refused."""
    schema = getattr(func, "_schema", None)  # a torch.ops operator (a custom op, say)
    name = schema.name if schema is not None else getattr(func, "__name__", str(func))
    writes = schema.is_mutable if schema is not None else name.endswith("_") and not name.endswith("__")
    spread = [
        a.placements
        for a in tree_leaves((args, kwargs))
        if isinstance(a, DTensor) and not all(p.is_replicate() for p in a.placements)
    ]
    if spread and (writes or "out" in kwargs):
        raise UnsupportedError(
            f"an eager call of a sharded forward: DTensor has no sharding rule for the in-place op {name!r} "
            f"({str(error).splitlines()[0][:160]}), and it writes into a value laid out as "
            f"{spread[0]}: run whole, it would write into a gathered copy. Write it out of place "
            "(y = op(x) in place of op_(x)), or call the model through torch.compile(..., backend='hca')"
        ) from error
    return dtensor_ops.run_local("function", dtensor_ops.local_function(func), None, *args, **kwargs)
