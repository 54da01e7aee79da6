"""Process group and device mesh set-up: `init_mesh` and the current mesh."""

from __future__ import annotations

import atexit
import datetime
import math
import numbers
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torch_hca._torch_private import clear_dtensor_sharding_cache
from torch_hca.errors import MeshError

_current_mesh: DeviceMesh | None = None
_mixed = False  # the current mesh's ranks mix device types (init_mesh(devices=...))
DEFAULT_TIMEOUT_S = 300.0
# How long a rank waits for its peers (process group, store checks, the launcher's
# start-up). Set by init_mesh(timeout=...) and, in ranks hca.launch starts, by the launcher.
_timeout_s = DEFAULT_TIMEOUT_S
_timeout_setting = "hca.init_mesh(timeout=...)"  # where a user raises it: named in timeout messages

# c10d backend string for each kind of job. A CUDA job also keeps gloo for the
# CPU tensors that every job has (object collectives, barriers, shape checks).
_BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}
# Ranks of both kinds in one job: every collective on gloo (NCCL cannot reach a CPU rank).
MIXED_BACKEND = "cpu:gloo,cuda:gloo"


def backend_for(device_type: str) -> str:
    """The c10d backend string for `device_type` ("cpu" or "cuda")."""
    try:
        return _BACKENDS[device_type]
    except (KeyError, TypeError):
        raise MeshError(f"init_mesh: unknown device {device_type!r}; use 'cpu' or 'cuda'") from None


