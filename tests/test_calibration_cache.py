"""The calibration cache (`torch_hca.spmd.cost_model`): one entry per (host, world size, backend,
torch version), read back only on an exact match; a broken file is ignored with a warning.
`hca.calibrate(cache=True)` follows rank 0's cache on every rank."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist

import torch_hca as hca
from torch_hca.spmd.cost_model import CACHE_FILE, cache_dir, cached_calibration, store_calibration

FIGURES = {"launch_s": 2e-4, "alpha_s": 0.0, "bytes_per_s": 1.5e9, "flops_per_s": 9e10, "memory_bytes_per_s": 2e10, "sync_s": 1e-3,
           "op_s": 7e-6, "call_s": 5e-4, "param_s": 4e-5, "gather_bytes_per_s": 1.1e9, "scatter_bytes_per_s": 0.7e9,
           "contention": 0.4, "matmul_half_dim": 8.0}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HCA_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_HCA_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "torch_hca"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "torch_hca"
    monkeypatch.setenv("TORCH_HCA_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_write_then_read(folder):
    path = store_calibration(FIGURES, 2, "gloo")
    assert path == folder / CACHE_FILE
    assert cached_calibration(2, "gloo") == FIGURES
    (entry,) = json.loads(path.read_text())["entries"]
    assert entry["host"] == socket.gethostname() and entry["torch"] == torch.__version__


def test_a_store_replaces_its_own_key_and_keeps_the_others(folder):
    store_calibration(FIGURES, 2, "gloo")
    store_calibration({**FIGURES, "launch_s": 1e-3}, 4, "gloo")
    store_calibration({**FIGURES, "bytes_per_s": 3e9}, 2, "gloo")
    assert cached_calibration(2, "gloo")["bytes_per_s"] == 3e9
    assert cached_calibration(4, "gloo")["launch_s"] == 1e-3
    assert len(json.loads((folder / CACHE_FILE).read_text())["entries"]) == 2


@pytest.mark.parametrize("change", ["world_size", "backend", "host", "torch"])
def test_any_other_key_misses(folder, monkeypatch, change):
    store_calibration(FIGURES, 2, "gloo")
    world, backend = (4 if change == "world_size" else 2), ("nccl" if change == "backend" else "gloo")
    if change == "host":
        monkeypatch.setattr(socket, "gethostname", lambda: "another-host")
    if change == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cached_calibration(world, backend) is None


def test_no_file_is_a_quiet_miss(folder, recwarn):
    assert cached_calibration(2, "gloo") is None
    assert not recwarn.list


@pytest.mark.parametrize("text", ["{not json", '{"entries": 3}', "[]", ""])
def test_a_corrupted_file_is_ignored_with_a_warning_and_replaced(folder, text):
    (folder / CACHE_FILE).write_text(text)
    with pytest.warns(UserWarning, match="ignoring the calibration cache .*calibration.json"):
        assert cached_calibration(2, "gloo") is None
    with pytest.warns(UserWarning, match="ignoring the calibration cache"):
        store_calibration(FIGURES, 2, "gloo")
    assert cached_calibration(2, "gloo") == FIGURES


@pytest.mark.parametrize("figures", [{**FIGURES, "bytes_per_s": 0}, {"launch_s": 1e-4}, "fast"])
def test_an_entry_with_bad_figures_is_ignored_with_a_warning(folder, figures):
    store_calibration(FIGURES, 2, "gloo")
    data = json.loads((folder / CACHE_FILE).read_text())
    data["entries"][0]["figures"] = figures
    (folder / CACHE_FILE).write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="ignoring a calibration cache entry"):
        assert cached_calibration(2, "gloo") is None


def test_an_entry_from_before_a_field_existed_takes_its_default(folder):
    store_calibration(FIGURES, 2, "gloo")
    data = json.loads((folder / CACHE_FILE).read_text())
    later = ("call_s", "param_s", "gather_bytes_per_s", "scatter_bytes_per_s", "contention")
    for name in later:  # as stored before these existed
        del data["entries"][0]["figures"][name]
    (folder / CACHE_FILE).write_text(json.dumps(data))
    assert cached_calibration(2, "gloo") == {**FIGURES, **dict.fromkeys(later, 0.0)}


def test_the_key_needs_a_world_when_no_process_group(folder):
    assert not dist.is_initialized()
    with pytest.raises(hca.HCAError, match="pass world_size= and backend="):
        cached_calibration()


def rank0_decides(root: str) -> tuple:
    """On a rank: only rank 0's cache folder has an entry; calibrate(cache=True) returns it on
    every rank; refresh=True measures and replaces rank 0's entry."""
    old = os.environ.get("TORCH_HCA_CACHE_DIR")
    os.environ["TORCH_HCA_CACHE_DIR"] = os.path.join(root, f"rank{dist.get_rank()}")
    try:
        hca.init_mesh()
        if dist.get_rank() == 0:
            store_calibration(FIGURES)
        dist.barrier()
        hit = hca.calibrate(repeats=1, cache=True)
        fresh = hca.calibrate(repeats=1, refresh=True)
        return hit, fresh, cached_calibration()
    finally:
        if old is None:
            del os.environ["TORCH_HCA_CACHE_DIR"]
        else:
            os.environ["TORCH_HCA_CACHE_DIR"] = old


def test_calibrate_follows_rank_zeros_cache(worlds, tmp_path):
    (hit0, fresh0, kept0), (hit1, fresh1, kept1) = worlds(2).run(rank0_decides, str(tmp_path))
    assert hit0 == hit1 == FIGURES
    assert fresh0 == fresh1 != FIGURES
    assert kept0 == fresh0 and kept1 is None  # only rank 0 writes


def compile_with_and_without_a_cache(root: str) -> tuple:
    """On a rank: the layout pass's cost model and its source, with no cache entry, then with one,
    then with the entry and an override."""
    from torch.distributed.tensor import Shard

    from torch_hca.tools import zoo

    old = os.environ.get("TORCH_HCA_CACHE_DIR")
    os.environ["TORCH_HCA_CACHE_DIR"] = os.path.join(root, f"rank{dist.get_rank()}")
    seen = []
    try:
        hca.init_mesh()
        for options in ({}, {}, {"cost_model": {"flops_per_s": 1e12}}):
            if len(seen) == 1:
                store_calibration(FIGURES)
            torch._dynamo.reset()
            model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32))
            compiled = torch.compile(model, backend="hca", options=options)
            compiled(torch.ones(4, 16)).sum().backward()  # the same replicated input on every rank
            layout = hca.report(compiled).graphs[0].layout
            seen.append((layout["cost_model"], layout["cost_model_source"]))
        return seen
    finally:
        torch._dynamo.reset()
        if old is None:
            del os.environ["TORCH_HCA_CACHE_DIR"]
        else:
            os.environ["TORCH_HCA_CACHE_DIR"] = old


def test_the_compiler_starts_from_this_hosts_cached_calibration(worlds, tmp_path):
    from torch_hca.spmd.cost_model import DEFAULTS

    for (none, none_src), (cached, cached_src), (over, over_src) in worlds(2).run(
            compile_with_and_without_a_cache, str(tmp_path)):
        assert none == DEFAULTS["gloo"].as_dict() and none_src == "defaults"
        assert cached == FIGURES and cached_src.startswith("calibrated ")
        assert over == {**FIGURES, "flops_per_s": 1e12}
        assert over_src.startswith("calibrated ") and over_src.endswith("with overrides of flops_per_s")
