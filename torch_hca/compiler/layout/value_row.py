"""One value's row of the layout decision: the placement the solver chose, what it reads, its cost
terms and why (`torch_hca.compiler.layout.solver.explain_rows` writes them; `LayoutRecord.values`
keeps them for `explain()`, the one-sentence summary and the report's JSON)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ValueRow:
    value: str  # the node's name
    shape: tuple[int, ...]  # its logical shape
    placement: str  # the layout it is written in, as `layout_str` writes it: "(S(0), R)"
    reads: tuple[str, ...]  # the layout each DTensor it reads is read in
    compute_us: float  # its op's compute, forward and backward
    forward_comm_us: float  # the forward moves into it
    backward_comm_us: float  # their backward
    memory_bytes: float  # what the value keeps on this rank
    why: str  # a constraint, or the alternative it beat and by how much

    def as_dict(self) -> dict[str, Any]:
        """The row as the report's JSON has it (lists for the shape and the reads)."""
        return {
            "value": self.value,
            "shape": list(self.shape),
            "placement": self.placement,
            "reads": list(self.reads),
            "compute_us": self.compute_us,
            "forward_comm_us": self.forward_comm_us,
            "backward_comm_us": self.backward_comm_us,
            "memory_bytes": self.memory_bytes,
            "why": self.why,
        }
