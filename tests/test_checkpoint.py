"""`hca.save` / `hca.load`: atomic publication under kills, bitwise resume, errors, single-device state dicts.

Kill tests start their own short-lived 2-rank world (a killed rank ends it),
kill one rank at one point of a second save, and check in the session's
world that the previous checkpoint is published, intact and loads bitwise.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import checkpoint_cases
import torch_hca as hca
from torch_hca.api import checkpoint

FIRST, SECOND = "v00000001", "v00000002"


def digests(directory) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(directory))
    }


def latest(root) -> str:
    return open(os.path.join(root, "LATEST")).read().strip()


# (point, rank killed there, what LATEST names afterwards). Before the rename of
# LATEST the first checkpoint stays published; after it the second one is.
KILLS = [
    ("begin", 1, FIRST),  # before its pieces are written
    ("written", 1, FIRST),  # while writing: its file is left half written
    ("complete", 0, FIRST),  # after every rank has written, before publishing
    ("renamed", 0, FIRST),  # mid-publish: the new directory is in place, LATEST is not switched
    ("published", 0, SECOND),  # after publishing, before older versions are pruned
]


def test_the_fault_points_are_all_tested():
    assert [k[0] for k in KILLS] == list(checkpoint.FAULT_POINTS)


@pytest.mark.parametrize("point,victim,published", KILLS, ids=[k[0] for k in KILLS])
def test_a_rank_killed_mid_save_leaves_a_loadable_checkpoint(worlds, tmp_path, point, victim, published):
    root = str(tmp_path / "ckpt")
    with hca.LocalWorld(2, timeout_s=30) as world:
        assert world.run(checkpoint_cases.save_seed, root, 1)[0] == os.path.join(root, FIRST)
        before = digests(os.path.join(root, FIRST))
        with pytest.raises(hca.RankError) as killed:
            world.run(checkpoint_cases.save_and_die, root, 2, point, victim)
        assert killed.value.rank == victim and "process exit" in killed.value.kind
    assert latest(root) == published
    assert digests(os.path.join(root, FIRST)) == before, "the previous checkpoint was changed"
    r = worlds(2).run(checkpoint_cases.load_matches, root, 1 if published == FIRST else 2)
    assert all(x["equal"] for x in r), "the loaded state differs from the saved one"
    assert r[0]["extra"] == {"seed": 1 if published == FIRST else 2}
    # The next save sweeps the interrupted one away and publishes past any unpublished version.
    assert r[0]["next"] == ("v00000003" if point in ("renamed", "published") else SECOND)
    assert latest(root) == r[0]["next"] and not any(e.startswith(".tmp-") for e in os.listdir(root))


def test_resume_equals_an_uninterrupted_run_bitwise(worlds, tmp_path):
    root = str(tmp_path / "ckpt")
    with hca.LocalWorld(2, timeout_s=30) as world:
        uninterrupted = world.run(checkpoint_cases.train_save_train, root)
    resumed = worlds(2).run(checkpoint_cases.load_train, root)
    for rank in range(2):
        state, extra = resumed[rank]
        assert extra == {"step": 3}
        assert checkpoint_cases.bitwise_equal(state, uninterrupted[rank])


def test_keep_prunes_old_versions_only_after_publishing(worlds, tmp_path):
    root = str(tmp_path / "ckpt")
    for seed in range(3):
        worlds(2).run(checkpoint_cases.save_seed, root, seed)
    assert sorted(os.listdir(root)) == ["LATEST", SECOND, "v00000003"]
    assert latest(root) == "v00000003"


def test_errors_name_the_problem(worlds, tmp_path):
    r = worlds(2).run(checkpoint_cases.checkpoint_errors, str(tmp_path))
    assert r[0] == r[1], "every rank raises the same error"
    out = r[0]
    expect = {
        "missing": "no checkpoint at",
        "unpublished": "no published checkpoint",
        "shapes": "has shape (16, 8) in the checkpoint and (32, 8) in the model",
        "model": "checkpoint is of another model",
        "plan": "pass reshard=True",
        "no_optimizer": "no optimizer state",
        "foreign": "not a torch_hca checkpoint directory",
        "damaged": "is damaged",
        "write_fails": "writing failed on rank(s) [1]: OSError: [Errno 28] No space left on device; nothing was published",
    }
    for case, words in expect.items():
        assert out[case] is not None, f"{case}: nothing raised"
        kind, message = out[case]
        assert kind == "CheckpointError", f"{case}: {kind}: {message}"
        assert words in message, f"{case}: {message}"
    assert out["reshard_equal"] and out["compiled_equal"] and out["cast_equal"]
    assert out["latest_after_failure"] == FIRST


def test_single_device_state_dict_into_a_sharded_model(worlds, tmp_path):
    r = worlds(2).run(checkpoint_cases.full_state_dict, str(tmp_path / "plain.pt"))
    for out in r:
        assert out["api"] and out["file"] and out["load_state_dict"]
        assert max(out[f"{how}_out_err"] for how in ("api", "file", "load_state_dict")) <= 1e-6
        assert out["prefixed"][0] == "CheckpointError" and "strip that prefix" in out["prefixed"][1]
        assert "'module.'" in out["prefixed"][1]
        assert out["local_pieces"][0] == "CheckpointError" and "full (single-device) shape" in out["local_pieces"][1]


def test_one_process_without_a_process_group(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    hca.save(model, opt, tmp_path, extra={"step": 1})
    twin = torch.nn.Linear(4, 4)
    twin_opt = torch.optim.Adam(twin.parameters())
    assert hca.load(twin, twin_opt, tmp_path) == {"step": 1}
    assert torch.equal(twin.weight, model.weight)
    assert torch.equal(twin_opt.state[twin.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_bad_arguments(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(hca.CheckpointError, match="keep=0"):
        hca.save(model, None, tmp_path, keep=0)
    with pytest.raises(hca.CheckpointError, match="JSON"):
        hca.save(model, None, tmp_path, extra={"x": object()})
    with pytest.raises(hca.CheckpointError, match="expected a state dict"):
        hca.load_full_state_dict(model, [1, 2])


def test_resume_at_another_world_size(worlds, tmp_path):
    """Saved by 2 ranks (fc1's 16 rows 8 a rank), resumed by 4 (4 a rank) with reshard=True: the last
    2 Adam steps end where the uninterrupted 2-rank run ends (every parameter and moment, whole,
    within 1e-6: the row-parallel sums add 2 or 4 pieces, so not bitwise). Without reshard=True the
    other world is a named error."""
    root = str(tmp_path / "ckpt")
    with hca.LocalWorld(2, timeout_s=60) as world:
        uninterrupted = world.run(checkpoint_cases.train_save_train_whole, root)[0]
    refused = worlds(4).run(checkpoint_cases.load_train_whole, root, False)[0]
    assert "error" in refused and "reshard=True" in refused["error"], refused
    for r in worlds(4).run(checkpoint_cases.load_train_whole, root, True):
        assert r["pieces"] == (4, 8), r["pieces"]
        assert r["state"].keys() == uninterrupted.keys()
        for k, want in uninterrupted.items():
            err = (r["state"][k] - want).norm() / want.norm().clamp_min(1e-30)
            assert err <= 1e-6, (k, err)
