"""Smoke test of `python -m torch_hca bench`: it runs, writes the JSON, hca matches a single device."""

import json
import subprocess
import sys

KEYS = {"model", "contestant", "bytes_per_step", "analytic_min_bytes", "collectives", "step_time_s",
        "compile_time_s", "peak_mem_bytes", "max_grad_rel_err"}


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch_hca", "bench", "--models", "mlp", "--contestants", "hca,dtensor_eager",
         "--steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())
    assert {r["contestant"] for r in records} == {"hca", "dtensor_eager"}
    for r in records:
        assert KEYS <= r.keys(), KEYS - r.keys()
    hca = next(r for r in records if r["contestant"] == "hca")
    assert hca["max_grad_rel_err"] is not None and hca["max_grad_rel_err"] <= 1e-5
    assert hca["bytes_per_step"] > 0
