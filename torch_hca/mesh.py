"""Process group and device mesh set-up: `init_mesh` and the current mesh."""

from __future__ import annotations

import atexit
import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._torch_private import clear_dtensor_sharding_cache
from .errors import MeshError

_current_mesh: DeviceMesh | None = None
DEFAULT_TIMEOUT_S = 300.0
_timeout_s = DEFAULT_TIMEOUT_S

# c10d backend string for each kind of job. A CUDA job also keeps gloo for the
# CPU tensors that every job has (object collectives, barriers, shape checks).
_BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}


def backend_for(device_type: str) -> str:
    """The c10d backend string for `device_type` ("cpu" or "cuda")."""
    try:
        return _BACKENDS[device_type]
    except KeyError:
        raise MeshError(
            f"init_mesh: unknown device {device_type!r}; use 'cpu' or 'cuda'"
        ) from None


def _default_device_type() -> str:
    if dist.is_initialized():  # follow the process group we were given (hca.launch: gloo)
        return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        return "cuda"
    return "cpu"


def _init_process_group(device_type: str) -> None:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise MeshError(
            "init_mesh: no process group is initialized and the environment lacks "
            f"{', '.join(missing)}; run under `torchrun --nproc-per-node N` or inside "
            "`hca.launch(fn, world_size)`"
        )
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend_for(device_type))
    # A process that exits with the group alive can abort in gloo's threads
    # ("terminate called without an active exception"): close what we opened.
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def init_mesh(
    shape: int | Sequence[int] | None = None,
    names: Sequence[str] | None = None,
    *,
    device_type: str | None = None,
) -> DeviceMesh:
    """Initialize the process group if needed and return a `DeviceMesh`.

    ``init_mesh()`` is a 1-D mesh over the whole world; ``init_mesh((2, 2),
    ("dp", "tp"))`` a 2-D one. The mesh becomes the current mesh that
    `hca.sharded` uses when given none.
    """
    global _current_mesh
    device_type = device_type or _default_device_type()
    backend_for(device_type)  # validate early
    if not dist.is_initialized():
        clear_dtensor_sharding_cache()  # decisions cached under an earlier group name dead meshes
        _init_process_group(device_type)
    world = dist.get_world_size()
    shape = (world,) if shape is None else ((shape,) if isinstance(shape, int) else tuple(shape))
    if any((not isinstance(s, int)) or s < 1 for s in shape):
        raise MeshError(
            f"init_mesh: shape {shape} must be positive integers, e.g. init_mesh((2, 2))"
        )
    if math.prod(shape) != world:
        raise MeshError(
            f"init_mesh: mesh shape {shape} holds {math.prod(shape)} ranks but the world "
            f"has {world}; pick a shape whose product is {world}"
        )
    if names is not None:
        names = tuple(names)
        if len(names) != len(shape):
            raise MeshError(
                f"init_mesh: {len(names)} names {names} for a {len(shape)}-D shape {shape}; "
                "give one name per mesh dimension"
            )
        if not all(isinstance(n, str) and n for n in names):
            raise MeshError(
                f"init_mesh: mesh dimension names {names} must be non-empty strings, "
                "e.g. ('dp', 'tp')"
            )
        if len(set(names)) != len(names):
            raise MeshError(f"init_mesh: mesh dimension names {names} must be distinct")
    _current_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _current_mesh


def timeout_s() -> float:
    """Seconds a rank waits for its peers: cross-rank checks, the process group, the launcher."""
    return _timeout_s


def current_mesh() -> DeviceMesh | None:
    """The mesh from the last `init_mesh` in this process, if any."""
    return _current_mesh


def reset_current_mesh() -> None:
    """Forget the current mesh (after the process group is destroyed)."""
    global _current_mesh
    _current_mesh = None
    clear_dtensor_sharding_cache()
