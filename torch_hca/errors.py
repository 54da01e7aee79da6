"""One hierarchy for every error torch_hca raises on bad input.

Each message names the thing at fault (parameter, node, rank, option), says
why, and says what to write instead.
"""

from __future__ import annotations


class HCAError(Exception):
    """Base class: catch this to catch every torch_hca error."""


class MeshError(HCAError):
    """The device mesh does not match the world or cannot be built."""


class PlanError(HCAError):
    """A sharding plan is malformed or does not fit the model."""


class PlacementError(PlanError):
    """A placement cannot be applied to the tensor it was given to."""


class OptionsError(HCAError):
    """An unknown or invalid option was passed to the backend."""


class UnsupportedError(HCAError):
    """The backend met an op or graph it cannot shard."""


class CheckError(HCAError):
    """A generated program failed one of the backend's own checks."""


class StrategyError(HCAError):
    """A strategy file is malformed, of an unknown schema version, made for another model,
    mesh or world size, or fails the independent verifier (`hca.verify`)."""


class RankError(HCAError):
    """A rank of a local launch failed; carries its rank and traceback."""

    def __init__(self, rank: int, kind: str, traceback_text: str):
        self.rank = rank
        self.kind = kind
        self.traceback_text = traceback_text
        super().__init__(f"rank {rank} failed with {kind}; its traceback:\n{traceback_text}")


class CollectiveError(HCAError):
    """A collective was asked for what its group cannot do: a root outside the
    group, a permutation that is not one, a dimension the ranks cannot split evenly."""


class RoleError(CollectiveError):
    """A local-view collective (`hca.collectives`) got a source or destination
    role that does not fit the op: the gradient it implies would be wrong."""
