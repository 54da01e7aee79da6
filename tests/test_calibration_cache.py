"""The calibration cache (`torch_hca.spmd.calibration_cache`): one entry per (host, world size, backend,
torch version), read back only on an exact match; a broken file is ignored with a warning.
`hca.calibrate(cache=True)` follows rank 0's cache on every rank."""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
import socket
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torch_hca as hca
from torch_hca.report.layout_record import LayoutRecord
from torch_hca.spmd.calibration_cache import CACHE_FILE, Calibration, cache_dir, cached_calibration, store_calibration

from compile_log import compile_log_lines

FIGURES = {
    "launch_s": 2e-4,
    "alpha_s": 0.0,
    "bytes_per_s": 1.5e9,
    "flops_per_s": 9e10,
    "memory_bytes_per_s": 2e10,
    "sync_s": 1e-3,
    "op_s": 7e-6,
    "call_s": 5e-4,
    "param_s": 4e-5,
    "gather_bytes_per_s": 1.1e9,
    "scatter_bytes_per_s": 0.7e9,
    "contention": 0.4,
    "matmul_half_dim": 8.0,
}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HCA_CACHE_DIR", str(tmp_path))
    return tmp_path


AT = "2026-12-03T06:10:07+00:00"


def test_the_tests_never_touch_the_users_cache():
    """conftest points $TORCH_HCA_CACHE_DIR at a fresh folder for the session (its ranks inherit
    it): whatever a test calibrates or compiles, the user's cache is not read or written."""
    users = {
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_hca",
        Path.home() / ".cache" / "torch_hca",
    }
    assert cache_dir() not in users and Path(os.environ["TORCH_HCA_CACHE_DIR"]).name.startswith("torch_hca_test_cache_")


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
        fresh = hca.calibrate(repeats=1, refresh=True, max_spread=math.inf)  # never noisy: always stored
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

    from torch_hca.tools import zoo

    old = os.environ.get("TORCH_HCA_CACHE_DIR")
    os.environ["TORCH_HCA_CACHE_DIR"] = os.path.join(root, f"rank{dist.get_rank()}")
    seen = []
    try:
        hca.init_mesh()
        for options in ({}, {}, {"cost_model": {"flops_per_s": 1e12}}):
            if len(seen) == 1:
                store_calibration(Calibration(FIGURES, AT))
            torch._dynamo.reset()
            model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32))
            compiled = torch.compile(model, backend="hca", options=options)
            with compile_log_lines() as lines:
                compiled(torch.ones(4, 16)).sum().backward()  # the same replicated input on every rank
            layout = hca.report(compiled).graphs[0].layout
            seen.append((layout.cost_model, layout.cost_model_source, "\n".join(lines)))
        return seen
    finally:
        torch._dynamo.reset()
        if old is None:
            del os.environ["TORCH_HCA_CACHE_DIR"]
        else:
            os.environ["TORCH_HCA_CACHE_DIR"] = old


def test_the_compiler_starts_from_this_hosts_cached_calibration(worlds, tmp_path):
    from torch_hca.spmd.cost_model import DEFAULTS

    for rank, ((none, none_src, none_log), (cached, cached_src, cached_log), (over, over_src, _)) in enumerate(
        worlds(2).run(compile_with_and_without_a_cache, str(tmp_path))
    ):
        entry = tmp_path / f"rank{rank}" / CACHE_FILE
        assert none == DEFAULTS["gloo"].as_dict() and none_src == "defaults (not measured)"
        assert cached == FIGURES and cached_src == f"calibrated 2026-12-03 06:10 UTC (cache {entry})"
        assert over == {**FIGURES, "flops_per_s": 1e12}
        assert over_src == f"{cached_src} with overrides of flops_per_s"
        # Every compile's log line says which figures it used and when they were measured (the
        # line is wrapped: compared without white space).
        bare = lambda text: "".join(text.split())
        assert bare("; cost model: defaults (not measured): compute 20 GFLOP/s, links 1 GB/s") in bare(none_log)
        assert bare(
            f"; cost model: calibrated 2026-12-03 06:10 UTC (cache {entry}): compute 90 GFLOP/s, links 1.5 GB/s"
        ) in bare(cached_log)


# ------------------------------------------------------------ when, and whether noisy
def test_an_entry_records_when_it_was_measured_and_whether_it_was_noisy(folder):
    path = store_calibration(Calibration(FIGURES, AT, noisy=True, spread={"mlp_step": 2.5}), 2, "gloo")
    (entry,) = json.loads(path.read_text())["entries"]
    assert entry["measured_at"] == AT and entry["noisy"] is True and entry["spread"] == {"mlp_step": 2.5}
    found = cached_calibration(2, "gloo")
    assert found == FIGURES and found.measured_at == AT and found.noisy and found.spread == {"mlp_step": 2.5}
    assert found.describe() == "calibrated 2026-12-03 06:10 UTC, noisy"


def test_figures_without_a_time_are_stored_as_quiet_and_measured_now(folder):
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    store_calibration(FIGURES, 2, "gloo")
    found = cached_calibration(2, "gloo")
    assert not found.noisy and before <= datetime.datetime.fromisoformat(found.measured_at)


def test_an_entry_from_before_the_noise_flag_is_quiet(folder):
    store_calibration(FIGURES, 2, "gloo")
    data = json.loads((folder / CACHE_FILE).read_text())
    del data["entries"][0]["noisy"], data["entries"][0]["spread"]
    (folder / CACHE_FILE).write_text(json.dumps(data))
    assert not cached_calibration(2, "gloo").noisy


