"""What a PyTorch user expects of the tools around training, on the fake process group.

* ``TORCH_LOGS="+torch_hca"`` / ``set_logs`` show hca's graphs after each pass, and
  ``TORCH_TRACE`` records them for tlparse;
* ``debug_dir`` keeps each rank's files apart;
* ``str(report)`` and the demo print no line over 120 characters, and lose nothing;
* compiling does not log DTensor's gloo all_to_all warning for the solver's own probes;
* the long commands print progress with the elapsed time on stderr, stdout stays clean.
"""

from __future__ import annotations

import ast
import io
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import torch_hca as hca
from torch_hca.tools import bench, demo, zoo
from torch_hca.compiler.options import Options
from torch_hca.passes import infra
from torch_hca.tools.progress import Progress
from torch_hca.report.records import GraphReport
from torch_hca.report.text import WIDTH, readable_code

ROOT = Path(__file__).resolve().parent.parent


def compile_mlp(**options):
    torch.manual_seed(0)
    model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(64, 256))  # a Megatron layout: one all-reduce forward
    compiled = torch.compile(model, backend="hca", options=options)
    compiled(torch.randn(8, 64)).sum().backward()
    return compiled


def too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


# ----------------------------------------------------------------------------- torch logging


@pytest.mark.skipif("TORCH_LOGS" in os.environ, reason="TORCH_LOGS overrides torch._logging.set_logs")
def test_set_logs_shows_the_graphs_after_each_pass(fake_pg):
    handler = Records()
    logger = logging.getLogger("torch_hca.passes.infra")
    logger.addHandler(handler)
    torch._logging.set_logs(modules={"torch_hca": logging.DEBUG})
    try:
        compile_mlp()
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
    shown = {}
    for r in handler.records:
        name, _, body = r.getMessage().partition(":")
        shown[name.removeprefix("hca ")] = body
    index = hca.report().graph.index
    stages = [s.removeprefix(f"graph{index}_") for s in shown]
    assert stages[0] == "dynamo" and "layout_after" in stages and "schedule_backward_after" in stages, stages
    program = shown[f"graph{index}_layout_after"]
    assert "torch_hca_compiler_dtensor_ops_redistribute" in program  # the DTensor program, its moves explicit
    forward = shown[f"graph{index}_schedule_forward_before"]  # AOTAutograd's forward, as the schedule pass gets it
    assert "all_reduce" in forward and "def forward" in forward
    assert "def forward" in shown[f"graph{index}_schedule_backward_before"]
    # A pass that changed nothing is one line, naming the text it equals.
    assert shown[f"graph{index}_lift_before"].strip() == f"unchanged (the same as hca_graph{index}_dynamo)"
    assert not logger.isEnabledFor(logging.DEBUG), "set_logs() turns it off again"
    # Every line as torch prints it (its prefix included) fits in 200 characters.
    from torch._logging._internal import TorchLogsFormatter

    printed = [line for r in handler.records for line in TorchLogsFormatter().format(r).splitlines()]
    assert max(map(len, printed)) <= 200, max(printed, key=len)


def test_dump_builds_nothing_when_nobody_asks(monkeypatch, tmp_path):
    monkeypatch.setattr(infra, "structured_trace_enabled", lambda: False)
    ctx = infra.PassContext(Options(), GraphReport(index=0, options=Options()))

    def text():
        raise AssertionError("built a graph's text nobody reads")

    infra.dump(ctx, "stage", text)  # no debug_dir, the logger at WARNING, no trace


