"""Local ranks over gloo on 127.0.0.1: `hca.launch` and the reusable `LocalWorld`.

The rendezvous store is served by the parent on a socket bound to 127.0.0.1
(torch's `TCPStore` would otherwise listen on every interface) and gloo is
pinned to the loopback interface. Work and results travel over
`multiprocessing` pipes between the parent and its own children; the
ranks exchange nothing else by pickle.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

from .errors import HCAError, RankError

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0
# After one rank fails, how long the others get to report before they are killed
# (they are usually blocked in a collective the failed rank never joins).
_GRACE_S = 3.0


def _loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    raise HCAError("hca.launch: no loopback network interface found (looked for 'lo*')")


def _worker_main(rank: int, world_size: int, port: int, conn, timeout_s: float) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=_loopback_interface(),
    )
    import faulthandler
    import signal

    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1)  # the parent asks for stacks before killing a stuck rank
    torch.set_num_threads(1)  # ranks share the machine's cores
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            fn, args = task
            try:
                conn.send(("ok", fn(*args)))
            except BaseException as e:  # report everything, the parent decides
                conn.send(("error", type(e).__name__, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class LocalWorld:
    """`world_size` ranks on this machine with an initialized gloo process group.

    The processes stay alive between `run` calls, so a test suite pays the
    start-up once. A failed or timed-out run kills the world; the next `run`
    starts a fresh one.
    """

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not isinstance(world_size, int) or world_size < 1:
            raise HCAError(f"hca.launch: world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._store = None
        self._listener = None

    def _start(self) -> None:
        import torch.distributed as dist

        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(64)
        port = self._listener.getsockname()[1]
        self._store = dist.TCPStore(
            LOOPBACK, port, None, is_master=True, wait_for_workers=False,
            master_listen_fd=self._listener.fileno(),
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        self._listener.detach()  # the store owns the socket now and closes it
        self._listener = None
        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, self.world_size, port, child, self.timeout_s), daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results in rank order."""
        if not self._procs:
            self._start()
        try:
            for conn in self._conns:
                conn.send((fn, args))
        except (BrokenPipeError, OSError):
            self.close()
            raise RankError(-1, "a dead world", "a rank died before the work was sent") from None
        return self._collect(timeout_s or self.timeout_s)

    def _collect(self, timeout_s: float) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str]] = {}
        waiting = dict(enumerate(self._conns))
        deadline = timeout_s
        while waiting:
            ready = wait(list(waiting.values()) + [self._procs[r].sentinel for r in waiting], timeout=deadline)
            if not ready:
                break
            for rank, conn in list(waiting.items()):
                if conn in ready or self._procs[rank].sentinel in ready:
                    msg = self._receive(rank, conn)
                    del waiting[rank]
                    if msg[0] == "ok":
                        results[rank] = msg[1]
                    else:
                        failures[rank] = (msg[1], msg[2])
            if failures:
                deadline = _GRACE_S
        if failures or waiting:
            self._dump_stacks(waiting)
            self.close()
            if failures:
                # A dead process is the cause; the errors it provokes in its peers are echoes.
                rank = min(failures, key=lambda r: (not failures[r][0].startswith("process exit"), r))
                kind, text = failures[rank]
                others = sorted(set(failures) - {rank})
                if others:
                    text += f"\n(ranks {others} failed too, after it: {[failures[r][0] for r in others]})"
                raise RankError(rank, kind, text)
            rank = min(waiting)
            raise RankError(rank, "a timeout", (
                f"rank(s) {sorted(waiting)} did not finish within {timeout_s:.0f} s "
                f"(finished: {sorted(results)}); their Python stacks were written to stderr"
            ))
        return [results[r] for r in range(self.world_size)]

    def _dump_stacks(self, ranks) -> None:
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        wait([self._procs[r].sentinel for r in ranks], timeout=1.0)  # let them print

    def _receive(self, rank: int, conn) -> tuple:
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        proc = self._procs[rank]
        proc.join(1.0)
        return ("error", f"process exit (code {proc.exitcode})", f"rank {rank}'s process ended unexpectedly")

    def close(self) -> None:
        """Stop the ranks (politely if idle, by force if not)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._store = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(*args)`` on `world_size` local gloo ranks; return each rank's result.

    ``fn`` must be importable (a module-level function). A rank's exception is
    raised here as `RankError` with its rank and traceback; the other ranks
    are stopped rather than left hanging.
    """
    with LocalWorld(world_size, timeout_s) as world:
        return world.run(fn, *args)


def run(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Entry point for scripts: ``fn(*args)`` on every rank, with or without torchrun.

    Under torchrun (``RANK`` is set) this process is one rank: call ``fn`` here,
    then close the process group once every rank is done. Otherwise start
    `world_size` local gloo ranks with `launch`.
    """
    if "RANK" in os.environ:
        import torch.distributed as dist

        fn(*args)
        if dist.is_initialized():
            # A rank that tears gloo down while another still talks to it can make
            # both abort at exit ("terminate called without an active exception").
            dist.barrier()
            dist.destroy_process_group()
    else:
        launch(fn, world_size, *args)
