"""Checkpoints that cannot be half-written: `hca.save` / `hca.load` over DCP.

A checkpoint path is a directory of versions and one pointer::

    path/
      LATEST            "v00000007": the published checkpoint, replaced atomically
      v00000006/        the one before, kept until a newer one is published
      v00000007/        DCP files (__0_0.distcp, __1_0.distcp, .metadata) and hca.json
      .tmp-v00000008/   a save in progress (or interrupted): never read

A save writes a fresh ``.tmp-*`` directory with `torch.distributed.checkpoint`.
Once every rank has reported its files written (and fsynced), rank 0 writes
the manifest ``hca.json`` (the plan and every file's size), renames the
directory into place, and replaces ``LATEST`` (write, fsync, rename). Until
that last rename, ``LATEST`` and the directory it names are untouched: a rank
killed at any point before it leaves the previous checkpoint as it was; after
it, the new one is complete. `load` reads only what ``LATEST`` names, and
checks its files against the manifest before reading them.

Faults are injected in tests through `fault_hook`, called at each of
`FAULT_POINTS` with the point and the directory being written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from torch_hca.errors import HCAError
from torch_hca.spmd.placements import dtype_str
from torch_hca.runtime.exchange import exchange, needs_exchange

LATEST = "LATEST"
MANIFEST = "hca.json"
FORMAT = "torch_hca checkpoint 1"
_VERSION = re.compile(r"v(\d{8})")
_TMP = ".tmp-"
_COMPILED = "_orig_mod."  # the prefix torch.compile's wrapper adds to parameter names

# Where a save can be interrupted, in order: every rank before writing, every rank
# once its own files are written, every rank once all are written, rank 0 after
# renaming the new directory into place, rank 0 after replacing LATEST.
FAULT_POINTS = ("begin", "written", "complete", "renamed", "published")
fault_hook: Callable[[str, str], None] | None = None  # tests set it (e.g. to os._exit at one point)


class CheckpointError(HCAError):
    """A checkpoint is missing, incomplete, or of another model or plan."""


def _fault(point: str, directory: str) -> None:
    if fault_hook is not None:
        fault_hook(point, directory)


# ----------------------------------------------------------------------------- ranks agreeing


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def on_rank0(fn: Callable[[], dict], what: str) -> dict:
    """Run `fn` on rank 0 only and give every rank its result, or raise its error on every rank.

    Decisions about the directory are rank 0's alone (one view of the file
    system); the others learn them through the store, so an error raised
    there is raised everywhere instead of leaving peers waiting.
    """
    mine: dict = {}
    if _rank() == 0:
        try:
            mine = fn()
        except (HCAError, OSError, ValueError) as e:
            mine = {"error": str(e) if isinstance(e, CheckpointError) else f"{what}: {type(e).__name__}: {e}"}
    if needs_exchange():
        texts = exchange("checkpoint", json.dumps(mine), range(dist.get_world_size()), what)
        mine = mine if _rank() == 0 else json.loads(texts[0])
    if "error" in mine:
        raise CheckpointError(mine["error"])
    return mine


def _gather(mine: dict, what: str) -> list[dict]:
    """Every rank's `mine`, in rank order."""
    if not needs_exchange():
        return [mine]
    texts = exchange("checkpoint", json.dumps(mine), range(dist.get_world_size()), what)
    texts[_rank()] = json.dumps(mine)
    return [json.loads(texts[r]) for r in sorted(texts)]


# ----------------------------------------------------------------------------- files


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class _Writer(FileSystemWriter):
    """DCP's file writer (fsyncs its files), noting the files this rank wrote."""

    def __init__(self, path: str):
        super().__init__(path)
        self.directory = path
        self.files: dict[str, int] = {}

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        for result in done.wait():
            name = result.storage_data.relative_path
            self.files[name] = os.path.getsize(os.path.join(self.directory, name))
        _fault("written", self.directory)
        return done


def _versions(root: str) -> list[str]:
    return sorted(e for e in os.listdir(root) if _VERSION.fullmatch(e))


