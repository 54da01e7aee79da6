"""The pass interface and the driver that runs, checks and dumps each pass."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch.distributed as dist
import torch.fx as fx

from torch_hca._torch_private import structured_trace_enabled, trace_artifact
from torch_hca.errors import CheckError
from torch_hca.compiler.options import Options
from torch_hca.report.records import GraphReport, PassRecord
from torch_hca.report.text import WIDTH, readable_code


@dataclass
class PassContext:
    """What every pass may read: the options, the report it adds to, example inputs."""

    options: Options
    report: GraphReport
    example_inputs: list[Any] = field(default_factory=list)
    origins: Any = None  # passes/origins.py's `Origins` of the DTensor program, once tagged
    owed: Any = None  # passes/transpose.py's `Owed`: the backward as derived, before later passes
    rewritten: set[str] = field(default_factory=set)  # collective nodes the rewrite pass replaced
    last_published: tuple[str, str] | None = None  # (name, text) the log and trace showed last


@dataclass
class PassResult:
    graph: fx.GraphModule
    changed: bool
    decisions: list[str] = field(default_factory=list)


class Pass(Protocol):
    name: str
    reads: str  # the IR the pass expects
    writes: str  # the IR it leaves

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult: ...


# TORCH_LOGS="+torch_hca" (or torch._logging.set_logs(modules={"torch_hca": logging.DEBUG}))
# shows the graphs. A module name, not a registered artifact: torch reads TORCH_LOGS
# during `import torch`, before any other package could register an artifact name.
log = logging.getLogger(__name__)
# The widest line of a logged text: with torch's prefix (rank, level, time, pid, file:line,
# compile id, about 70 characters) a log line stays under 200. debug_dir keeps the text whole.
LOG_WIDTH = WIDTH


def for_log(text: str, suffix: str = "py", width: int = LOG_WIDTH) -> str:
    """`text` with no line wider than `width`: code cut where Python allows, anything else cut hard."""
    if suffix == "py":
        text = readable_code(text, width)
    lines = []
    for line in text.splitlines():
        while len(line) > width:
            lines.append(line[: width - 2] + " \\")
            line = "    " + line[width - 2 :]
        lines.append(line)
    return "\n".join(lines)


def dump(ctx: PassContext, stage: str, text: str | Callable[[], str], suffix: str = "py") -> None:
    """Publish one artifact of graph N, ``graph{N}_{stage}``, wherever it is asked for.

    * ``options.debug_dir``: the file ``{debug_dir}/rank{r}/graph{N}_{stage}.{suffix}``;
    * the ``torch_hca.passes.infra`` logger at DEBUG (``TORCH_LOGS="+torch_hca"``);
    * torch's structured trace (``TORCH_TRACE=dir``), as the artifact ``hca_graph{N}_{stage}`` for tlparse.

    ``text`` may be a function: it is called only when one of them is on. A text
    equal to the last one shown (a pass's "before" is usually the previous
    pass's "after") is shown as a one-line "unchanged" note in the log and trace.
    """
    to_log, to_trace = log.isEnabledFor(logging.DEBUG), structured_trace_enabled()
    if not (ctx.options.debug_dir or to_log or to_trace):
        return
    text = text() if callable(text) else text
    name = f"graph{ctx.report.index}_{stage}"
    if ctx.options.debug_dir:
        folder = os.path.join(ctx.options.debug_dir, f"rank{_rank()}")  # ranks would overwrite each other's files
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.{suffix}"), "w") as f:
            f.write(text)
    if not (to_log or to_trace):
        return
    if ctx.last_published is not None and ctx.last_published[1] == text:
        body, sep = f"unchanged (the same as hca_{ctx.last_published[0]})", " "
    else:
        ctx.last_published, body, sep = (name, text), text.strip("\n"), "\n"
    if to_log:
        log.debug("hca %s:%s%s", name, sep, body if sep == " " else for_log(body, suffix))
    if to_trace:
        trace_artifact(f"hca_{name}", "json" if suffix == "json" else "string", lambda: body)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
