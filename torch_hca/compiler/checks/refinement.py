"""The refinement check: the compiled program computes what the logical program does.

docs/theory.md, section 2: a physical program P is right when Q·P·E = f, and values
are not enough, so the check compares gradients too. On the first call (option
``check``), every rank runs

  * f, the logical program Dynamo traced, eagerly: its markers gather each
    parameter and argument whole and cut this rank's piece of each result, so
    every rank computes the single-device program;
  * the compiled program;

on the same inputs, then pulls one random cotangent (the same seed on every
rank) back through both. Each output and each gradient is compared globally
(pieces gathered); the first one beyond tolerance is a `CheckError` naming it
and its layout. The tolerance is fp32's, or the precision of the lowest float
type the program computes in (bf16 under ``torch.autocast``, say): the two
programs add partial sums in different orders, and the rounding follows the
type. Both programs start from the same random number generators' states (a
dropout draws the same mask in both), and those states and mutated inputs
(buffers' running statistics) are restored afterwards, so the real step that
follows draws and sees what it would have.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from torch_hca.errors import CheckError
from torch_hca.compiler.parameters import parameter_name
from torch_hca.compiler.randomness import generator_states, set_generator_states
from torch_hca.spmd.placements import layout_str

# Relative error (2-norm) beyond which a value is wrong: fp32 rounding on these
# programs stays below 1e-5; a wrong collective is off by O(1).
TOLERANCE = 1e-4
# In a program that computes in a lower precision: this many of its float type's epsilon
# (bf16: 3.1e-2, fp16: 3.9e-3). Under bf16 autocast the two programs differ by 2e-3 to 4e-3.
EPSILONS = 4
# A gradient is measured against at least this share of all gradients' norm.
GRADIENT_FLOOR = 1e-3


def _rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """‖a − b‖ / max(‖b‖, floor): a gradient that is zero in exact math is rounding noise
    on both sides, so it is measured against `floor` (a share of all gradients' norm)."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    both_nan = torch.isnan(a) & torch.isnan(b)
    a, b = torch.where(both_nan, 0.0, a), torch.where(both_nan, 0.0, b)
    return ((a - b).norm() / max(b.norm().item(), floor)).item()


def tolerance(program: fx.GraphModule) -> float:
    """`TOLERANCE`, or `EPSILONS` of the least precise float type among the program's values."""
    values = tree_leaves([node.meta.get("example_value", node.meta.get("val")) for node in program.graph.nodes])
    eps = [torch.finfo(t.dtype).eps for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max([TOLERANCE, *(EPSILONS * e for e in eps)])


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _describe(t: torch.Tensor) -> str:
    return layout_str(t.placements) if isinstance(t, DTensor) else "a local tensor"


def history_cut(args: list[Any]) -> list[Any]:
    """`args` with their history cut (a previous graph's outputs): a pull-back stops at this graph."""
    return [
        a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) and a.grad_fn is not None else a
        for a in args
    ]


def restorer(args: list[Any]) -> Callable[[], None]:
    """Put back, when called, what a run changed in `args`' plain tensors (buffers' running
    statistics): a check or a timing run must leave the real step's inputs untouched."""
    saved = [(a, a.detach().clone()) for a in args if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)]

    def restore() -> None:
        with torch.no_grad():
            for a, before in saved:  # only what a run changed (a graph's inputs may be views)
                if a.shape == before.shape and not torch.equal(a, before):
                    a.copy_(before)

    return restore


def fixed_cotangents(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One random cotangent per output, from a fixed seed: the same on every rank and every call."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outputs]


def check_refinement(logical: fx.GraphModule, compiled: Callable, args: list[Any], what: str) -> dict[str, float]:
    """Run both programs on `args`; raise CheckError on the first output or gradient that differs."""
    restore = restorer(args)
    device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    generators = generator_states(device_type)
    tol = tolerance(logical)
    beyond = "" if tol == TOLERANCE else f" (beyond {tol:.2g}, the tolerance of its lowest-precision values)"
    args = history_cut(args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    errors: dict[str, float] = {}
    try:
        # The logical program updates its own copies of buffers (running statistics): the
        # compiled program's in-place updates must not touch what the logical one saved.
        mine = [
            a.clone() if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and not a.requires_grad else a
            for a in args
        ]
        with torch.enable_grad():
            expected = logical(*mine)
            set_generator_states(device_type, generators)
            got = compiled(*args)
        expected = expected if isinstance(expected, (tuple, list)) else (expected,)
        pairs = [(i, e, g) for i, (e, g) in enumerate(zip(expected, got)) if isinstance(e, torch.Tensor)]
        for i, e, g in pairs:
            errors[f"output {i}"] = err = _rel_err(_whole(g), _whole(e))
            if err > tol:
                raise CheckError(
                    f"{what}: output {i} ({_describe(g)}, shape {tuple(g.shape)}) differs from the "
                    f"single-device program by {err:.3g} (relative){beyond}; the compiled program is "
                    "wrong here"
                )
        diff = [(e, g) for _, e, g in pairs if e.requires_grad and g.requires_grad and e.is_floating_point()]
        if not diff or not leaves:
            return errors
        cot = fixed_cotangents([g for _, g in diff])
        want = torch.autograd.grad([e for e, _ in diff], leaves, cot, allow_unused=True)
        have = torch.autograd.grad([g for _, g in diff], leaves, cot, allow_unused=True)
        wholes = [(_whole(w), _whole(h)) if w is not None and h is not None else (w, h) for w, h in zip(want, have)]
        total = sum(w.double().norm().item() ** 2 for w, _ in wholes if w is not None) ** 0.5
        floor = max(GRADIENT_FLOOR * total, 1e-30)
        for leaf, (w, h), placed in zip(leaves, wholes, have):
            name = parameter_name(leaf) or f"argument of shape {tuple(leaf.shape)}"
            if w is None and h is None:
                continue
            if (w is None) != (h is None):
                raise CheckError(
                    f"{what}: the gradient of {name} is {'missing' if h is None else 'extra'} in the compiled program"
                )
            errors[f"grad {name}"] = err = _rel_err(h, w, floor)
            if err > tol:
                raise CheckError(
                    f"{what}: the gradient of {name} ({_describe(leaf)} storage, gradient {_describe(placed)}) "
                    f"differs from the single-device program by {err:.3g} (relative){beyond}"
                )
        return errors
    finally:
        restore()
        set_generator_states(device_type, generators)
