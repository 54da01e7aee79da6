"""The strategy file (docs/strategy.md): saved from a report, loaded by the layout pass instead of
probing and solving, and a file for another model, mesh or world size refused by name.

Fake process group, world 4 (graph only: no numbers are checked here)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import torch_hca as hca
from torch_hca.__main__ import main
from torch_hca.runtime.mesh import reset_current_mesh
from torch_hca.tools import zoo

OPTIONS = {"strict": True, "schedule": False}


def _compiled(model, x, **options):
    torch._dynamo.reset()
    c = torch.compile(model, backend="hca", options={**OPTIONS, **options}, dynamic=False)
    try:
        c(x).sum().backward()
    except torch._dynamo.exc.BackendCompilerFailed as e:  # the backend's own error, as a user catches it
        raise e.inner_exception from None
    return hca.report(c)


def _tp_block():
    return hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512)), torch.randn(2, 6, 128)


def _dp(depth=4, dim=16):
    return hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(dim, depth)), torch.randn(8, dim)


_SAVED: dict[str, tuple[str, dict]] = {}  # file text and content, per model: see _saved_once


def _saved_once(name: str, make, path) -> dict:
    """`make()` compiled and its strategy saved at `path`, for the tests that read the file alone:
    the model compiled by the first of them, the same text written again for the others (the
    compile is deterministic: tests/test_solver_determinism.py)."""
    if name not in _SAVED:
        data = _compiled(*make()).save_strategy(path)
        _SAVED[name] = (path.read_text(), data)
    else:
        path.write_text(_SAVED[name][0])
    return copy.deepcopy(_SAVED[name][1])


def _seconds(rep, name):
    return sum(p.seconds for p in rep.graph.passes if p.name == name)


def test_save_then_load_gives_the_same_program_without_solving(fake_pg, tmp_path):
    path = tmp_path / "tp.json"
    solved = _compiled(*_tp_block())
    data = solved.save_strategy(path)
    assert data["schema"] == "torch_hca.strategy" and data["version"] == 1
    assert data["mesh"]["shape"] == [4] and data["world_size"] == 4
    assert data["made_by"]["torch"] == torch.__version__
    graph = data["graphs"][0]
    reduce = [m for m in graph["moves"] if m["steps"] and m["steps"][0]["kind"] == "all_reduce"]
    assert len(reduce) == 2 and reduce[0]["steps"][0]["participants"] == [[0, 1, 2, 3]]
    assert graph["groups"]["0"]["forward"] == [c["id"] for c in graph["collectives"] if c["direction"] == "forward"]

    loaded = _compiled(*_tp_block(), strategy=str(path))
    assert loaded.graph.layout.solver == f"strategy file {path}"
    assert loaded.graph.layout.probe_seconds == 0.0 and loaded.graph.layout.seconds == 0.0
    assert loaded.collective_counts() == solved.collective_counts() == {"all_reduce": 4}
    assert loaded.table() == solved.table()
    assert loaded.graph.dtensor_code == solved.graph.dtensor_code
    # Saved again, the loaded compile writes the very same file.
    assert loaded.save_strategy(tmp_path / "again.json") == data
    print(f"\nlayout pass: solved {_seconds(solved, 'layout'):.3f} s, loaded {_seconds(loaded, 'layout'):.3f} s")


@pytest.mark.parametrize(
    "make",
    [
        _dp,
        lambda: (
            hca.sharded({"*": Shard(0)}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 4)),
            torch.randn(64, 16),
        ),
        lambda: (hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16)),
    ],
    ids=["data_parallel", "fsdp", "megatron_mlp"],
)
def test_round_trip_on_zoo_plans(fake_pg, tmp_path, make):
    solved = _compiled(*make())
    data = solved.save_strategy(tmp_path / "s.json")
    loaded = _compiled(*make(), strategy=str(tmp_path / "s.json"))
    assert loaded.collective_counts() == solved.collective_counts()
    assert loaded.save_strategy(tmp_path / "again.json") == data
    assert hca.verify(tmp_path / "s.json").ok


def test_a_second_mesh_in_the_same_process_loads_the_file(fake_pg, tmp_path):
    """The file saved, then a new mesh made (as a notebook does when run again): the program names
    the mesh by its number in this process, which differs now, and the file still loads; the
    digest leaves that number out (HF GPT-2's file was refused so, in one process)."""
    solved = _compiled(*_dp())
    solved.save_strategy(tmp_path / "s.json")
    hca.init_mesh()
    loaded = _compiled(*_dp(), strategy=str(tmp_path / "s.json"))
    handle = lambda rep: next(n.args[1] for n in rep.graph.dtensor_program.graph.nodes if n.name == "from_local")
    assert handle(loaded) != handle(solved)  # the case: another number for the mesh
    assert loaded.graph.layout.probe_seconds == 0.0
    assert loaded.collective_counts() == solved.collective_counts()


def test_a_file_for_another_model_is_a_named_error(fake_pg, tmp_path):
    path = tmp_path / "dp.json"
    _saved_once("dp", _dp, path)
    with pytest.raises(
        hca.StrategyError, match=r"another model: .*parameter 'layers.0.weight' shape \[16, 16\].*\[32, 32\]"
    ):
        _compiled(*_dp(dim=32), strategy=str(path))
    with pytest.raises(hca.StrategyError, match=r"another model: .*logical graph digest"):
        _compiled(*_dp(depth=3), strategy=str(path))  # its parameters are a subset: the graph differs
    with pytest.raises(hca.StrategyError, match=r"another model: .*parameter 'fc1.weight'"):
        _compiled(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16), strategy=str(path))


