"""torch_hca: a torch.compile backend for sharded training with derived, checked collectives."""

from torch.distributed.tensor import Partial, Replicate, Shard

from .errors import (
    CheckError,
    CollectiveError,
    HCAError,
    MeshError,
    OptionsError,
    PlacementError,
    PlanError,
    RankError,
    RoleError,
    UnsupportedError,
)
from . import collectives
from .gradients import reduce_gradients
from .launch import LocalWorld, launch, run
from .mesh import current_mesh, init_mesh
from .plan import sharded
from .autoplan import plan
from .calibrate import calibrate
from .checkpoint import CheckpointError, load, load_full_state_dict, save
from .report import CompileReport, report
from .step import step

__version__ = "0.1.0"

__all__ = [
    "CheckError", "CollectiveError", "CompileReport", "HCAError", "LocalWorld", "MeshError", "OptionsError",
    "Partial", "PlacementError", "PlanError", "RankError", "Replicate", "RoleError", "Shard",
    "CheckpointError", "load", "load_full_state_dict", "save",
    "UnsupportedError", "calibrate", "collectives", "current_mesh", "init_mesh", "launch", "plan", "reduce_gradients", "report", "run", "sharded", "step",
]
