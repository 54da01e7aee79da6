"""The `torch.compile` entry point, registered as backend "hca".

Found through the `torch_dynamo_backends` entry point, so
``torch.compile(model, backend="hca")`` works without importing torch_hca.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.fx as fx

from torch_hca._torch_private import dynamo_fallback_exceptions, graph_arg_example
from torch_hca.errors import OptionsError, UnsupportedError
from torch_hca.compiler.options import Options
from torch_hca.compiler.parameters import parameter_module

from .pipeline import compile_graph


def hca_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None, options: dict | None = None):
    """Compile one Dynamo graph over DTensors into a distributed forward+backward."""
    options = with_module_strategy(gm, Options.parse(options, mode))
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


def with_module_strategy(gm: fx.GraphModule, options: Options) -> Options:
    """`options` with the strategy file ``hca.sharded(..., strategy=path)`` named for the modules whose
    parameters `gm` reads, when the options name none; the same file named twice is one, two are an error."""
    named = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        module = parameter_module(graph_arg_example(node))
        spec = module.__dict__.get("_hca_spec") if module is not None else None
        if spec is not None and spec.strategy is not None:
            named.setdefault(os.path.abspath(spec.strategy), (type(module).__name__, spec.strategy))
    if not named:
        return options
    if len(named) > 1:
        said = ", ".join(f"{m}: {p!r}" for m, p in named.values())
        raise OptionsError(
            f"backend 'hca': one graph reads modules sharded with different strategy files ({said}); "
            "a graph loads one strategy: give the modules the same file, or compile each on its own"
        )
    (module_name, path), where = next(iter(named.values())), next(iter(named))
    if options.strategy is not None and os.path.abspath(options.strategy) != where:
        raise OptionsError(
            f"backend 'hca': options['strategy']={options.strategy!r} and hca.sharded(..., strategy={path!r}) "
            f"of {module_name} name different files; leave one out"
        )
    if options.strategy is None and options.layout == "tune":
        raise OptionsError(
            f"backend 'hca': hca.sharded(..., strategy={path!r}) of {module_name} and layout='tune' "
            "both choose the layout; leave one out"
        )
    return options if options.strategy is not None else dataclasses.replace(options, strategy=path)
