"""The layout pass's decision for one graph, as a typed record (`GraphReport.layout`).

Written once by the layout pass (passes/layout.py), read by `explain()`, the
one-sentence summary (`torch_hca.report.parallelism`), the strategy file and the
timeline. A field the decision did not reach stays None (a graph with no DTensor
has no objective); `as_dict` leaves those out, as the strategy's JSON has them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch_hca.compiler.layout.value_row import ValueRow


@dataclass
class LayoutRecord:
    solver: str = "?"  # what chose the layouts: "milp (scipy HiGHS)", "none (...)", a strategy file
    status: str | None = None  # the solver's: "optimal", "time limit", ...
    objective_s: float | None = None  # the predicted step of the chosen layouts
    bound_s: float | None = None  # the solver's lower bound on it
    as_written_s: float | None = None  # the user's layouts kept, priced by the same model
    strategies: int | None = None  # candidate strategies over every op
    seconds: float | None = None  # solving
    probe_seconds: float | None = None  # probing DTensor's rules for the candidates
    replay_seconds: float | None = None  # replaying a strategy file's moves
    cost_model: dict[str, float] | None = None  # the figures it priced with (CostModel.as_dict())
    cost_model_source: str | None = None  # where they came from: defaults, a calibration, overrides
    # One row per value: its placement, the cost terms and why (`torch_hca.compiler.layout.value_row`).
    values: list[ValueRow] = field(default_factory=list)
    left_to_dtensor: list[str] = field(default_factory=list)  # moves DTensor still made on its own
    strategy_facts: dict[str, Any] | None = None  # the graph's facts for the strategy file (docs/strategy.md)

    @property
    def solved(self) -> bool:
        """Whether a solver priced this layout (an objective to read)."""
        return self.objective_s is not None

    def as_dict(self) -> dict[str, Any]:
        """The record as the report's JSON has it: each row `ValueRow.as_dict()`, no None fields."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["values"] = [row.as_dict() for row in self.values]
        return {k: copy.deepcopy(v) for k, v in fields.items() if v is not None}
