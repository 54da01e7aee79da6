"""What a strategy file is made for, as digests: the logical program the layout pass reads (per
graph) and the model section (parameters and graphs). A file whose digests differ from the
compile's was made for another model (docs/strategy.md)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement

from torch_hca.compiler import dtensor_ops
from torch_hca.report.strategy_residuals import is_size_input


def op_text(node: fx.Node) -> str:
    """A node's target as text, without the addresses Python prints for some objects."""
    t = node.target
    name = t if isinstance(t, str) else getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)
    return re.sub(
        r" at 0x[0-9a-f]+", "", f"{getattr(t, '__module__', '') or ''}.{name}" if not isinstance(t, str) else t
    )


def _arg_text(a: Any) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return "(" + ",".join(_arg_text(x) for x in a) + ")"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_arg_text(v)}" for k, v in sorted(a.items())) + "}"
    if isinstance(a, (int, float, str, bool)) or a is None:
        return repr(a)
    if isinstance(a, Placement):
        return repr(a)
    return type(a).__name__  # a mesh or other object: its type only (the mesh is checked on its own)


# The argument that names a mesh by its number in this process's registry: another compile in the
# same process (a second `hca.init_mesh`) numbers the same mesh otherwise.
_MESH_HANDLE = {dtensor_ops.from_local: 1, dtensor_ops.replicate: 1}


def logical_digest(gm: fx.GraphModule) -> str:
    """A digest of the program the layout pass reads: each node's op, target, arguments and
    logical shape and dtype; not the placements the layout pass chooses, nor which number this
    process gave the mesh (the file checks the mesh on its own)."""
    lines = []
    for node in gm.graph.nodes:
        if is_size_input(node):  # the sizes themselves are in the shapes below
            continue
        v = node.meta.get("example_value")
        shape = f"{list(v.shape)}:{v.dtype}" if isinstance(v, torch.Tensor) else ""
        args = node.args
        if (i := _MESH_HANDLE.get(node.target)) is not None and len(args) > i:
            args = (*args[:i], "mesh", *args[i + 1 :])
        lines.append(f"{node.op} {node.name} {op_text(node)} {_arg_text(args)} {_arg_text(node.kwargs)} {shape}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def model_digest(model: dict) -> str:
    """The digest of the model section (all but its own ``digest``): parameters and logical graphs."""
    body = {k: v for k, v in model.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]
