"""The `torch.compile` entry point, registered as backend "hca".

Found through the `torch_dynamo_backends` entry point, so
``torch.compile(model, backend="hca")`` works without importing torch_hca.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from torch_hca._torch_private import dynamo_fallback_exceptions
from torch_hca.errors import UnsupportedError
from torch_hca.compiler.options import Options

from .pipeline import compile_graph


def hca_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None, options: dict | None = None):
    """Compile one Dynamo graph over DTensors into a distributed forward+backward."""
    options = Options.parse(options, mode)
    try:
        return compile_graph(gm, example_inputs, options)
    except dynamo_fallback_exceptions() as e:
        # Dynamo would warn, split the graph there and run the split-off code outside hca: not
        # the program the plan asks for, and the first cause lost. An error instead.
        raise UnsupportedError(
            f"backend 'hca': compiling graph needs data that fake tensors do not have ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else '?'}). Dynamo would answer with a graph break and run "
            "the rest outside the distributed program, so hca stops here. Move data-dependent calls "
            "(torch.equal, .item(), .nonzero()) out of forward; if the traceback points into torch_hca, "
            "please report it"
        ) from e
