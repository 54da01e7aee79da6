"""The report's typed records: what one compiled graph went through (`GraphReport`), its
collectives, moves and passes, and what a step was predicted and measured to take."""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from torch_hca.report.layout_record import LayoutRecord

if TYPE_CHECKING:
    from torch_hca.compiler.checks.uneven import UnevenShares


@dataclass
class CollectiveRecord:
    """One collective in the compiled forward or backward graph."""

    kind: str  # collective_kinds.Kind value
    group: str  # process group name
    group_size: int
    bytes: int  # the full logical buffer (payload)
    wire_bytes: float  # bytes one rank sends in a ring implementation
    direction: str  # "forward" or "backward"
    node: str  # node name in the graph
    dtype: str
    shape: tuple[int, ...]
    partner: str | None = None  # the collective this one transposes
    rule: str = ""  # why it is there

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Redistribution:
    """A placement change in the DTensor program, explicit as a node."""

    node: str
    value: str
    src: str
    dst: str
    reason: str
    costed: str = ""  # the collectives the layout solver charges for it, as kind@mesh dim
    emitted: str = ""  # the forward collectives traced from it (the transpose pass reads their origin tags)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PassRecord:
    name: str
    reads: str
    writes: str
    changed: bool
    decisions: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the pass (compile-time profile)


CALLS_KEPT = 256  # the most recent calls of each compiled graph whose wall time is kept


@dataclass
class GraphReport:
    """Everything one graph went through, stage by stage."""

    index: int
    options: Any
    mesh: dict[str, Any] | None = None
    dynamo_graph: fx.GraphModule | None = None
    dtensor_program: fx.GraphModule | None = None
    joint: fx.GraphModule | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    inference: bool = False
    collectives: list[CollectiveRecord] = field(default_factory=list)
    redistributions: list[Redistribution] = field(default_factory=list)
    implicit_redistributions: list[str] = field(default_factory=list)
    run_replicated: list[str] = field(default_factory=list)  # ops DTensor has no rule for (lift pass)
    staged: bool = False  # collectives run through host buffers on gloo (option staging)
    random_draws: list[str] = field(default_factory=list)  # "node: aten op" drawing random numbers (lift pass)
    refinement: dict[str, float] | None = None  # option check: relative error of each output and gradient
    refinement_skipped: str | None = None  # option check asked for, and why it did not run
    uneven: UnevenShares | None = None  # the shares the inputs are cut by
    weighted_means: list[str] = field(default_factory=list)  # partial means over uneven ranks, weighted by share
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    passes: list[PassRecord] = field(default_factory=list)
    schedules: dict[str, dict[str, Any]] = field(default_factory=dict)
    layout: LayoutRecord = field(default_factory=LayoutRecord)  # the layout pass's decision (see explain())
    # Option layout="tune": on the program kept, each candidate's time (`torch_hca.backends.tune`);
    # on the others, why they were dropped (hca.report leaves them out).
    tuning: dict[str, Any] | None = None
    dropped: str | None = None
    # Wall seconds of the compiled forward's and backward's recent calls after the first
    # (backends/pipeline.py times them; CPU meshes only), for `CompileReport.measured`.
    call_times: dict[str, collections.deque] = field(
        default_factory=lambda: {w: collections.deque(maxlen=CALLS_KEPT) for w in ("forward", "backward")}
    )
    # The parameters the graph reads, by id, held weakly: ids of dead parameters
    # are reused by new ones, so a match must also be the same object.
    param_refs: dict[int, weakref.ref] = field(default_factory=dict)

    def add_parameter(self, p: torch.Tensor) -> None:
        self.param_refs[id(p)] = weakref.ref(p)

    def reads_any(self, params: list[torch.Tensor]) -> bool:
        return any((r := self.param_refs.get(id(p))) is not None and r() is p for p in params)

    @property
    def dtensor_code(self) -> str:
        return self.dtensor_program.code if self.dtensor_program is not None else ""


@dataclass(frozen=True)
class StepMeasure:
    """`CompileReport.measured()`: a step's compiled graphs, predicted and on the clock."""

    predicted_s: float  # the scheduled timeline's forward + backward, less the host work around calls
    measured_s: float  # the sum over the compiled graphs of each one's median call
    calls: int  # calls timed per graph (the fewest of any graph)
    per_graph_s: dict[str, float]  # "graph0.forward" -> its median call

    @property
    def error(self) -> float:
        """How far the prediction is off: predicted / measured - 1 (-0.2: 20% too fast)."""
        return self.predicted_s / self.measured_s - 1

    def __str__(self) -> str:
        return (
            f"predicted {self.predicted_s * 1e3:.2f} ms vs measured {self.measured_s * 1e3:.2f} ms "
            f"(median of {self.calls}+ calls per graph) for the compiled forward + backward: "
            f"the cost model is off by {self.error:+.0%}"
        )


@dataclass
class StepTimelines:
    before: Any  # torch_hca.report.timeline.Timeline
    after: Any

    def summary(self) -> str:
        b, a = self.before, self.after
        return (
            f"exposed communication {b.exposed_comm_s * 1e6:.1f} us -> {a.exposed_comm_s * 1e6:.1f} us; "
            f"step {b.total_s * 1e6:.1f} us -> {a.total_s * 1e6:.1f} us (estimated)"
        )
