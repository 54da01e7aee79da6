"""The `torch.compile` entry point, registered as backend "hca".

Found through the `torch_dynamo_backends` entry point, so
``torch.compile(model, backend="hca")`` works without importing torch_hca.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from torch_hca.options import Options

from .pipeline import compile_graph


def hca_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None, options: dict | None = None):
    """Compile one Dynamo graph over DTensors into a distributed forward+backward."""
    return compile_graph(gm, example_inputs, Options.parse(options, mode))