def test_env_vars_reach_the_log_and_tlparse_trace(tmp_path):
    """The user's way in: TORCH_LOGS is parsed during `import torch`, TORCH_TRACE at start-up."""
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        import torch_hca as hca
        from torch_hca.tools import zoo
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        hca.init_mesh()
        model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32))
        torch.compile(model, backend="hca")(torch.randn(4, 16)).sum().backward()
        dist.destroy_process_group()
    """)
    env = {**os.environ, "TORCH_LOGS": "+torch_hca", "TORCH_TRACE": str(tmp_path / "trace")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"hca graph0_layout_after:\n(.*\n)*.*torch_hca_compiler_dtensor_ops_redistribute", proc.stderr)
    assert "hca graph0_schedule_backward_after:" in proc.stderr
    (trace,) = (tmp_path / "trace").iterdir()
    names = set(re.findall(r'"name": "(hca_graph0_\w+)"', trace.read_text()))
    assert {
        "hca_graph0_dynamo",
        "hca_graph0_layout_after",
        "hca_graph0_schedule_forward_after",
        "hca_graph0_schedule_backward_after",
    } <= names, sorted(names)


# ----------------------------------------------------------------------------- debug_dir


def test_debug_dir_keeps_each_ranks_files_apart(fake_pg, tmp_path):
    compile_mlp(debug_dir=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["rank0"]  # this process is rank 0 of the fake group
    index = hca.report().graph.index
    names = {p.name for p in (tmp_path / "rank0").iterdir()}
    assert {
        f"graph{index}_dynamo.py",
        f"graph{index}_layout_after.py",
        f"graph{index}_collectives.txt",
        f"graph{index}_strategy.json",
    } <= names


# ----------------------------------------------------------------------------- readable output


def test_report_and_demo_output_fit_and_keep_everything(fake_pg):
    compiled = compile_mlp()
    rep = hca.report(compiled)
    text = str(rep)
    assert not too_wide(text)
    assert any(len(line) > WIDTH for line in rep.dtensor_code.splitlines()), "the MLP's raw code has long lines"
    readable = readable_code(rep.dtensor_code)
    assert ast.dump(ast.parse(readable)) == ast.dump(ast.parse(rep.dtensor_code))  # the same program, cut into lines
    assert readable in text and rep.table(WIDTH) in text

    # What the demo prints, with rank 0's results made from this report.
    result = {
        "program": rep.dtensor_code.strip(),
        "table": rep.table(WIDTH),
        "forward": rep.collective_counts("forward"),
        "backward": rep.collective_counts("backward"),
        "loss": 1.0,
        "ref_loss": 1.0,
        "grad_err": 1e-7,
        "param_err": 1e-7,
        "compile_s": 3.0,
        "step_ms": 12.0,
    }
    out = demo.header(2) + "\n" + demo.summary([result, result])
    assert not too_wide(out)
    assert "== DTensor program (rank 0) ==" in out and "collectives per step: forward {'all_reduce': 1}" in out
    assert "PASS" in out


def test_readable_code_cuts_only_where_python_allows():
    args = [f"argument_number_{i}" for i in range(12)]
    code = (
        "def forward(self, x : torch.Tensor):\n"
        f"    y = torch.einsum('mk,kn->mn', x, {', '.join(args)});  x = {' = '.join(args)} = None\n"
        "    return (y,)\n"
    )
    out = readable_code(code, width=60)
    assert not [line for line in out.splitlines() if len(line) > 60]
    assert "        'mk,kn->mn'," in out.splitlines()  # a string's commas are not cut
    assert out.splitlines()[-1] == "    return (y,)"
    assert "    x = argument_number_0 = argument_number_1 = \\" in out.splitlines()  # FX's deletions: own line
    assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(code))  # the same program


def test_table_wraps_a_long_rule_in_its_column(fake_pg):
    rep = hca.report(compile_mlp())
    rule = rep.graph.collectives[0].rule = "a long explanation " * 16
    lines = rep.table(width=115).splitlines()
    assert len(lines) == 4 and all(len(line) <= 115 for line in lines)  # the head, and a rule cell of 3 lines
    column = lines[0].index("rule")
    assert all(line[:column].strip() == "" for line in lines[2:])  # continuation lines stay in the column
    shown = " ".join(line[column:] for line in lines[1:])
    assert shown.endswith("...") and " ".join(rule.split()).startswith(shown[:-3].strip())  # cut, marked
    # Too narrow a column (under 30 characters): the rule goes below its row, indented, 3 lines at most.
    lines = rep.table(width=90).splitlines()
    assert all(len(line) <= 90 for line in lines) and lines[1].endswith("-")
    assert len(lines) == 5 and lines[2].startswith("    a long") and lines[-1].endswith("...")
    assert rep.table().splitlines()[1].endswith(rule.strip())  # no width: one line per row, the whole rule
    assert rule in rep.to_json()  # and the whole text in the JSON


# ----------------------------------------------------------------------------- the probing warning


def test_compile_does_not_log_the_probes_alltoall_warning(fake_pg, recwarn):
    torch._logging.warning_once.cache_clear()  # DTensor warns once per process: start afresh
    handler = Records()
    logger = logging.getLogger("torch.distributed.tensor._collective_utils")
    logger.addHandler(handler)
    try:
        compile_mlp()  # its layout probes make DTensor move Shard(0) -> Shard(1)
        assert not [r for r in handler.records if "alltoall" in r.getMessage()]
        assert not [w for w in recwarn if "alltoall" in str(w.message)]
        # A real Shard(0) -> Shard(1) move still warns: the warning was skipped, not used up.
        distribute_tensor(torch.randn(8, 8), fake_pg, [Shard(0)]).redistribute(fake_pg, [Shard(1)])
        assert [r for r in handler.records if "alltoall" in r.getMessage()]
    finally:
        logger.removeHandler(handler)


# ----------------------------------------------------------------------------- progress


def test_progress_line_format_and_stream(capsys):
    Progress("bench", since=time.time() - 12.3)("lm: hca ...")
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(r"\[bench 12\.[34]s\] lm: hca \.\.\.\n", err), err
    buffer = io.StringIO()
    Progress("demo", stream=buffer)("starting")
    Progress("demo", enabled=False, stream=buffer)("a rank other than 0")
    assert re.fullmatch(r"\[demo 0\.\ds\] starting\n", buffer.getvalue())


def test_bench_and_demo_commands_report_progress_on_stderr(monkeypatch, capsys):
    calls = []

    def fake_launch(fn, world_size, *args, timeout_s=None):
        calls.append((fn, args))
        return [[]]

    monkeypatch.setattr(bench, "launch", fake_launch)
    assert bench.main(2, 1, ["mlp"], ["hca"]) == 0
    out, err = capsys.readouterr()
    assert "[bench" not in out and out.startswith("torch_hca bench:")
    assert re.search(r"^\[bench \d+\.\ds\] starting 2 local gloo ranks$", err, re.M)
    assert re.search(r"^\[bench \d+\.\ds\] done: 0 records$", err, re.M)
    fn, args = calls[0]
    assert fn is bench.run_rank and isinstance(args[-1], float)  # the ranks count from the same start

    result = {
        "program": "def forward(self):\n    return ()",
        "table": "(no collectives in the compiled graphs)",
        "forward": {},
        "backward": {},
        "loss": 1.0,
        "ref_loss": 1.0,
        "grad_err": 0.0,
        "param_err": 0.0,
        "compile_s": 1.0,
        "step_ms": 1.0,
    }
    monkeypatch.setattr(demo, "launch", lambda fn, world_size, *args: [result, result])
    assert demo.main(2) == 0
    out, err = capsys.readouterr()
    assert "[demo" not in out and "PASS" in out
    assert re.search(r"^\[demo \d+\.\ds\] starting 2 local gloo ranks$", err, re.M)
