"""Work the fault tests (tests/test_faults.py) run on local ranks: importable by spawned ranks, no pytest."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import torch
import torch.distributed as dist

import torch_hca as hca
from torch_hca.runtime import mesh

C = hca.collectives


def timeouts() -> tuple[float, float]:
    """(this rank's peer timeout, its process group's timeout), in seconds."""
    from torch.distributed.distributed_c10d import _get_default_group

    backend = _get_default_group()._get_backend(torch.device("cpu"))
    return mesh.timeout_s(), backend.options._timeout.total_seconds()


def work_longer_than(seconds: float) -> float:
    """A job longer than the timeout whose ranks stay alive: it must not be cut."""
    time.sleep(seconds)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


# ---------------------------------------------------- hca.collectives checks


def _call(case: str, rank: int) -> torch.Tensor:
    if case == "shape":
        return C.all_reduce(torch.ones(4, 8 + rank), src="P", dst="R")
    if case == "dtype":
        return C.all_reduce(torch.ones(4, dtype=torch.float64 if rank else torch.float32), src="P", dst="R")
    if case == "roles":
        return C.all_reduce(torch.ones(4), src="P", dst="I" if rank else "R")
    if case == "op":
        x = torch.ones(4, 2)
        return C.all_gather(x, src="S(0)", dst="R") if rank else C.all_reduce(x, src="P", dst="R")
    if case == "root":
        return C.broadcast(torch.ones(3), src="V", dst="R", root=rank)
    raise ValueError(case)


def mismatched(case: str) -> tuple[str, str, float, float]:
    """(error class, message, seconds to it, the value of a good all_reduce after it) on each rank."""
    rank = dist.get_rank()
    dist.barrier()
    start = time.perf_counter()
    try:
        _call(case, rank)
        kind, message = "none", ""
    except hca.HCAError as e:
        kind, message = type(e).__name__, str(e)
    seconds = time.perf_counter() - start
    # Both ranks stopped before gloo: the group still works.
    after = C.all_reduce(torch.ones(1), src="P", dst="R").item()
    return kind, message, seconds, after


def backward_against_forward() -> tuple[str, str]:
    """The forward calls agree; then rank 0 runs backward (an all_reduce) while rank 1 calls a forward one."""
    x = torch.ones(4, requires_grad=True)
    y = C.all_reduce(x, src="P", dst="I")
    try:
        if dist.get_rank() == 0:
            y.sum().backward()
        else:
            C.all_reduce(torch.ones(4), src="P", dst="I")
        return "none", ""
    except hca.HCAError as e:
        return type(e).__name__, str(e)


def on_one_rank_only() -> tuple[str, str, float]:
    """Rank 0 calls a collective rank 1 never calls: (error class, message, seconds to it)."""
    if dist.get_rank() != 0:
        return "none", "", 0.0
    start = time.monotonic()
    try:
        C.all_reduce(torch.ones(4), src="P", dst="R")
        return "none", "", time.monotonic() - start
    except hca.HCAError as e:
        return type(e).__name__, str(e), time.monotonic() - start


def check_cost(calls: int, numel: int) -> dict[str, float]:
    """Microseconds per eager call: gloo all_reduce, hca.collectives with and without its check."""
    x = torch.ones(numel)

    def per_call(fn) -> float:
        for _ in range(5):
            fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    gloo = per_call(lambda: dist.all_reduce(x.clone()))
    checked = per_call(lambda: C.all_reduce(x, src="P", dst="R"))
    with C.unchecked():
        unchecked = per_call(lambda: C.all_reduce(x, src="P", dst="R"))
    return {"gloo": gloo, "checked": checked, "unchecked": unchecked}


# ------------------------------------------------------------ killed ranks


def die_mid_job(how: str, where: str, folder: str) -> int:
    """Both ranks train; at step 3 rank 1 dies (`how`, its time of death in `folder`/died),
    while rank 0 goes on into gloo or into the call check of `hca.collectives`."""
    rank = dist.get_rank()
    for step in range(1000):
        if rank == 1 and step == 3:
            pathlib.Path(folder, "died").write_text(repr(time.time()))
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)
        t = torch.ones(1000)
        if where == "gloo":
            dist.all_reduce(t)
        else:
            C.all_reduce(t, src="P", dst="R")
        time.sleep(0.05)
    return 0


def write_pid_and_train(folder: str) -> None:
    """A long job: write this rank's pid, then train until stopped."""
    pathlib.Path(folder, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    while True:
        t = torch.ones(1000)
        dist.all_reduce(t)
        time.sleep(0.05)


# --------------------------------------------- evaluation on one rank only


def evaluate_on_rank_zero_only() -> tuple[str, str, float]:
    """`if rank == 0: evaluate(model)` (issue 29): rank 0 compiles an evaluation graph (no_grad) while
    rank 1 trains on. (error type, message, seconds until the error) on each rank."""
    from torch_hca.tools import zoo

    hca.init_mesh()
    torch.manual_seed(0)
    model = hca.sharded({}, inputs=hca.Shard(0), outputs=hca.Shard(0))(zoo.MLP())
    compiled = torch.compile(model, backend="hca")
    x = torch.randn(4, 16)
    compiled(x).sum().backward()
    start = time.monotonic()
    try:
        if dist.get_rank() == 0:
            model.eval()
            with torch.no_grad():
                compiled(x)
        compiled(x).sum().backward()
    except Exception as e:
        e = getattr(e, "inner_exception", e)  # Dynamo's BackendCompilerFailed
        return type(e).__name__, str(e), time.monotonic() - start
    return "none", "", time.monotonic() - start


def evaluate_eagerly_on_rank_zero_only(plan_name: str) -> tuple[str, str, float]:
    """`if rank == 0: model(x)` outside torch.compile while rank 1 trains compiled on, the MLP
    stored by `plan_name` ("megatron": its collectives need both ranks; "dp": replicated, they
    need none). (error type, message, seconds until the error) on each rank."""
    from torch_hca.tools import zoo

    hca.init_mesh()
    torch.manual_seed(0)
    plan = zoo.MEGATRON_MLP if plan_name == "megatron" else {}
    model = hca.sharded(plan, inputs=hca.Shard(0), outputs=hca.Shard(0))(zoo.MLP())
    compiled = torch.compile(model, backend="hca")
    x = torch.randn(4, 16)
    compiled(x).sum().backward()
    with torch.no_grad():
        model(x)  # every rank at once: fine under any plan
    start = time.monotonic()
    try:
        if dist.get_rank() == 0:
            with torch.no_grad():
                model(x)
        compiled(x).sum().backward()
    except Exception as e:
        e = getattr(e, "inner_exception", e)
        return type(e).__name__, str(e), time.monotonic() - start
    return "none", "", time.monotonic() - start
