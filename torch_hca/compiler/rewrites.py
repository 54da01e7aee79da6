"""Ops DTensor cannot shard, replaced by equivalents it can, while a sharded forward runs.

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
from torch.utils._pytree import tree_leaves

from torch_hca.compiler import dtensor_ops

REWRITES = {
    F.scaled_dot_product_attention: dtensor_ops.attention,
    F.dropout: dtensor_ops.dropout,  # the masks one device draws (torch_hca.compiler.randomness)
    torch.cat: dtensor_ops.cat,  # a KV cache starts from an empty 1-D tensor
}


class DTensorRewrites(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        replacement = REWRITES.get(func)
        if replacement is not None and any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
            return replacement(*args, **kwargs)
        return func(*args, **kwargs)
