"""Local ranks over gloo on 127.0.0.1: `hca.launch` and the reusable `LocalWorld`.

The rendezvous store is served by the parent on a socket bound to 127.0.0.1
(torch's `TCPStore` would otherwise listen on every interface) and gloo is
pinned to the loopback interface. Work and results travel over
`multiprocessing` pipes between the parent and its own children; the
ranks exchange nothing else by pickle.

Faults end the run, named, and never outlive it:

    a rank raises or dies         -> RankError naming it (a dead one before the
                                     errors it provokes in its peers), at once
    a rank waits for a peer       -> gloo / the store checks give up after
                                     timeout_s (one setting: torch_hca.runtime.mesh.timeout_s)
    the launcher is killed        -> its ranks die with it (parent-death signal,
                                     and a thread watching the parent's pid)
    SIGINT / SIGTERM to launcher  -> forwarded to the ranks while they work
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

from torch_hca.errors import HCAError, RankError
from torch_hca.runtime.mesh import DEFAULT_TIMEOUT_S, check_timeout

LOOPBACK = "127.0.0.1"
# After one rank fails, how long the others get to report before they are killed
# (they are usually blocked in a collective the failed rank never joins).
_GRACE_S = 3.0
# After a rank died: only long enough to see whether others died with it.
_DEATH_GRACE_S = 0.5
# How often a rank checks that its launcher is still alive (where the kernel cannot tell it).
_PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def _loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    raise HCAError("hca.launch: no loopback network interface found (looked for 'lo*')")


def _die_with_parent(parent_pid: int, by_signal: bool) -> None:
    """End this rank when the launcher `parent_pid` ends, however it ends (SIGKILL included).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started us exits, so it is
    asked for only when the launcher started us from its main thread; a thread
    polling the parent pid covers the rest (and non-Linux systems).
    """
    if by_signal and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="hca-watch-launcher", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # re-parented once the launcher is gone
        time.sleep(_PARENT_POLL_S)
    os.write(2, f"hca rank {os.getpid()}: the launcher (pid {parent_pid}) is gone; exiting\n".encode())
    os._exit(1)


# glibc's mallopt() parameters, and how much freed memory a rank keeps for its next step.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEPT_BYTES = 1 << 30
# Set by a user who chose glibc's behaviour: then it is theirs.
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Let this process's C allocator keep the memory a training step frees, for the next step.

    glibc hands a large block back to the kernel when it is freed (a block above the mmap
    threshold is unmapped; a free heap top above the trim threshold is trimmed), so the
    next step's tensors of the same sizes fault in fresh pages. On a 2-core VM that made a
    3 MiB bucket concatenation take 2.0 ms in the step against 0.35 ms alone, and hca's
    data-parallel step about 10% slower (docs/notes/bench-log.md, "keeping freed memory"). Both
    thresholds go to 1 GiB: what a step frees stays in the process, where steady training
    reuses it. Returns whether it applied: not where the C library is not glibc, nor where
    the environment sets glibc's malloc variables (the user's choice, kept).
    """
    if any(name in os.environ for name in _MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEPT_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEPT_BYTES))


def _worker_main(
    rank: int, world_size: int, port: int, conn, timeout_s: float, parent: tuple[int, bool], crash_log: str
) -> None:
    _die_with_parent(*parent)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=_loopback_interface(),
    )
    import faulthandler
    import signal

    import torch
    import torch.distributed as dist

    from torch_hca.runtime import mesh

    # A crash in native code (SIGSEGV, SIGABRT) leaves this rank's Python stack where the parent reads it.
    faulthandler.enable(file=open(crash_log, "w"), all_threads=True)  # noqa: SIM115 (open for the process's life)
    faulthandler.register(signal.SIGUSR1)  # the parent asks for stacks before killing a stuck rank
    torch.set_num_threads(1)  # ranks share the machine's cores
    keep_freed_memory()
    # the store checks in this rank wait as long as the process group
    mesh.set_timeout(timeout_s, "hca.launch(timeout_s=...) (hca.run, hca.LocalWorld: timeout_s=...)")
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


