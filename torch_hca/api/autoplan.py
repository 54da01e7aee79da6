"""`hca.plan`: a storage plan for every parameter, chosen by the layout solver.

For users who do not want to write a plan: the model is traced once on its
example inputs with every parameter replicated, and the layout solver
(`torch_hca.compiler.layout.solver`) chooses every value's layout as it does when
compiling, except that each parameter's storage layout is free too. A stored
parameter costs memory for itself, its gradient and two optimizer moments;
``memory_budget`` bounds that plus the activations, per rank.
"""

from __future__ import annotations

import copy
import math
import numbers
import re
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from torch_hca.compiler.layout import candidates as layout_candidates
from torch_hca.compiler.layout import solver as layout_solver
from torch_hca.compiler.layout.move_costs import Costs
from torch_hca._torch_private import fake_dtensor_work, graph_arg_example
from torch_hca.errors import HCAError, PlanError
from torch_hca.spmd.placements import dtype_str
from torch_hca.compiler.lifting import lift
from torch_hca.compiler.options import Options
from torch_hca.api.plan import sharded
from torch_hca.compiler.parameters import parameter_name


def plan(
    model: nn.Module,
    example_inputs: tuple | list,
    mesh: DeviceMesh | None = None,
    memory_budget: float | None = None,
    *,
    inputs: Any = Replicate(),
    outputs: Any = Replicate(),
    options: dict | None = None,
) -> dict[str, tuple[Placement, ...]]:
    """A complete ``{parameter name: layout}`` plan for `model`, which `hca.sharded` accepts.

    ``example_inputs``: what ``model.forward`` takes on this rank (local
    pieces laid out as ``inputs``). ``memory_budget``: bytes per rank for
    parameters (with gradient and Adam state) and activations; None: no bound.
    ``options``: the backend's cost options (``cost_model``, ``memory_weight``,
    ``solver_time_limit_s``). Every rank must call it with the same arguments.
    """
    if not isinstance(model, nn.Module):
        raise PlanError(f"hca.plan: expected an nn.Module, got {type(model).__name__}")
    if getattr(model, "_hca_spec", None) is not None:
        raise PlanError("hca.plan: this model is already sharded; pass the plain model")
    if not isinstance(example_inputs, (tuple, list)):
        raise PlanError(
            f"hca.plan: example_inputs must be a tuple of forward's arguments, got {type(example_inputs).__name__}; "
            "write (x,) for one argument"
        )
    if memory_budget is not None and (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, numbers.Real)
        or not math.isfinite(memory_budget)
        or memory_budget < 0
    ):
        raise PlanError(
            f"hca.plan: memory_budget={memory_budget!r}; give bytes per rank as a finite number >= 0 "
            "(e.g. 2e9 for 2 GB), or None for no bound"
        )
    opts = Options.parse(options)
    replicated = sharded({}, mesh=mesh, inputs=inputs, outputs=outputs)(copy.deepcopy(model))
    gm, names = _dynamo_graph(replicated, tuple(example_inputs))
    mesh = replicated._hca_spec.mesh
    costs = opts.costs(mesh.device_type)
    lift(gm)  # the logical program as a DTensor program, parameter placeholders kept
    # Probing on fake DTensors; DTensor's sharding cache is cleared afterwards (even on errors).
    with fake_dtensor_work([n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]):
        ops = layout_candidates.build_ops(gm, mesh, costs, lambda node: None, free_storage=lambda node: node in names)
    solution = layout_solver.solve(
        ops,
        Costs(mesh, costs),
        memory_weight=opts.memory_weight,
        memory_budget=memory_budget,
        time_limit_s=opts.solver_time_limit_s,
    )
    chosen = {names[node]: tuple(s.output) for node, s in solution.choice.items() if node in names}
    unread = {n: (Replicate(),) * mesh.ndim for n, _ in replicated.named_parameters() if n not in chosen}
    return {**chosen, **unread}


def _dynamo_graph(module: nn.Module, args: tuple) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, str]]:
    """The one graph Dynamo makes of `module` on `args`, and its parameter placeholders' names."""
    graphs: list[torch.fx.GraphModule] = []
    names: dict[torch.fx.Node, str] = {}

    def capture(gm, example_inputs):
        graphs.append(gm)
        for node in gm.graph.find_nodes(op="placeholder"):  # only while Dynamo's tracing context lives
            real = graph_arg_example(node)
            name = parameter_name(real) if isinstance(real, torch.Tensor) else None
            if name is not None:
                names[node] = name
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(module, backend=capture, dynamic=False)(*args)
    except HCAError:
        raise
    except Exception as e:  # the model itself fails on these inputs, as it would on one device
        shapes = ", ".join(
            f"{tuple(a.shape)} {dtype_str(a.dtype)}" if isinstance(a, torch.Tensor) else type(a).__name__ for a in args
        )
        raise PlanError(
            f"hca.plan: {type(module).__name__}.forward fails on example_inputs ({shapes}, each this rank's "
            f"local piece laid out as inputs={module._hca_spec.inputs}): {_reason(e)}; give the arguments "
            "forward takes, each rank's piece of them"
        ) from e
    finally:
        torch._dynamo.reset()
    if len(graphs) != 1:
        raise PlanError(
            f"hca.plan: Dynamo split the model into {len(graphs)} graphs; plan needs one "
            "(remove the graph breaks: TORCH_LOGS=graph_breaks names them)"
        )
    return graphs[0], names


def _reason(e: BaseException) -> str:
    """The torch error under Dynamo's wrapping: "got RuntimeError('...')" in a fake-tensor failure, else line one."""
    text = str(e)
    found = re.search(r"got (\w+\(.*?\))\s*$", text, re.MULTILINE)
    return found[1] if found else f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