def test_the_file_states_its_schedule_rules_and_prices_and_another_device_type_is_refused(fake_pg, tmp_path):
    """What the schedule kept (the bucket cap, the bound in flight) and the deployment's figures the
    solver priced with are in the file; a file made on another device type is a named error."""
    import json

    path = tmp_path / "dp.json"
    data = _compiled(*_dp(), schedule=True).save_strategy(path)
    (g,) = data["graphs"]
    assert _saved_once("dp", _dp, tmp_path / "unscheduled.json")["graphs"][0]["schedule"] is None
    backward = g["schedule"]["backward"]
    assert backward["bucket_cap_bytes"] > 0 and backward["in_flight_bytes"] >= 64 * 2**20, g["schedule"]
    assert all(i["bytes"] <= backward["bucket_cap_bytes"] for i in g["issued"] if len(i["members"]) > 1)
    priced = g["cost_model"]
    assert priced["source"].startswith("defaults") and priced["figures"]["flops_per_s"] > 0, priced
    data["mesh"]["device_type"] = "cuda"
    path.write_text(json.dumps(data))
    with pytest.raises(hca.StrategyError, match=r"another device type: the file says cuda, this compile has cpu"):
        _compiled(*_dp(), strategy=str(path), schedule=True)


def test_a_file_for_another_world_size_is_a_named_error(fake_pg, tmp_path):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    path = tmp_path / "dp.json"
    _saved_once("dp", _dp, path)
    dist.destroy_process_group()
    reset_current_mesh()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        hca.init_mesh()
        with pytest.raises(hca.StrategyError, match=r"another world size: the file says 4, this compile has 2"):
            _compiled(*_dp(), strategy=str(path))
    finally:
        dist.destroy_process_group()
        reset_current_mesh()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)  # for the fixture's teardown