def _prepare(root: str, what: str) -> dict:
    """Rank 0: check `root` is ours, drop interrupted saves, make the next version's temporary directory."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"{what}: {root} is a file; give hca.save a directory (it keeps versions there)")
    os.makedirs(root, exist_ok=True)
    entries = os.listdir(root)
    foreign = sorted(e for e in entries if e != LATEST and not _VERSION.fullmatch(e) and not e.startswith(_TMP))
    if foreign:
        raise CheckpointError(
            f"{what}: {root} holds {foreign[:5]}, so it is not a torch_hca checkpoint directory; give "
            "hca.save a new or empty directory (it keeps v*/ versions and a LATEST file there)"
        )
    for e in entries:
        if e.startswith(_TMP):  # an interrupted save: never published, never read
            shutil.rmtree(os.path.join(root, e))
    versions = _versions(root)
    version = f"v{int(versions[-1][1:]) + 1 if versions else 1:08d}"
    os.mkdir(os.path.join(root, _TMP + version))
    return {"version": version}


def _publish(root: str, version: str, manifest: dict, keep: int) -> dict:
    """Rank 0, once every rank has written: manifest, rename into place, then LATEST."""
    tmp, final = os.path.join(root, _TMP + version), os.path.join(root, version)
    _write_durably(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    _fault("renamed", final)
    _write_durably(os.path.join(root, _TMP + LATEST), version + "\n")
    os.replace(os.path.join(root, _TMP + LATEST), os.path.join(root, LATEST))
    _fsync_dir(root)
    _fault("published", final)
    for old in _versions(root)[:-keep]:
        if old != version:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return {"version": version}


def _find(root: str, what: str) -> dict:
    """Rank 0: the published version's directory and manifest, its files checked."""
    if not os.path.isdir(root):
        raise CheckpointError(
            f"{what}: no checkpoint at {root} (no such directory); hca.save(model, optimizer, path) writes one"
        )
    if os.path.exists(os.path.join(root, MANIFEST)):  # one version's directory, named directly
        directory = root
    elif os.path.exists(os.path.join(root, LATEST)):
        with open(os.path.join(root, LATEST)) as f:
            version = f.read().strip()
        directory = os.path.join(root, version)
        if not _VERSION.fullmatch(version) or not os.path.isdir(directory):
            raise CheckpointError(
                f"{what}: {root}/LATEST names {version!r}, which is not there (the directory was changed "
                f"outside hca.save); load a version directly: hca.load(model, optimizer, {root!r} + '/v...')"
            )
    else:
        unpublished = sorted(e for e in os.listdir(root) if e.startswith(_TMP) or _VERSION.fullmatch(e))
        raise CheckpointError(
            f"{what}: no published checkpoint in {root} (no {LATEST} file"
            + (f"; {unpublished} are saves that never finished publishing" if unpublished else "")
            + "); hca.save publishes a checkpoint once every rank has written it"
        )
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{what}: {directory} has no readable {MANIFEST} ({e}): it was not written by hca.save"
        ) from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{what}: {directory}/{MANIFEST} is not a {FORMAT!r} manifest")
    for name, size in manifest["files"].items():
        file = os.path.join(directory, name)
        actual = os.path.getsize(file) if os.path.exists(file) else None
        if actual != size:
            raise CheckpointError(
                f"{what}: {directory} is damaged: {name} is "
                + ("missing" if actual is None else f"{actual} bytes")
                + f", hca.save wrote {size} bytes; load an earlier version (a v*/ directory in {root}) or save again"
            )
    return {"dir": directory, "manifest": manifest}


# ----------------------------------------------------------------------------- the plan a checkpoint holds


def _describe(model: nn.Module) -> dict[str, dict]:
    """Each parameter's global shape, dtype and layout: what a checkpoint must match."""
    out = {}
    for name, p in model.named_parameters():
        name = name.replace(_COMPILED, "")  # DCP's names, the same whether `model` is compiled or not
        layout = None
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            layout = {"placements": [str(q) for q in p.placements], "mesh": list(mesh.shape)}
        out[name] = {"shape": list(p.shape), "dtype": dtype_str(p.dtype), "layout": layout}
    return out


def _check_fits(model: nn.Module, optimizer, manifest: dict, reshard: bool, what: str) -> None:
    saved, here = manifest["parameters"], _describe(model)
    lacking, extra = sorted(set(here) - set(saved)), sorted(set(saved) - set(here))
    if lacking or extra:
        raise CheckpointError(
            f"{what}: the checkpoint is of another model: it lacks parameters {lacking[:5]} of this model"
            f" and has {extra[:5]} this model lacks; load it into the model it was saved from"
        )
    for name, mine in here.items():
        theirs = saved[name]
        if mine["shape"] != theirs["shape"]:
            raise CheckpointError(
                f"{what}: parameter {name!r} has shape {tuple(theirs['shape'])} in the checkpoint and "
                f"{tuple(mine['shape'])} in the model; load it into a model of the configuration it was saved from"
            )
        if not reshard and mine["layout"] != theirs["layout"]:
            raise CheckpointError(
                f"{what}: parameter {name!r} was saved laid out as {_layout_text(theirs['layout'])} and is "
                f"{_layout_text(mine['layout'])} here (another plan or mesh); pass reshard=True to load it "
                "into this layout (DCP moves the pieces)"
            )
    if optimizer is not None and not manifest["optimizer"]:
        raise CheckpointError(
            f"{what}: the checkpoint has no optimizer state; pass optimizer=None to load the model alone"
        )


def _layout_text(layout: dict | None) -> str:
    if layout is None:
        return "a plain tensor"
    return f"({', '.join(layout['placements'])}) over a {tuple(layout['mesh'])} mesh"


