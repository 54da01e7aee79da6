"""Functions the launch tests run on local ranks (importable by spawned ranks)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import torch_hca as hca


def rank_and_sum(offset: int) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), os.getpid(), t.item()


def raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    t = torch.ones(1)
    dist.all_reduce(t)  # blocks: rank 1 never joins
    return 0


def crash_on_rank_1() -> int:
    if dist.get_rank() == 1:
        _crash_in_native_code()
    t = torch.ones(1)
    dist.all_reduce(t)
    return 0


def _crash_in_native_code() -> None:
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV


def die_on_rank_1() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)
    return 0


def listening_addresses(pid: int | None = None) -> list[str]:
    """Local addresses of the TCP sockets process `pid` (default: this one) listens on."""
    pid = pid or os.getpid()
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    found.append(_address(local))
    return found


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    if len(host) == 8:  # IPv4, little-endian
        return ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"
    return f"[{host}]:{int(port, 16)}"


def rank_listeners_after_collective() -> list[str]:
    t = torch.ones(1)
    dist.all_reduce(t)  # gloo's pair sockets exist by now
    return listening_addresses()


def mesh_backend() -> str:
    mesh = hca.init_mesh()
    return f"{dist.get_backend()} {mesh.device_type} {tuple(mesh.shape)}"


def rss_drop_after_freeing_64_mib() -> int:
    """Bytes this process's resident set shrinks by when a 64 MiB tensor is freed: about 64 MiB
    where the C allocator hands the block back to the kernel, about 0 where it keeps it."""

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    t = torch.ones(16 * 2**20)  # every page touched
    held = rss()
    del t
    return held - rss()


def leaving_nothing_compiled(fn, *args):
    """``fn(*args)``, then nothing it compiled left for the world's next tests (a command's own ranks end
    with their process): Dynamo's caches and DTensor's sharding decisions cleared."""
    from torch_hca._torch_private import clear_dtensor_sharding_cache

    try:
        return fn(*args)
    finally:
        torch._dynamo.reset()
        clear_dtensor_sharding_cache()


def example_main(path: str) -> str:
    """Run ``main()`` of the example script at `path` on this rank, as each rank that ``hca.run(main, n)``
    starts does (the script imported by path as a module, not run as ``__main__``); return what it printed."""
    import contextlib
    import importlib.util
    import io
    import sys

    name = "hca_example_" + os.path.basename(path).removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # Dynamo looks its classes up by name
    out = io.StringIO()
    try:
        torch._dynamo.reset()
        with contextlib.redirect_stdout(out):
            spec.loader.exec_module(module)
            leaving_nothing_compiled(module.main)
    finally:
        del sys.modules[name]
    return out.getvalue()
