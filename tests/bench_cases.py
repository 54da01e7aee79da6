"""Rank functions for tests/test_bench.py: the bench's ranks are the session's world
(tests/conftest.py), not ranks `launch` starts afresh for each command."""

from __future__ import annotations

import os


def in_cache_dir(folder: str, fn, *args):
    """``fn(*args)`` (the command's rank function) with ``$TORCH_HCA_CACHE_DIR`` set to `folder`, as a
    command given that variable starts its ranks; then the variable as it was, and nothing the command
    compiled left behind for the world's next tests (a fresh command's ranks end with their process)."""
    import torch

    from torch_hca._torch_private import clear_dtensor_sharding_cache

    before = os.environ.get("TORCH_HCA_CACHE_DIR")
    os.environ["TORCH_HCA_CACHE_DIR"] = folder
    try:
        return fn(*args)
    finally:
        if before is None:
            del os.environ["TORCH_HCA_CACHE_DIR"]
        else:
            os.environ["TORCH_HCA_CACHE_DIR"] = before
        torch._dynamo.reset()
        clear_dtensor_sharding_cache()  # a sharded embedding's mask met by a later compile fails it (bench_run)
