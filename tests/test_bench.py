"""Smoke test of `python -m torch_hca bench`: every model and contestant runs on tiny sizes
and writes complete JSON records; every contestant trains the same thing as a single device.

Speed is not asserted (a benchmark is a command, DESIGN.md section 5). Whether hca's bytes
per step are the fewest is reported as a warning, not asserted: at tiny sizes the layout
solver's cost model may rightly prefer fewer, larger collectives.
"""

import json
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from torch_hca.bench import CONTESTANTS, MODELS, applies, specs
from torch_hca.step_profile import StepProfile

KEYS = {"model", "contestant", "bytes_per_step", "analytic_min_bytes", "collectives", "step_time_s",
        "compile_time_s", "peak_mem_bytes", "max_grad_rel_err"}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch_hca", "bench", "--tiny", "--steps", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== schedule on/off" in proc.stdout
    return json.loads(out.read_text())


def test_every_model_and_contestant_has_a_complete_record(records):
    expected = {(m, c) for m in MODELS for c in CONTESTANTS if applies(specs(tiny=True)[m].kind, c)}
    assert [(r["model"], r["contestant"]) for r in records] == sorted(
        expected, key=lambda mc: (MODELS.index(mc[0]), CONTESTANTS.index(mc[1])))
    assert {r["contestant"] for r in records} == set(CONTESTANTS)
    for r in records:
        assert not r.get("failed"), r
        assert KEYS <= r.keys(), (r["model"], r["contestant"], KEYS - r.keys())
        assert all(r[k] is not None for k in KEYS), r
        assert r["bytes_per_step"] > 0 and r["collectives"] > 0 and r["peak_mem_bytes"] > 0


def test_every_contestant_matches_a_single_device(records):
    for r in records:
        assert r["max_grad_rel_err"] <= 1e-5, (r["model"], r["contestant"], r["max_grad_rel_err"])


def test_profiled_bytes_agree_with_hca_report(records):
    """The profiler's count (every contestant) and hca's own table (hca only) agree on hca."""
    for r in records:
        if r["contestant"].startswith("hca"):
            assert r["bytes_per_step"] == pytest.approx(r["report_bytes_per_step"]), r


def test_hca_bytes_against_the_others_are_reported(records):
    behind = []
    for model in MODELS:
        rows = [r for r in records if r["model"] == model]
        hca = next(r for r in rows if r["contestant"] == "hca")
        best = min((r for r in rows if not r["contestant"].startswith("hca")), key=lambda r: r["bytes_per_step"])
        if hca["bytes_per_step"] > best["bytes_per_step"]:
            behind.append(f"{model}: hca {hca['bytes_per_step']:.0f} B > "
                          f"{best['contestant']} {best['bytes_per_step']:.0f} B")
    if behind:
        warnings.warn("hca's bytes/step are not the fewest (tiny sizes): " + "; ".join(behind), stacklevel=1)


def test_step_profile_counts_each_c10d_op_once_as_a_ring(fake_pg):
    """Ring bytes per rank at n = 4: all-reduce 2(n-1)/n S, all-gather and reduce-scatter (n-1)/n S."""
    funcol = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    with StepProfile(4) as prof:
        dist.all_reduce(torch.ones(3, 4))  # payload S = 48 B
        funcol.wait_tensor(funcol.all_gather_into_tensor(torch.ones(2, 4), 4, group))  # S = 128 B (output)
        funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.ones(8, 4), "sum", 4, group))  # S = 128 B (input)
        pair = funcol.all_reduce_coalesced([torch.ones(4), torch.ones(4)], "sum", group)  # one op, S = 32 B
        [funcol.wait_tensor(t) for t in pair]
    assert prof.by_kind == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1} and prof.collectives == 4
    assert prof.wire_bytes == pytest.approx(1.5 * 48 + 0.75 * 128 + 0.75 * 128 + 1.5 * 32)
    assert prof.unknown == {} and prof.peak_alloc_bytes > 0
