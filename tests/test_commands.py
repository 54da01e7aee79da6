"""The README's commands, its Use snippet and the examples, run as a user would."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

from doc_blocks import runnable_blocks, run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo on loopback under torchrun too
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_demo():
    out = run(sys.executable, "-m", "torch_hca", "demo")
    assert "== DTensor program (rank 0) ==" in out and "== collectives in the compiled graphs ==" in out
    # GPT, 2 Megatron layers: one all-reduce per attention and per MLP, each way; the tied,
    # replicated embedding needs none (every rank reads the whole batch).
    assert "collectives per step: forward {'all_reduce': 4}, backward {'all_reduce': 4}" in out
    assert "PASS: gradients match a single device" in out
    # Read by people: no line wider than 120 characters, no table cell taller than 3 lines,
    # and module paths as they are written (blocks.0.norm2), not Dynamo's sources.
    wide = [line for line in out.splitlines() if len(line) > 120]
    assert not wide, wide
    table = out.split("== collectives in the compiled graphs ==")[1].split("== summary ==")[0].strip().splitlines()
    rows = [i for i, line in enumerate(table) if not line.startswith(" ")] + [len(table)]
    tallest = max(b - a for a, b in zip(rows, rows[1:]))
    assert tallest <= 3, f"a row of {tallest} lines:\n" + "\n".join(table)
    assert "(redistribute, blocks." in out and "_hca_logical" not in out and "L['self']" not in out


@pytest.mark.parametrize(
    "script,expect",
    [
        ("tensor_parallel_mlp.py", "loss after 3 steps"),
        ("data_parallel.py", "reduce_gradients: 1 bucket(s), 16896 bytes, 8 parameters"),
        ("dp_tp_2d.py", "all_reduce"),
        ("transformer_block.py", "max gradient relative error"),
        ("heterogeneous.py", "PASS"),
    ],
)
def test_example_with_local_launch(script, expect):
    assert expect in run(sys.executable, f"examples/{script}")


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_example_under_torchrun():
    out = run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_loopback_port()),
        "--local-addr",
        "127.0.0.1",
        "examples/tensor_parallel_mlp.py",
        timeout=120,
    )
    assert "loss after 3 steps" in out


USE = [b for b in runnable_blocks([ROOT / "README.md"]) if b.tag == "torchrun"]


@pytest.mark.parametrize("block", USE, ids=[b.id for b in USE])
def test_readme_use_snippet_with_python(block, tmp_path):
    assert "all_reduce" in run_script(block, tmp_path, sys.executable)


@pytest.mark.parametrize("block", USE, ids=[b.id for b in USE])
def test_readme_use_snippet_under_torchrun(block, tmp_path):
    out = run_script(
        block,
        tmp_path,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_loopback_port()),
        "--local-addr",
        "127.0.0.1",
        timeout=180,
    )
    assert "all_reduce" in out
