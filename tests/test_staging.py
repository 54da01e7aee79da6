"""Collectives staged through bounded, reused host buffers (torch_hca/runtime/staging.py), the
path a job of CPU and CUDA ranks takes; forced on here for CPU tensors (option staging="on")."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import torch_hca as hca
from torch_hca.backends.staging import stage_collectives

import staging_cases
from test_zoo import RUN_TIMEOUT_S, _assert_parity

X_BYTES = 6 * 5 * 4  # each rank's x in staged_ops_match_gloo: 6 rows a rank of 5 floats


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_staged_op_equals_gloos_own_collective(worlds, world_size):
    # 96-byte buffers: every payload goes through in several slices. Values are about 1 and sums of
    # 4 of them: a sum sliced otherwise than gloo's own chunks rounds in another order (2e-7 seen).
    for r, result in enumerate(worlds(world_size).run(staging_cases.staged_ops_match_gloo, 96)):
        assert result["diffs"] and all(d <= 1e-6 for d in result["diffs"].values()), (r, result["diffs"])
        assert result["collectives"] == {
            "all_reduce": 3,
            "all_gather": 1,
            "reduce_scatter": 1,
            "broadcast": 1,
            "all_to_all": 1,
        }
        assert result["allocations"] == 2, "one send and one receive buffer, reused by every call"
        x = world_size * X_BYTES
        sent = sum(1 + (r + k) % 3 for k in range(world_size)) * 20  # rows sent by the all_to_all, 20 bytes each
        got = sum(1 + (k + r) % 3 for k in range(world_size)) * 20
        # to the host: 3 all_reduces, the gather's piece, the scatter's whole, the broadcast, the exchange
        assert result["to_host"] == 3 * x + x + x + x + sent
        assert result["from_host"] == 3 * x + world_size * x + x + x + got
        assert result["oversize"] == 1 and result["allocations_at_64"] == 0, "larger than the buffers: own memory"


def test_a_zoo_model_trains_as_one_device_with_every_collective_staged(worlds):
    results = worlds(2).run(staging_cases.zoo_staged, "llama", "megatron", 4096, timeout_s=RUN_TIMEOUT_S)
    _assert_parity("llama", results)
    for result in results:
        per_call = {}
        for direction in ("forward", "backward"):
            for kind, count in result[direction].items():
                per_call[kind] = per_call.get(kind, 0) + count
        assert per_call, "the Megatron plan moves data"
        # 2 steps and the refinement check's run of the compiled program on the first call
        assert result["staged"] == {k: 3 * c for k, c in per_call.items()}, (result["staged"], per_call)
        assert result["staged_from_host"] == 3 * result["collective_bytes"], "the report's bytes went through"
        assert result["allocations"] == 2 and result["oversize"] == 0


def test_a_collective_without_a_staged_form_is_named():
    g = fx.Graph()
    x = g.placeholder("x")
    coalesced = g.call_function(torch.ops._c10d_functional.all_reduce_coalesced.default, ([x], "sum", "0"))
    g.output(coalesced)
    with pytest.raises(hca.UnsupportedError, match="all_reduce_coalesced.*no staged form"):
        stage_collectives(fx.GraphModule(torch.nn.Module(), g))


def test_the_staging_option_is_checked():
    from torch_hca.compiler.options import Options

    assert Options.parse(None).staging == "auto" and Options.parse({"staging": "on"}).staging == "on"
    with pytest.raises(hca.OptionsError, match="staging.*auto"):
        Options.parse({"staging": "yes"})


@pytest.mark.parametrize(
    "devices, says",
    [
        (["cpu"], "names 1 ranks"),
        ("cpu", "a list of one device per rank"),
        (["cpu", "mps"], "unknown device"),
        (["gpu", "cpu"], "not a torch device"),
    ],
)
def test_a_bad_devices_list_is_a_named_mesh_error(devices, says, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(hca.MeshError, match=says):
        if devices == ["cpu"]:
            with _fake_world(2):
                hca.init_mesh(devices=devices)
        else:
            hca.init_mesh(devices=devices)


def test_a_cuda_rank_on_a_machine_without_cuda_is_named(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(hca.MeshError, match="CUDA is not available"):
        hca.init_mesh(devices=["cuda:0", "cpu"])


def _fake_world(n):
    from dist_cases import fake_world

    return fake_world(n)


def test_the_report_says_the_collectives_are_staged():
    with _fake_world(2) as mesh:
        model = hca.sharded({"0.weight": hca.Shard(0)}, mesh=mesh)(torch.nn.Sequential(torch.nn.Linear(8, 8)))
        compiled = torch.compile(model, backend="hca", options={"staging": "on"})
        compiled(torch.randn(4, 8)).sum().backward()
        rep = hca.report(compiled)
        assert all(g.staged for g in rep.graphs)
        assert "collectives staged through host buffers on gloo" in rep.parallelism()
