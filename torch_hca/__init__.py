"""torch_hca: a torch.compile backend for sharded training with derived, checked collectives."""

from torch.distributed.tensor import Partial, Replicate
from torch_hca.spmd.shares import Shard  # torch's Shard, or with shares= an uneven one

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
    StrategyError,
    UnsupportedError,
)
from torch_hca.api import collectives
from torch_hca.api.gradients import reduce_gradients
from torch_hca.runtime.launch import LocalWorld, launch, run
from torch_hca.runtime.mesh import current_mesh, init_mesh
from torch_hca.api.plan import sharded
from torch_hca.api.autoplan import plan
from torch_hca.api.calibrate import calibrate
from torch_hca.api.deployment import Deployment, RankCapacity
from torch_hca.api.checkpoint import CheckpointError, load, load_full_state_dict, save
from torch_hca.report.compile_report import CompileReport, report
from torch_hca.api.step import step
from torch_hca.verify import verify

__version__ = "0.1.0"


def __getattr__(name: str):
    """``hca.Trainer`` (a ``transformers.Trainer`` subclass) is imported on first use: transformers is optional."""
    if name == "Trainer":
        from torch_hca.api.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'torch_hca' has no attribute {name!r}")


__all__ = [
    "CheckError",
    "CollectiveError",
    "CompileReport",
    "Deployment",
    "HCAError",
    "LocalWorld",
    "MeshError",
    "OptionsError",
    "Partial",
    "PlacementError",
    "PlanError",
    "RankCapacity",
    "RankError",
    "Replicate",
    "RoleError",
    "Shard",
    "CheckpointError",
    "load",
    "load_full_state_dict",
    "save",
    "UnsupportedError",
    "calibrate",
    "collectives",
    "current_mesh",
    "init_mesh",
    "launch",
    "plan",
    "reduce_gradients",
    "report",
    "run",
    "sharded",
    "step",
    "StrategyError",
    "verify",
]