def check_timeout(value, where: str) -> float:
    """`value` as seconds if it is a positive finite number, else a `MeshError` naming it.

    ``where`` names the parameter, e.g. ``"hca.launch(timeout_s=...)"``.
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise MeshError(
        f"{where}: {value!r} is not a positive finite number of seconds. It is how long a rank "
        "waits for its peers (process group, cross-rank checks), not a limit on the job's length; "
        "give e.g. 600"
    )


def set_timeout(seconds: float, setting: str = "hca.init_mesh(timeout=...)") -> None:
    """Make `seconds` this process's peer timeout (what `timeout_s()` returns); `setting` names where
    the user sets it (`timeout_setting()`)."""
    global _timeout_s, _timeout_setting
    _timeout_s = check_timeout(seconds, "init_mesh(timeout=...)")
    _timeout_setting = setting


def timeout_setting() -> str:
    """The setting timeout messages name: init_mesh's, or the launcher's in ranks it started."""
    return _timeout_setting


def _device_type(device_type) -> str:
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    backend_for(device_type)  # names the unknown ones
    if device_type == "cuda" and not torch.cuda.is_available():
        raise MeshError(
            "init_mesh: device_type='cuda' but CUDA is not available in this process "
            "(torch.cuda.is_available() is False); use device_type='cpu' (gloo), or run on a machine with GPUs"
        )
    return device_type


def _default_device_type() -> str:
    if dist.is_initialized():  # follow the process group we were given (hca.launch: gloo)
        return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        return "cuda"
    return "cpu"


def _init_process_group(device_type: str, backend: str | None = None) -> None:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise MeshError(
            "init_mesh: no process group is initialized and the environment lacks "
            f"{', '.join(missing)}. Put the work in a function and end the script with "
            "`hca.run(main, n)`: plain `python script.py` then starts n local gloo ranks, and under "
            "`torchrun --nproc-per-node n script.py` each rank runs `main`; or call it inside "
            "`hca.launch(fn, world_size)`"
        )
    if device_type == "cuda" and backend is None:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend or backend_for(device_type), timeout=datetime.timedelta(seconds=_timeout_s))
    # A process that exits with the group alive can abort in gloo's threads
    # ("terminate called without an active exception"): close what we opened.
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _shape(shape) -> tuple | None:
    """`shape` as a tuple of positive ints (None: the whole world), checked before any group exists."""
    if shape is None:
        return None
    if isinstance(shape, int):
        shape = (shape,)
    dims = tuple(shape) if isinstance(shape, Sequence) and not isinstance(shape, str) else ()
    if not dims or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in dims):
        raise MeshError(f"init_mesh: shape {shape!r} must be positive integers, e.g. init_mesh((2, 2)) or init_mesh(4)")
    return dims


def _names(names, shape: tuple | None) -> tuple | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise MeshError(
            f"init_mesh: names {names!r} is one string; give a sequence with one name per mesh "
            f"dimension, e.g. names=({names!r},)"
        )
    names, ndim = tuple(names), 1 if shape is None else len(shape)
    if len(names) != ndim:
        raise MeshError(
            f"init_mesh: {len(names)} names {names} for a {ndim}-D shape {shape or '(world,)'}; "
            "give one name per mesh dimension"
        )
    if not all(isinstance(n, str) and n for n in names):
        raise MeshError(f"init_mesh: mesh dimension names {names} must be non-empty strings, e.g. ('dp', 'tp')")
    if len(set(names)) != len(names):
        raise MeshError(f"init_mesh: mesh dimension names {names} must be distinct")
    return names


def init_mesh(
    shape: int | Sequence[int] | None = None,
    names: Sequence[str] | None = None,
    *,
    device_type: str | None = None,
    devices: Sequence[str] | None = None,
    timeout: float | None = None,
) -> DeviceMesh:
    """Initialize the process group if needed and return a `DeviceMesh`.

    ``init_mesh()`` is a 1-D mesh over the whole world; ``init_mesh((2, 2),
    ("dp", "tp"))`` a 2-D one. The mesh becomes the current mesh that
    `hca.sharded` uses when given none.

    ``devices``: each rank's device, in rank order (``["cuda:0", "cpu"]``, or
    ``deployment.devices``), for a job whose ranks differ. Ranks of CPU and CUDA
    devices in one job share one gloo process group (``cpu:gloo,cuda:gloo``) and the
    compiled programs stage their collectives through host buffers (option
    ``staging``, docs/heterogeneous.md); each rank's mesh is on its own device.

    ``timeout`` (seconds, default 300, or the launcher's ``timeout_s`` inside
    `hca.launch`) is how long a rank waits for its peers: the process group
    this call creates, and every cross-rank check (first-run agreement,
    `hca.collectives`' signature check). It is not a limit on the job's length.
    A process group that already exists keeps the timeout it was created with.
    """
    global _current_mesh, _mixed
    if timeout is not None:
        check_timeout(timeout, "init_mesh(timeout=...)")
    shape = _shape(shape)
    names = _names(names, shape)
    if devices is not None and device_type is not None:
        raise MeshError("init_mesh: give device_type= or devices=, not both (devices= names each rank's device)")
    mine, mixed = _rank_devices(devices) if devices is not None else (None, False)
    device_type = mine.type if mine is not None else _device_type(device_type or _default_device_type())
    if timeout is not None:
        set_timeout(timeout)
    if mine is not None and mine.type == "cuda":
        torch.cuda.set_device(mine)
    if not dist.is_initialized():
        _init_process_group(device_type, MIXED_BACKEND if mixed else None)
    world = dist.get_world_size()
    if devices is not None and len(devices) != world:
        raise MeshError(f"init_mesh: devices= names {len(devices)} ranks, the world has {world}; give one per rank")
    shape = (world,) if shape is None else shape
    if math.prod(shape) != world:
        raise MeshError(
            f"init_mesh: mesh shape {shape} holds {math.prod(shape)} ranks but the world "
            f"has {world}; pick a shape whose product is {world}"
        )
    # DTensor's cached decisions name an earlier mesh that compares equal to this one (same
    # shape and names) but owns other process groups: a second (2, 2) mesh in one process
    # then ran its collectives on the first one's groups, which the transpose pass could not
    # place on a mesh dim ("group 5 is no mesh dimension").
    clear_dtensor_sharding_cache()
    _current_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _mixed = mixed
    return _current_mesh


def _rank_devices(devices: Sequence[str]) -> tuple[torch.device, bool]:
    """This rank's device of `devices` (by the RANK the launcher set, or the process group's),
    and whether the ranks mix device types."""
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise MeshError(f"init_mesh: devices={devices!r}; give a list of one device per rank, like ['cuda:0', 'cpu']")
    parsed = []
    for r, d in enumerate(devices):
        try:
            parsed.append(torch.device(d))
        except (RuntimeError, TypeError):
            raise MeshError(f"init_mesh: devices[{r}] = {d!r} is not a torch device; write 'cpu' or 'cuda:0'") from None
        backend_for(parsed[-1].type)  # names an unknown kind
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank >= len(parsed):
        raise MeshError(f"init_mesh: devices= names {len(parsed)} ranks, and this is rank {rank}; give one per rank")
    mine = parsed[rank]
    _device_type(mine.type)  # CUDA asked where there is none
    if mine.type == "cuda" and (mine.index or 0) >= torch.cuda.device_count():
        raise MeshError(
            f"init_mesh: rank {rank} is {mine}, and this machine has {torch.cuda.device_count()} CUDA devices; "
            f"fix devices[{rank}]"
        )
    return mine, len({d.type for d in parsed}) > 1


def devices_mixed() -> bool:
    """Whether the current mesh's ranks mix CPU and CUDA devices (`init_mesh(devices=...)`)."""
    return _mixed and _current_mesh is not None


def timeout_s() -> float:
    """Seconds a rank waits for its peers: cross-rank checks, the process group, the launcher."""
    return _timeout_s


def current_mesh() -> DeviceMesh | None:
    """The mesh from the last `init_mesh` in this process, if any."""
    return _current_mesh


def rank_device() -> torch.device:
    """This rank's device: the current mesh's device type ("cpu" without a mesh), on CUDA the
    current device."""
    kind = _current_mesh.device_type if _current_mesh is not None else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def reset_current_mesh() -> None:
    """Forget the current mesh (after the process group is destroyed)."""
    global _current_mesh, _mixed
    _current_mesh, _mixed = None, False
    clear_dtensor_sharding_cache()