def test_a_noisy_calibration_never_replaces_a_quiet_one(folder):
    store_calibration(Calibration(FIGURES, AT), 2, "gloo")
    before = (folder / CACHE_FILE).read_bytes()
    slow = Calibration({**FIGURES, "flops_per_s": 1.87e10}, noisy=True)
    with pytest.warns(
        UserWarning,
        match=r"a noisy calibration \(calibrated .*, noisy\) did not replace the quiet "
        r"one of 2026-12-03 06:10 UTC",
    ):
        store_calibration(slow, 2, "gloo")
    assert (folder / CACHE_FILE).read_bytes() == before
    store_calibration(slow, 4, "gloo")  # no entry for this key: kept, marked noisy
    assert cached_calibration(4, "gloo").noisy
    store_calibration(Calibration({**slow, "flops_per_s": 2e10}, noisy=True), 4, "gloo")  # noisy over noisy: newer
    assert cached_calibration(4, "gloo")["flops_per_s"] == 2e10
    store_calibration(Calibration(FIGURES), 4, "gloo")  # quiet over noisy
    assert cached_calibration(4, "gloo") == FIGURES and not cached_calibration(4, "gloo").noisy


def _measured(monkeypatch, figures):
    """hca.calibrate's measurement replaced by `figures` (counted)."""
    cal = importlib.import_module("torch_hca.api.calibrate")
    calls = []
    monkeypatch.setattr(cal, "_measure", lambda *a: calls.append(a) or figures)
    return calls


def test_a_noisy_cache_entry_is_measured_again(folder, fake_pg, monkeypatch):
    store_calibration(Calibration({**FIGURES, "flops_per_s": 1.87e10}, AT, noisy=True))
    calls = _measured(monkeypatch, Calibration(FIGURES))
    assert hca.calibrate(cache=True) == FIGURES and len(calls) == 1
    assert cached_calibration() == FIGURES and not cached_calibration().noisy  # the quiet one replaced it
    hit = hca.calibrate(cache=True)  # quiet: read, not measured
    assert hit == FIGURES and len(calls) == 1 and not hit.noisy and hit.measured_at == cached_calibration().measured_at


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.parametrize("entry,recalibrate", [(None, False), ("noisy", False), ("quiet", True)])
def test_the_bench_never_writes_the_users_cache(tmp_path, fake_pg, monkeypatch, entry, recalibrate):
    """The bench's cost model (`hca_costs`) reads the user's quiet calibration; what it measures
    (none cached, a noisy entry, --recalibrate) is used for the run only."""
    from torch_hca.tools.bench_run import RunConfig, hca_costs

    users = tmp_path / "user-cache"
    users.mkdir()
    monkeypatch.setenv("TORCH_HCA_CACHE_DIR", str(users))
    if entry:
        store_calibration(Calibration({**FIGURES, "flops_per_s": 7e10}, AT, noisy=entry == "noisy"))
    before = _snapshot(users)
    calls = _measured(monkeypatch, Calibration(FIGURES, AT, noisy=True))
    costs, source = hca_costs(RunConfig(recalibrate=recalibrate), fake_pg, lambda line: None)
    assert len(calls) == 1 and costs == FIGURES
    assert source == "measured 2026-12-03 06:10 UTC, not cached, noisy"
    assert _snapshot(users) == before


def test_the_bench_uses_the_users_quiet_calibration(tmp_path, fake_pg, monkeypatch):
    from torch_hca.tools.bench_run import RunConfig, hca_costs

    monkeypatch.setenv("TORCH_HCA_CACHE_DIR", str(tmp_path))
    store_calibration(Calibration(FIGURES, AT))
    calls = _measured(monkeypatch, None)
    assert hca_costs(RunConfig(), fake_pg, lambda line: None) == (FIGURES, "cached 2026-12-03 06:10 UTC")
    assert not calls


# ------------------------------------------------------------ the compile log names the figures' source
@pytest.mark.parametrize("noisy", [False, True])
def test_the_compiler_names_the_cache_entry_and_its_time(folder, monkeypatch, noisy):
    from torch_hca.spmd.calibration_cache import base_model

    for name, value in (
        ("is_initialized", lambda: True),
        ("get_backend", lambda: "gloo"),
        ("get_world_size", lambda: 2),
    ):
        monkeypatch.setattr(dist, name, value)
    assert base_model("gloo")[1] == "defaults (not measured)"
    store_calibration(Calibration(FIGURES, AT, noisy=noisy))
    model, source = base_model("gloo")
    assert model.as_dict() == FIGURES
    assert source == (f"calibrated 2026-12-03 06:10 UTC{', noisy' if noisy else ''} (cache {folder / CACHE_FILE})")


def test_the_log_line_says_which_figures_and_from_where():
    from torch_hca.backends.pipeline import _figures

    layout = LayoutRecord(cost_model=FIGURES, cost_model_source="calibrated 2026-12-03 06:10 UTC, noisy (cache x.json)")
    assert _figures(types.SimpleNamespace(layout=layout)) == (
        "; cost model: calibrated 2026-12-03 06:10 UTC, noisy (cache x.json): compute 90 GFLOP/s, links 1.5 GB/s"
    )


def test_a_full_set_of_figures_is_named_as_given_not_as_overrides():
    """The bench passes every figure: its compile log says so instead of listing each as an override."""
    import dataclasses

    from torch_hca.compiler.options import Options
    from torch_hca.spmd.cost_model import DEFAULTS

    every = dataclasses.asdict(DEFAULTS["gloo"])
    _, source = Options.parse({"cost_model": every}).costs_and_source("cpu")
    assert source == "options['cost_model'] (every figure given)"
    _, source = Options.parse({"cost_model": {"flops_per_s": 1e10}}).costs_and_source("cpu")
    assert source.endswith(" with overrides of flops_per_s")