def test_bad_files_are_named_errors(fake_pg, tmp_path):
    path = tmp_path / "dp.json"
    _saved_once("dp", _dp, path)
    text = path.read_text()
    cases = {
        "truncated": (text[: len(text) // 2], r"not valid JSON .*truncated or hand-edited"),
        "version": (
            text.replace('"version": 1', '"version": 99'),
            r"schema version 99, and this torch_hca reads version 1",
        ),
        "not ours": (json.dumps({"schema": "something else"}), r"not a torch_hca strategy"),
        "no graphs": (json.dumps({**json.loads(text), "graphs": None}), r"'graphs' is missing or not a list"),
        "stale digest": (
            json.dumps(_edited(text, lambda d: d["model"]["parameters"]["layers.0.weight"]["shape"].append(1))),
            r"model.digest does not match",
        ),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / f"{name}.json"
        bad.write_text(content)
        with pytest.raises(hca.StrategyError, match=message):
            _compiled(*_dp(), strategy=str(bad))
    with pytest.raises(hca.StrategyError, match="cannot read it"):
        _compiled(*_dp(), strategy=str(tmp_path / "missing.json"))


def _edited(text: str, edit) -> dict:
    data = json.loads(text)
    edit(data)
    return data


def test_a_hand_edited_placement_is_refused_after_replay(fake_pg, tmp_path):
    path = tmp_path / "tp.json"
    data = _saved_once("tp_block", _tp_block, path)
    values = data["graphs"][0]["values"]
    name = next(n for n, v in values.items() if v["op"].endswith("layer_norm") and v["placements"] == ["R"])
    values[name]["placements"] = ["S(0)"]
    path.write_text(json.dumps(data))
    with pytest.raises(
        hca.StrategyError, match=rf"value '{name}' is \['S\(0\)'\] in the file, \['R'\] after replaying"
    ):
        _compiled(*_tp_block(), strategy=str(path))


def test_strategy_option_is_checked(fake_pg):
    with pytest.raises(hca.OptionsError, match="path of a strategy file"):
        _compiled(*_dp(), strategy=3)
    with pytest.raises(hca.OptionsError, match="strategy= and layout='tune'"):
        _compiled(*_dp(), strategy="s.json", layout="tune")


def test_command_line_verify(fake_pg, tmp_path, capsys):
    path = tmp_path / "tp.json"
    data = _saved_once("tp_block", _tp_block, path)
    assert main(["verify", str(path)]) == 0
    assert "verified" in capsys.readouterr().out
    data["graphs"][0]["moves"][0]["steps"][0]["bytes"] += 4
    path.write_text(json.dumps(data))
    assert main(["verify", str(path)]) == 1
    assert "rule 'bytes'" in capsys.readouterr().out


def test_two_d_mesh_round_trip_and_another_mesh_is_a_named_error(fake_pg, tmp_path):
    from torch.distributed.tensor import Replicate

    def tp_2d():
        return (
            hca.sharded(zoo.two_d(zoo.TP_BLOCK), inputs=(Shard(0), Replicate()), outputs=(Shard(0), Replicate()))(
                zoo.TransformerBlock(64, 4, 128)
            ),
            torch.randn(4, 6, 64),
        )

    def dp_2d():
        return (
            hca.sharded({}, inputs=(Shard(0), Replicate()), outputs=(Shard(0), Replicate()))(zoo.DeepMLP(16, 4)),
            torch.randn(8, 16),
        )

    _saved_once("dp", _dp, tmp_path / "dp_1d.json")
    hca.init_mesh((2, 2), ("dp", "tp"))
    solved = _compiled(*tp_2d())
    data = solved.save_strategy(tmp_path / "tp_2d.json")
    assert data["mesh"]["ranks"] == [[0, 1], [2, 3]] and data["mesh"]["dim_names"] == ["dp", "tp"]
    loaded = _compiled(*tp_2d(), strategy=str(tmp_path / "tp_2d.json"))
    assert loaded.graph.layout.probe_seconds == 0.0
    assert loaded.collective_counts() == solved.collective_counts()
    assert loaded.save_strategy(tmp_path / "again.json") == data
    assert hca.verify(data).ok
    with pytest.raises(
        hca.StrategyError, match=r"another mesh: the file says shape \[4\], this compile has shape \[2, 2\]"
    ):
        _compiled(*dp_2d(), strategy=str(tmp_path / "dp_1d.json"))


def test_sharded_strategy_keyword_loads_the_file(fake_pg, tmp_path):
    path = tmp_path / "dp.json"
    solved = _compiled(*_dp())
    data = solved.save_strategy(path)

    def dp(strategy):
        return hca.sharded({}, inputs=Shard(0), outputs=Shard(0), strategy=strategy)(zoo.DeepMLP(16, 4))

    loaded = _compiled(dp(path), torch.randn(8, 16))  # no option: the module's file
    assert loaded.graph.layout.solver == f"strategy file {path}" and loaded.graph.layout.probe_seconds == 0.0
    assert loaded.collective_counts() == solved.collective_counts()
    assert loaded.save_strategy(tmp_path / "again.json") == data
    same = _compiled(dp(str(path)), torch.randn(8, 16), strategy=str(path))  # both name one file: fine
    assert same.graph.layout.solver == f"strategy file {path}"
    other = tmp_path / "other.json"
    with pytest.raises(hca.OptionsError, match=rf"options\['strategy'\]='{other}' and hca.sharded\(.*'{path}'\)"):
        _compiled(dp(path), torch.randn(8, 16), strategy=str(other))
    with pytest.raises(hca.OptionsError, match=r"strategy=.* and layout='tune' both choose"):
        _compiled(dp(path), torch.randn(8, 16), layout="tune")
    with pytest.raises(hca.PlanError, match="strategy= must be the path of a strategy file"):
        hca.sharded({}, strategy=3)