def _first_failure(e: CheckpointException) -> str:
    failure = next(iter(e.failures.values()), None)  # (exception, traceback) as DCP wraps them
    failure = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(failure).__name__}: {failure}" if failure is not None else "see the ranks' logs"


@contextlib.contextmanager
def _one_process_quietly():
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state(model: nn.Module, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


# ----------------------------------------------------------------------------- the API


def save(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike,
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> str:
    """Write `model` (and `optimizer`'s state) to the directory `path`, atomically; return the version's directory.

    Every rank calls it. The checkpoint is published (``path/LATEST`` names
    it) only after every rank has written its pieces; until then the
    previous one stays published and intact. ``extra``: JSON-able values kept
    with it (a step count), returned by `load`. ``keep``: how many published
    versions stay on disk (the newest ones; at least 1).
    """
    root = os.fspath(path)
    what = f"hca.save({root!r})"
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"{what}: keep={keep!r}; give how many versions to keep, an int >= 1")
    try:
        extra_text = json.dumps(dict(extra or {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what}: extra must hold JSON values (numbers, strings, lists, dicts): {e}") from None
    version = on_rank0(lambda: _prepare(root, what), what)["version"]
    tmp = os.path.join(root, _TMP + version)
    _fault("begin", tmp)
    writer = _Writer(tmp)
    try:
        with _one_process_quietly():
            dcp.save(_state(model, optimizer), storage_writer=writer, no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise CheckpointError(
            f"{what}: writing failed on rank(s) {sorted(e.failures)}: {_first_failure(e)}; nothing was "
            "published, the previous checkpoint is still the one loaded"
        ) from e
    files: dict[str, int] = {}
    for written in _gather(writer.files, what):  # every rank has written and fsynced its files
        files.update(written)
    _fault("complete", tmp)
    manifest = {
        "format": FORMAT,
        "version": version,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "parameters": _describe(model),
        "optimizer": optimizer is not None,
        "extra": json.loads(extra_text),
        "files": files,
    }

    def publish() -> dict:
        manifest["files"][".metadata"] = os.path.getsize(os.path.join(tmp, ".metadata"))
        return _publish(root, version, manifest, keep)

    on_rank0(publish, what)
    return os.path.join(root, version)


def load(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *, reshard: bool = False
) -> dict[str, Any]:
    """Load the checkpoint published at `path` into `model` (and `optimizer`); return its ``extra``.

    Every rank calls it. `path` is what `save` was given (its ``LATEST`` is
    loaded) or one of its ``v*`` directories. The model must have the saved
    parameters and shapes; a different layout (another plan or mesh) is an
    error unless ``reshard=True``. Raises `CheckpointError` on a missing,
    unpublished or damaged checkpoint, naming what is wrong.
    """
    root = os.fspath(path)
    what = f"hca.load({root!r})"
    found = on_rank0(lambda: _find(root, what), what)
    manifest = found["manifest"]
    _check_fits(model, optimizer, manifest, reshard, what)
    state = _state(model, optimizer)
    try:
        with _one_process_quietly():
            dcp.load(state, checkpoint_id=found["dir"], no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise CheckpointError(
            f"{what}: reading {found['dir']} failed on rank(s) {sorted(e.failures)}: {_first_failure(e)}"
        ) from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return manifest["extra"]


def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any] | str | os.PathLike, *, strict: bool = True
) -> None:
    """Load a single-device state dict (or a file ``torch.save`` wrote of one) into a sharded model.

    Every rank passes the same full tensors; each keeps its own piece (no
    communication). ``model.load_state_dict(state_dict)`` does the same; this
    checks the names and shapes first and says what does not match.
    """
    what = "hca.load_full_state_dict"
    if isinstance(state_dict, (str, os.PathLike)):
        what += f"({os.fspath(state_dict)!r})"
        try:
            state_dict = torch.load(state_dict, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch.load's errors are of many kinds; say which file
            raise CheckpointError(f"{what}: cannot read it as a state dict: {e}") from e
    if isinstance(state_dict, nn.Module):
        state_dict = state_dict.state_dict()
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"{what}: expected a state dict (name -> tensor), got {type(state_dict).__name__}")
    expected = model.state_dict()
    lacking, extra = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if strict and (lacking or extra):
        hint = ""
        prefix = os.path.commonprefix(extra) if extra else ""
        if "." in prefix:
            hint = f"; the keys it has start with {prefix[: prefix.rindex('.') + 1]!r}: strip that prefix"
        raise CheckpointError(
            f"{what}: the state dict lacks {lacking[:5]} and has {extra[:5]} the model does not"
            f"{hint} (or pass strict=False)"
        )
    for name in sorted(set(expected) & set(state_dict)):
        value, want = state_dict[name], expected[name]
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{what}: {name!r} has shape {tuple(value.shape)} in the state dict; the model's full "
                f"(single-device) shape is {tuple(want.shape)}. Give full tensors, as one device holds them; "
                "each rank keeps its own piece"
            )
    model.load_state_dict(state_dict, strict=strict)
