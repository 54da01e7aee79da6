"""The verifier's rule on the residuals a graph keeps for its backward (the file's ``residuals``).

Each residual's bytes follow from its shape and dtype; it is made before the backward (a
forward node, or a kept argument) and read by the backward: a residual that no backward node
reads is memory held through the step for nothing. Like `torch_hca.verify.rules`, it reads
the strategy file alone and yields `Problem`s.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .rules import Graph, Problem


def residuals(G: Graph) -> Iterator[Problem]:
    """Bytes from shape and dtype; made by the forward or an input; read by the backward."""
    for r in G.g.get("residuals") or []:
        where = f"{G.where}, residual {r.get('value')!r}"
        dtype = getattr(torch, str(r.get("dtype")), None)
        shape = r.get("shape")
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, list):
            yield Problem(
                where, "residual bytes", f"dtype {r.get('dtype')}, shape {shape}", "a torch dtype and a shape"
            )
            continue
        want = math.prod(shape) * dtype.itemsize
        if r.get("bytes") != want:
            yield Problem(where, "residual bytes", r.get("bytes"), f"{want} ({shape} of {r.get('dtype')})")
        made = r.get("made") or {}
        if made.get("node") != "input" and not isinstance(made.get("index"), int):
            yield Problem(where, "residual made", made, "a forward node's index, or 'input'")
        read = r.get("last_read") or {}
        if not isinstance(read.get("index"), int):
            yield Problem(where, "residual read", read, "the backward node that reads it last")
