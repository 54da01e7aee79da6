"""The pass interface and the driver that runs, checks and dumps each pass."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.fx as fx

from torch_hca.errors import CheckError
from torch_hca.options import Options
from torch_hca.report import GraphReport, PassRecord


@dataclass
class PassContext:
    """What every pass may read: the options, the report it adds to, example inputs."""

    options: Options
    report: GraphReport
    example_inputs: list[Any] = field(default_factory=list)


@dataclass
class PassResult:
    graph: fx.GraphModule
    changed: bool
    decisions: list[str] = field(default_factory=list)


class Pass(Protocol):
    name: str
    reads: str   # the IR the pass expects
    writes: str  # the IR it leaves

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult: ...


def dump(ctx: PassContext, stage: str, text: str, suffix: str = "py") -> None:
    """Write one artifact to the debug directory, if one is set."""
    if not ctx.options.debug_dir:
        return
    os.makedirs(ctx.options.debug_dir, exist_ok=True)
    path = os.path.join(ctx.options.debug_dir, f"graph{ctx.report.index}_{stage}.{suffix}")
    with open(path, "w") as f:
        f.write(text)


def run_pass(p: Pass, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Run one pass: dump before and after, lint the result, record the decisions."""
    dump(ctx, f"{p.name}_before", gm.code)
    start = time.perf_counter()
    result = p.run(gm, ctx)
    try:
        result.graph.graph.lint()
    except Exception as e:
        raise CheckError(f"pass {p.name!r} left a malformed graph: {e}") from e
    if result.changed:
        result.graph.recompile()
    dump(ctx, f"{p.name}_after", result.graph.code)
    seconds = time.perf_counter() - start
    ctx.report.passes.append(PassRecord(p.name, p.reads, p.writes, result.changed, result.decisions, seconds))
    return result.graph
