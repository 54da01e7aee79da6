"""An eager call of a sharded forward over DTensors: ops DTensor cannot shard replaced by
equivalents it can, and the plain tensors the forward makes taken as replicated.

A table keyed by the torch function; a rewrite applies only when one of the
arguments is a DTensor. Applied through a `TorchFunctionMode` entered by the
sharded ``forward``, so Dynamo sees (and traces) the replacement and the
eager module behaves the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from torch_hca.compiler import dtensor_ops

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
        return REWRITES.get(func, func)(*args, **kwargs)