@contextlib.contextmanager
def _forwarding_signals(pids: list[int]):
    """While the ranks work, SIGINT and SIGTERM to this process go to them too.

    Then the handler this process had runs: SIGINT raises KeyboardInterrupt
    (and `run` closes the world), SIGTERM ends the process as before. Python
    sets handlers only in the main thread; from other threads nothing is
    forwarded, and the ranks still die with this process (`_die_with_parent`).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def forward(signum, frame):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        _chain(previous[signum], signum, frame)

    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler not in (signal.SIG_IGN, None):  # None: set outside Python, leave it alone
            previous[sig] = handler
            signal.signal(sig, forward)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _chain(handler, signum: int, frame) -> None:
    if callable(handler):
        handler(signum, frame)
    else:  # SIG_DFL: end as the signal would have ended us
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class LocalWorld:
    """`world_size` ranks on this machine with an initialized gloo process group.

    The processes stay alive between `run` calls, so a test suite pays the
    start-up once. A failed or timed-out run kills the world; the next `run`
    starts a fresh one.

    ``timeout_s`` is how long a rank waits for its peers (the process group, and
    `torch_hca.runtime.mesh.timeout_s()` in every rank), not a limit on a run's length.
    """

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise HCAError(f"hca.launch: world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout_s = check_timeout(timeout_s, "hca.LocalWorld(timeout_s=...)")
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._crash_logs: list[str] = []
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
            LOOPBACK,
            port,
            None,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=self._listener.fileno(),
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        self._listener.detach()  # the store owns the socket now and closes it
        self._listener = None
        ctx = mp.get_context("spawn")
        me = (os.getpid(), threading.current_thread() is threading.main_thread())
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            fd, crash_log = tempfile.mkstemp(prefix=f"hca-rank{rank}-", suffix=".crash")
            os.close(fd)
            self._crash_logs.append(crash_log)
            args = (rank, self.world_size, port, child, self.timeout_s, me, crash_log)
            p = ctx.Process(target=_worker_main, args=args, daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results in rank order.

        A run lasts as long as its ranks work; ``timeout_s``, if given, is a
        deadline for this run (the ranks still at work are then killed).
        """
        if timeout_s is not None:
            check_timeout(timeout_s, "LocalWorld.run(timeout_s=...)")
        if not self._procs:
            self._start()
        try:
            for conn in self._conns:
                conn.send((fn, args))
        except (BrokenPipeError, OSError):
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()] or [-1]
            self.close()
            raise RankError(dead[0], "a dead world", f"rank(s) {dead} died before the work was sent") from None
        try:
            with _forwarding_signals([p.pid for p in self._procs]):
                return self._collect(timeout_s)
        except BaseException:  # KeyboardInterrupt, or a forwarded signal's handler: the ranks stop too
            self.close()
            raise

    def _collect(self, timeout_s: float | None) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str]] = {}
        waiting = dict(enumerate(self._conns))
        deadline = timeout_s  # None: as long as the ranks live
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
                died = any(kind.startswith("process exit") for kind, _ in failures.values())
                deadline = _DEATH_GRACE_S if died else _GRACE_S
        if failures or waiting:
            self._fail(results, failures, sorted(waiting), timeout_s)
        return [results[r] for r in range(self.world_size)]

    def _fail(self, results: dict, failures: dict[int, tuple[str, str]], waiting: list[int], timeout_s) -> None:
        """Stop the world and raise the `RankError` that names the cause."""
        # A dead process is the cause; the errors it provokes in its peers are echoes,
        # and where the survivors wait (for it) is no news: no stacks, no grace.
        dead = [r for r in sorted(failures) if failures[r][0].startswith("process exit")]
        if not dead:
            self._dump_stacks(waiting)
        for rank in waiting:  # busy, so deaf to a polite stop
            self._procs[rank].kill()
        self.close()
        if failures:
            rank = (dead or sorted(failures))[0]
            kind, text = failures[rank]
            others = sorted(set(failures) - {rank})
            if others:
                text += f"\n(ranks {others} failed too, after it: {[failures[r][0] for r in others]})"
            if waiting:
                text += f"\n(ranks {waiting} were still at work and were stopped)"
            raise RankError(rank, kind, text)
        raise RankError(
            waiting[0],
            "a timeout",
            (
                f"rank(s) {waiting} did not finish within the run's deadline of {timeout_s:.0f} s "
                f"(LocalWorld.run(timeout_s=...); finished: {sorted(results)}); their Python stacks "
                "were written to stderr"
            ),
        )

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
        text = f"rank {rank}'s process ended unexpectedly"
        with contextlib.suppress(OSError):
            stack = open(self._crash_logs[rank]).read().strip()
            if stack:
                text += f"; where it crashed (faulthandler):\n{stack}"
        return ("error", f"process exit (code {proc.exitcode})", text)

    def close(self) -> None:
        """Stop the ranks (politely if idle, by force if not)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()
        for crash_log in self._crash_logs:
            with contextlib.suppress(OSError):
                os.remove(crash_log)
        self._procs, self._conns, self._crash_logs = [], [], []
        self._store = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_importable(fn: Any, where: str) -> None:
    """The ranks are fresh processes: they find `fn` by its module and name."""
    if not callable(fn):
        raise HCAError(f"{where}: fn={fn!r} is not callable; pass a module-level function, e.g. launch(main, 2)")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise HCAError(
            f"{where}: fn={qualname} is a lambda or a nested function, which the rank processes cannot import; "
            "define it as a module-level function"
        )


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(*args)`` on `world_size` local gloo ranks; return each rank's result.

    ``fn`` must be importable (a module-level function). A rank's exception is
    raised here as `RankError` with its rank and traceback; the other ranks
    are stopped rather than left hanging. ``timeout_s`` is how long a rank
    waits for its peers (see `LocalWorld`); the job itself may run as long as
    its ranks work. Each rank runs torch on one thread and keeps the memory
    its steps free (`keep_freed_memory`).
    """
    timeout_s = check_timeout(timeout_s, "hca.launch(timeout_s=...)")
    _check_importable(fn, "hca.launch")
    with LocalWorld(world_size, timeout_s) as world:
        return world.run(fn, *args)


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = None) -> None:
    """Entry point for scripts: ``fn(*args)`` on every rank, with or without torchrun.

    Under torchrun (``RANK`` is set) this process is one rank: call ``fn`` here
    (keeping freed memory, as `launch`'s ranks do), then close the process group
    once every rank is done. Otherwise start `world_size` local gloo ranks with
    `launch`. ``timeout_s`` (default 300) is how long a rank waits for its
    peers, as in `launch`; there is no limit on the job's length.
    """
    if timeout_s is not None:
        timeout_s = check_timeout(timeout_s, "hca.run(timeout_s=...)")
    if "RANK" in os.environ:
        import torch.distributed as dist

        from torch_hca.runtime.mesh import set_timeout

        if timeout_s is not None:
            set_timeout(timeout_s)  # the process group init_mesh creates, and the store checks
        keep_freed_memory()  # as launch's ranks do
        fn(*args)
        if dist.is_initialized():
            # A rank that tears gloo down while another still talks to it can make
            # both abort at exit ("terminate called without an active exception").
            dist.barrier()
            dist.destroy_process_group()
    else:
        launch(fn, world_size, *args, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
