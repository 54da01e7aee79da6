"""`hca.verify`: the independent checker accepts real strategy files and catches seeded corruptions
of them, each with a message naming the value, the rule, what the file says and what it should.

The files are real: zoo models compiled on a fake process group (world 4), saved once per module."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import torch_hca as hca
from torch_hca.runtime.mesh import reset_current_mesh
from torch_hca.tools import zoo
from torch_hca.verify import problems

import op_rule_cases
import share_mutations

MODELS = {
    "data_parallel": lambda: (
        hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 4)),
        torch.randn(8, 16),
    ),
    "fsdp": lambda: (
        hca.sharded(zoo.FSDP_PLAN, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 4)),
        torch.randn(64, 16),
    ),
    "megatron_mlp": lambda: (hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16)),
    # The MLP's 510 hidden units over 4 ranks: torch.chunk's pieces 128 : 128 : 128 : 126, declared in the file.
    "tp_block_uneven": lambda: (hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 510)), torch.randn(2, 6, 128)),
    "tp_block": lambda: (hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512)), torch.randn(2, 6, 128)),
}
# On a 2-D (dp, tp) mesh of the same 4 ranks.
MODELS_2D = {
    "tp_block_2d": lambda: (
        hca.sharded(zoo.two_d(zoo.TP_BLOCK), inputs=(Shard(0), Replicate()), outputs=(Shard(0), Replicate()))(
            zoo.TransformerBlock(64, 4, 128)
        ),
        torch.randn(4, 6, 64),
    ),
}


@pytest.fixture(scope="module")
def strategies(tmp_path_factory):
    """Each zoo model x plan above, compiled (fake world 4, schedule on: buckets) and its strategy file saved."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch._dynamo.reset()
    reset_current_mesh()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        out = {}
        for mesh, models in ((((4,), None), MODELS), (((2, 2), ("dp", "tp")), MODELS_2D)):
            hca.init_mesh(*mesh)
            for name, make in models.items():
                torch._dynamo.reset()
                model, x = make()
                c = torch.compile(model, backend="hca", options={"strict": True}, dynamic=False)
                c(x).sum().backward()
                out[name] = hca.report(c).save_strategy(tmp_path_factory.mktemp(name) / "s.json")
        return out
    finally:
        dist.destroy_process_group()
        reset_current_mesh()
        torch._dynamo.reset()


def test_every_real_strategy_verifies(strategies):
    for name, data in strategies.items():
        result = hca.verify(data)
        assert result.ok and result.graphs == 1 and result.collectives > 0, (name, result)
        print(f"\n{name}: {result}")


# ----------------------------------------------------------------------------- mutations
# Each takes a copy of a real file and a seeded Random, corrupts one thing, and returns the rule
# that must catch it (None: the file has nothing this mutation can corrupt).


def _graph(d):
    return d["graphs"][0]


def _steps(d, kind=None):
    return [s for m in _graph(d)["moves"] for s in m["steps"] if s["kind"] is not None and kind in (None, s["kind"])]


def dropped_reduction(d, rng):
    """A P -> R move deleted, its readers reading the Partial value directly."""
    g = _graph(d)
    moves = [m for m in g["moves"] if any(s["kind"] == "all_reduce" for s in m["steps"])]
    if not moves:
        return None
    m = rng.choice(moves)
    g["moves"].remove(m)
    del g["values"][m["node"]]
    for v in g["values"].values():
        v["reads"] = [m["value"] if r == m["node"] else r for r in v["reads"]]
    for out in g["outputs"]:
        out["value"] = m["value"] if out["value"] == m["node"] else out["value"]
    gone = {s["collective"] for s in m["steps"]}
    g["collectives"] = [c for c in g["collectives"] if c["id"] not in gone]
    for grp in g["groups"].values():
        grp["forward"] = [i for i in grp["forward"] if i not in gone]
    return "partial reduced before use"


def partial_never_reduced(d, rng):
    """A reduction turned into a no-op: the move keeps the value Partial (P -> P)."""
    g = _graph(d)
    moves = [m for m in g["moves"] if any(s["kind"] == "all_reduce" for s in m["steps"])]
    if not moves:
        return None
    m = rng.choice(moves)
    g["values"][m["node"]]["placements"] = list(m["src"])
    return "partial reduced before use"


def _sharded_at(v):
    return next((m for m, p in enumerate(v["placements"]) if p.startswith("S")), None)


def wrong_shard_dim(d, rng):
    g = _graph(d)
    params = [v for v in g["values"].values() if v["kind"] == "parameter" and _sharded_at(v) is not None]
    if not params:
        return None
    v = rng.choice(params)
    m = _sharded_at(v)
    v["placements"][m] = "S(1)" if v["placements"][m] == "S(0)" else "S(0)"
    return "parameter storage"


def wrong_bytes(d, rng):
    steps = _steps(d)
    if not steps:
        return None
    rng.choice(steps)["bytes"] += 4 * rng.randint(1, 100)
    return "bytes"


def wrong_wire_bytes(d, rng):
    c = rng.choice(_graph(d)["collectives"])
    c["wire_bytes"] *= 2
    return "wire bytes"


def _another_in_a_step(d, rng, field: str, wrong: str, else_wrong: str):
    """One move step's `field` set to `wrong` (to `else_wrong` where it already was `wrong`)."""
    steps = _steps(d)
    if not steps:
        return False
    s = rng.choice(steps)
    s[field] = wrong if s[field] != wrong else else_wrong
    return True


def wrong_move_kind(d, rng):
    return "move table" if _another_in_a_step(d, rng, "kind", "reduce_scatter", "all_gather") else None


def wrong_transpose_kind(d, rng):
    return "transpose" if _another_in_a_step(d, rng, "transpose", "all_gather", "all_reduce") else None


def backward_not_the_transpose(d, rng):
    """A backward collective paired with a forward move it does not transpose."""
    paired = [c for c in _graph(d)["collectives"] if c["direction"] == "backward" and c["partner"]]
    if not paired:
        return None
    c = rng.choice(paired)
    c["kind"] = "all_reduce"
    c["wire_bytes"] = 2 * c["bytes"] * 3 / 4
    return "transpose pair"


def partner_of_another(d, rng):
    """A transpose paired with the wrong forward move."""
    paired = [c for c in _graph(d)["collectives"] if c["direction"] == "backward" and c["partner"]]
    if len(paired) < 2:
        return None
    a, b = rng.sample(paired, 2)
    a["partner"] = b["partner"]
    return "transpose pair"


def backward_not_owed(d, rng):
    """A cotangent reduction whose origin's backward owes no such collective."""
    owed = [c for c in _graph(d)["collectives"] if c["direction"] == "backward" and not c["partner"]]
    if not owed:
        return None
    c = rng.choice(owed)
    c["kind"] = "all_to_all"
    c["wire_bytes"] = c["bytes"] * 3 / 4
    return "cotangent reduction owed"


def swapped_order(d, rng):
    lists = [lst for grp in _graph(d)["groups"].values() for lst in (grp["forward"], grp["backward"]) if len(lst) > 1]
    if not lists:
        return None
    lst = rng.choice(lists)
    i = rng.randrange(len(lst) - 1)
    lst[i], lst[i + 1] = lst[i + 1], lst[i]
    return "group order"


def swapped_on_one_rank(d, rng):
    """Two different collectives swapped in one rank's posted order of a group (the others' kept):
    that rank would wait in a collective its peers have not started."""
    picks = [
        (orders[direction], i)
        for grp in _graph(d)["groups"].values()
        if len(grp.get("ranks", {})) > 1
        for orders in list(grp["ranks"].values())[1:]
        for direction in ("forward", "backward")
        for i in range(len(orders[direction]) - 1)
        if orders[direction][i] != orders[direction][i + 1]
    ]
    if not picks:
        return None
    seq, i = rng.choice(picks)
    seq[i], seq[i + 1] = seq[i + 1], seq[i]
    return "per-rank order"


def wrong_residual_bytes(d, rng):
    """A residual kept for the backward stated at other bytes than its shape and dtype hold."""
    kept = [r for r in _graph(d).get("residuals") or [] if isinstance(r["bytes"], int)]  # symbolic: share_mutations
    if not kept:
        return None
    rng.choice(kept)["bytes"] += rng.choice((-4, 4, 1024))
    return "residual bytes"


def residual_never_read(d, rng):
    """A residual whose last backward reader is gone: held through the step for nothing."""
    kept = _graph(d).get("residuals") or []
    if not kept:
        return None
    rng.choice(kept)["last_read"] = {"node": None, "index": None}
    return "residual read"


def stale_digest(d, rng):
    p = rng.choice(list(d["model"]["parameters"].values()))
    p["shape"][0] *= 2
    return "model digest"


def wrong_participants(d, rng):
    steps = _steps(d)
    target = rng.choice(steps) if steps else next(iter(_graph(d)["groups"].values()))
    target["participants"] = [[r for group in target["participants"] for r in group][::-1]]
    return "participants"


def indivisible_shard(d, rng):
    sharded = [
        v
        for v in _graph(d)["values"].values()
        if _sharded_at(v) is not None and v["kind"] != "parameter" and "pieces" not in v
    ]
    if not sharded:
        return None
    v = rng.choice(sharded)
    dim = int(v["placements"][_sharded_at(v)][2:-1])
    v["shape"][dim] += " + 1" if isinstance(v["shape"][dim], str) else 1  # a symbolic size: odd at the samples
    return "shard divides"


def wrong_pieces(d, rng):
    """A value cut unevenly whose declared pieces are not torch.chunk's (a row moved between ranks)."""
    uneven = [v for v in _graph(d)["values"].values() if "pieces" in v]
    if not uneven:
        return None
    v = rng.choice(uneven)
    dim = int(v["placements"][_sharded_at(v)][2:-1])
    first, last = v["pieces"][0], v["pieces"][-1]
    first[dim], last[dim] = first[dim] - 1, last[dim] + 1
    return "shard pieces"


def wrong_world_size(d, rng):
    d["world_size"] = 8
    return "world size"


def wrong_mesh_dim(d, rng):
    rng.choice(_graph(d)["collectives"])["mesh_dim"] += 1
    return "group"


def wrong_move_source(d, rng):
    moves = _graph(d)["moves"]
    if not moves:
        return None
    m = rng.choice(moves)
    m["src"] = ["R"] if m["src"] != ["R"] else ["S(0)"]
    return "move source"


def wrong_bucket_bytes(d, rng):
    buckets = [i for i in _graph(d)["issued"] if len(i["members"]) > 1]
    if not buckets:
        return None
    rng.choice(buckets)["bytes"] -= 4
    return "bytes"


def collective_never_issued(d, rng):
    """A collective left out of the bucket that issues it."""
    buckets = [i for i in _graph(d)["issued"] if len(i["members"]) > 1]
    if not buckets:
        return None
    b = rng.choice(buckets)
    b["members"].remove(rng.choice(b["members"]))
    return "issued once"


def _remove_collective(d, cid):
    """Take a collective out of the file cleanly: its issue (or its bucket's share), its group order, its partner's link."""
    from torch_hca.spmd.collective_kinds import Kind, bytes_per_rank

    g = _graph(d)
    c = next(c for c in g["collectives"] if c["id"] == cid)
    g["collectives"].remove(c)
    issue = next(i for i in g["issued"] if i["id"] == c["issued_as"])
    issue["members"].remove(cid)
    group = g["groups"][c["group"]]
    at = group[c["direction"]].index(issue["id"])
    if issue["members"]:
        issue["bytes"] -= c["bytes"]
        issue["wire_bytes"] = bytes_per_rank(Kind(issue["kind"]), issue["bytes"], c["group_size"])
    else:
        g["issued"].remove(issue)
        group[c["direction"]].remove(issue["id"])
    # Every rank's posted order with it: the entry gone, or the bucket's result smaller.
    for orders in group.get("ranks", {}).values():
        seq = orders[c["direction"]]
        if issue["members"]:
            kind, dtype, _ = seq[at].split(":", 2)
            itemsize = getattr(torch, dtype.removeprefix("torch.")).itemsize
            numel = issue["bytes"] // itemsize // (c["group_size"] if kind == "reduce_scatter" else 1)
            seq[at] = f"{kind}:{dtype}:({numel},)"
        else:
            del seq[at]
    for other in g["collectives"]:
        if other["partner"] == cid:
            other["partner"] = None
    for m in g["moves"]:
        for step in m["steps"]:
            if step["collective"] is not None and any(
                o["id"] == step["collective"] and o["partner"] is None for o in g["collectives"]
            ):
                step["backward"] = None


def dropped_gradient_reduction(d, rng):
    """A replicated parameter's gradient reduction (eager role) deleted: n-times gradients."""
    g = _graph(d)
    eager = {n for n, v in g["values"].items() if v["kind"] == "parameter" and v.get("cotangent_role") == "eager"}
    marks = {n for n, v in g["values"].items() if v["kind"] == "op" and len(v["reads"]) == 1 and v["reads"][0] in eager}
    reductions = [c for c in g["collectives"] if c["direction"] == "backward" and c["origin"] in marks]
    if not reductions:
        return None
    _remove_collective(d, rng.choice(reductions)["id"])
    return "nothing owed is missing"


def dropped_transpose(d, rng):
    """The backward reduce_scatter of a weight gather deleted (and its pairing)."""
    g = _graph(d)
    owed = [
        c for c in g["collectives"] if c["direction"] == "backward" and c["kind"] == "reduce_scatter" and c["partner"]
    ]
    if not owed:
        return None
    _remove_collective(d, rng.choice(owed)["id"])
    return "nothing owed is missing"


def bucket_over_cap(d, rng):
    """A bucket larger than its direction's stated cap (the cap lowered under it)."""
    g = _graph(d)
    buckets = [i for i in g["issued"] if len(i["members"]) > 1 and (g.get("schedule") or {}).get(i["direction"])]
    if not buckets:
        return None
    b = rng.choice(buckets)
    g["schedule"][b["direction"]]["bucket_cap_bytes"] = b["bytes"] - rng.choice((4, b["bytes"] // 2))
    return "bucket cap"


def over_in_flight(d, rng):
    """The schedule's in-flight bound lowered under what the program holds in flight at a start."""
    g = _graph(d)
    for direction in ("forward", "backward"):
        placed = [i for i in g["issued"] if i["direction"] == direction and i.get("start") is not None]
        held = [
            sum(o["bytes"] for o in placed if o["start"] < i["start"] < (o.get("last_wait") or -1)) + i["bytes"]
            for i in placed
        ]
        overlapping = [h for h, i in zip(held, placed) if h > i["bytes"]]
        if overlapping and (g.get("schedule") or {}).get(direction):
            g["schedule"][direction]["in_flight_bytes"] = rng.choice(overlapping) - 1
            return "in flight"
    return None


def unknown_version(d, rng):
    d["version"] = 2
    return "schema version"


MUTATIONS = [
    dropped_reduction,
    partial_never_reduced,
    wrong_shard_dim,
    wrong_bytes,
    wrong_wire_bytes,
    wrong_move_kind,
    wrong_transpose_kind,
    backward_not_the_transpose,
    partner_of_another,
    backward_not_owed,
    swapped_order,
    swapped_on_one_rank,
    wrong_residual_bytes,
    residual_never_read,
    stale_digest,
    wrong_participants,
    indivisible_shard,
    wrong_pieces,
    wrong_world_size,
    wrong_mesh_dim,
    wrong_move_source,
    wrong_bucket_bytes,
    bucket_over_cap,
    over_in_flight,
    collective_never_issued,
    dropped_gradient_reduction,
    dropped_transpose,
    unknown_version,
    *op_rule_cases.MUTATIONS,  # placements the op families do not allow, every other rule passing
    *share_mutations.MUTATIONS,  # what uneven shares forbid (the file cut by shares only)
]
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def gloo_strategy(worlds):
    """`dist_cases.strategy_of_fsdp_block`'s file from 2 real gloo ranks: each rank's posted order in it."""
    import dist_cases

    files = worlds(2).run(dist_cases.strategy_of_fsdp_block)
    assert files[0] == files[1]  # one SPMD program: every rank writes the same file
    return files[0]


@pytest.fixture(scope="module")
def shares_strategy(worlds):
    """A mean inside forward, its batch of 8 cut 1:3 over 2 gloo ranks (`uneven_cases.strategy_by_shares`):
    the file with shares, weights, a weighted mean and symbolic sizes."""
    import uneven_cases

    first, second = worlds(2).run(uneven_cases.strategy_by_shares, (1, 3), 8, (3, 5))
    assert first["text"] == second["text"]
    return first["file"]


def test_real_ranks_post_their_orders_into_the_file(gloo_strategy):
    """Every rank's order of each group, as it posted it on the first call, is in the file and the
    verifier compares it with the group's order: the swap on one rank is named, with the rank."""
    (group,) = _graph(gloo_strategy)["groups"].values()
    assert set(group["ranks"]) == {"0", "1"} and group["ranks"]["0"] == group["ranks"]["1"]
    assert [s.split(":")[0] for s in group["ranks"]["1"]["backward"]] == ["reduce_scatter", "all_reduce"]
    assert hca.verify(gloo_strategy).ok
    broken = copy.deepcopy(gloo_strategy)
    broken["graphs"][0]["groups"]["0"]["ranks"]["1"]["backward"].reverse()
    found = [str(p) for p in problems(broken)]
    assert any(
        "rank 1, backward: rule 'per-rank order': the file says collective #0 is all_reduce" in f for f in found
    ), found


def test_residuals_and_their_lifetimes_are_in_the_file(strategies):
    """What each graph keeps for its backward: every residual made by a forward node or an input,
    read last by a backward node, its bytes those of its shape and dtype."""
    for name, data in strategies.items():
        kept = _graph(data)["residuals"]
        assert kept, name
        for r in kept:
            assert r["bytes"] == math.prod(r["shape"]) * getattr(torch, r["dtype"]).itemsize, (name, r)
            assert r["made"]["node"] == "input" or r["made"]["index"] > 0, (name, r)
            assert r["last_read"]["index"] > 0, (name, r)
    # Shapes are this rank's: data parallel keeps its own 8 rows of each activation (of 32 over 4
    # ranks) and the replicated 16 x 16 weights the input gradients need; nothing gathered.
    shapes = {tuple(r["shape"]) for r in _graph(strategies["data_parallel"])["residuals"]}
    assert shapes == {(8, 16), (16, 16)}, shapes


def test_seeded_mutations_are_caught_and_named(strategies, gloo_strategy, shares_strategy):
    tried, caught, missed = 0, 0, []
    files = {**strategies, "fsdp_block_gloo": gloo_strategy, "mean_by_shares_gloo": shares_strategy}
    for name, data in files.items():
        assert problems(data) == [], name  # the unbroken control
        for mutate in MUTATIONS:
            for seed in SEEDS:
                broken = copy.deepcopy(data)
                rule = mutate(broken, random.Random(f"{name}/{mutate.__name__}/{seed}"))
                if rule is None:
                    continue
                tried += 1
                found = problems(broken)
                if any(p.rule == rule for p in found):
                    caught += 1
                    text = str(next(p for p in found if p.rule == rule))
                    assert f"rule '{rule}'" in text and "the file says" in text and "it should be" in text
                else:
                    missed.append(
                        f"{name} {mutate.__name__} seed {seed}: expected rule {rule!r}, got "
                        f"{[str(p) for p in found][:3]}"
                    )
    print(
        f"\nverifier catch rate: {caught}/{tried} = {caught / tried:.0%} of seeded mutations "
        f"({len(MUTATIONS)} kinds x {len(files)} files x {len(SEEDS)} seeds where applicable)"
    )
    assert tried >= 100 and not missed, "\n".join(missed)


def test_a_failure_names_the_value_the_rule_and_both_sides(strategies):
    broken = copy.deepcopy(strategies["tp_block"])
    assert dropped_reduction(broken, random.Random(0)) == "partial reduced before use"
    with pytest.raises(hca.StrategyError) as info:
        hca.verify(broken)
    message = str(info.value)
    assert (
        "graph 0, value 'out': rule 'partial reduced before use'" in message
        or "rule 'partial reduced before use'" in message
    )
    assert "the file says" in message and "it should be" in message and "a move reducing" in message


def test_verify_reads_paths_and_names_a_truncated_file(strategies, tmp_path):
    import json

    path = tmp_path / "s.json"
    path.write_text(json.dumps(strategies["fsdp"]))
    assert hca.verify(path).ok and hca.verify(str(path)).moves == 8
    path.write_text(path.read_text()[:100])
    with pytest.raises(hca.StrategyError, match="not valid JSON"):
        hca.verify(path)
    assert [p.rule for p in problems({"schema": "torch_hca.strategy", "version": 7})] == ["schema version"]


# ----------------------------------------------------------------------------- against the model
# hca.verify(model, strategy, example_inputs): the file against the model's forward, re-traced with
# torch alone on the whole inputs (torch_hca/verify/retrace.py).

FACTORIES = """
import torch
import torch_hca as hca
from torch_hca.tools import zoo

def tp_block():
    return hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512))

def mlp():
    return zoo.MLP(16, 32)

def tp_inputs():
    return (torch.randn(2, 6, 128),)
"""


def _saved(model, x, path) -> dict:
    torch._dynamo.reset()
    c = torch.compile(model, backend="hca", options={"strict": True, "schedule": False}, dynamic=False)
    c(x).sum().backward()
    return hca.report(c).save_strategy(path)


def _redigest(data: dict) -> None:
    """The model section's digest made to match again (docs/strategy.md): an edit no digest catches."""
    import hashlib
    import json

    body = {k: v for k, v in data["model"].items() if k != "digest"}
    data["model"]["digest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]


def test_verify_against_the_model_accepts_its_file_and_names_each_difference(fake_pg, tmp_path):
    dp = lambda: hca.sharded({}, inputs=Shard(0), outputs=Shard(0))(zoo.DeepMLP(16, 4))
    data = _saved(dp(), torch.randn(8, 16), tmp_path / "dp.json")
    whole = (torch.randn(32, 16),)  # 4 ranks x 8 rows: the batch one device would see
    result = hca.verify(dp(), data, whole)  # the control: the model the file was made for
    assert result.ok and "DeepMLP (re-traced: 1 graph(s), 8 ops; the file's op values paired 8 by name" in str(
        result
    ), result
    assert hca.verify(zoo.DeepMLP(16, 4), tmp_path / "dp.json", whole).ok  # the plain module too

    broken = copy.deepcopy(data)  # a parameter's shape edited where the file states it, its digest made to match
    broken["model"]["parameters"]["layers.2.weight"]["shape"] = [16, 8]
    broken["graphs"][0]["values"]["l_self_modules_layers_modules_2_parameters_weight_"]["shape"] = [16, 8]
    _redigest(broken)
    print("\nthe file alone:", [str(p) for p in problems(broken)])
    found = hca.verify(dp(), broken, whole, raise_on_failure=False).problems
    named = [p for p in found if p.rule == "model parameter shape"]
    assert [(p.where, p.says) for p in named] == [("model: parameter 'layers.2.weight'", [16, 8])], found
    assert "it should be [16, 16] (the re-traced model)" in str(named[0])
    assert any(p.rule == "model value shape" and "layers_modules_2_parameters_weight" in p.where for p in found)

    broken = copy.deepcopy(data)  # a value's logical shape edited
    broken["graphs"][0]["values"]["linear_1"]["shape"] = [32, 15]
    with pytest.raises(
        hca.StrategyError, match=r"value 'linear_1': rule 'model value shape': the file says \[32, 15\]"
    ):
        hca.verify(dp(), broken, whole)

    other = _saved(hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(16, 32)), torch.randn(8, 16), tmp_path / "mlp.json")
    assert hca.verify(other).ok  # sound on its own: made for another model
    found = hca.verify(dp(), other, whole, raise_on_failure=False).problems
    assert {"model parameters", "model inputs", "model value shape"} <= {p.rule for p in found}
    assert any(p.where == "model: parameter 'fc1.weight'" and "no such parameter" in p.should for p in found)
    assert any(p.where == "model: parameter 'layers.0.weight'" and p.says == "nothing" for p in found)

    found = hca.verify(dp(), data, (torch.randn(8, 16),), raise_on_failure=False).problems  # one rank's piece
    assert {p.rule for p in found} == {"model inputs", "model value shape"}
    assert "not one rank's piece" in str(next(p for p in found if p.rule == "model inputs"))
    assert hca.verify(dp(), data).model == "DeepMLP (parameters only: no example inputs to re-trace)"
    with pytest.raises(hca.StrategyError, match="no strategy file given"):
        hca.verify(dp())


def test_command_line_verify_against_the_model(fake_pg, tmp_path, monkeypatch, capsys):
    import subprocess
    import sys

    from torch_hca.__main__ import main

    (tmp_path / "verify_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    _saved(hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512)), torch.randn(2, 6, 128), tmp_path / "tp.json")
    model, inputs = "verify_factories:tp_block", "verify_factories:tp_inputs"
    assert main(["verify", str(tmp_path / "tp.json"), "--model", "verify_factories:mlp"]) == 1
    assert "parameter 'attn.wq.weight': rule 'model parameters'" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["verify", str(tmp_path / "tp.json"), "--model", "verify_factories"])
    assert "write MODULE:FACTORY" in capsys.readouterr().err
    # A fresh process: no process group, so the command makes a fake one of the file's world and mesh.
    out = subprocess.run(
        [sys.executable, "-m", "torch_hca", "verify", str(tmp_path / "tp.json"), "--model", model, "--inputs", inputs],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0 and "verified" in out.stdout and "TransformerBlock (re-traced" in out.stdout, (
        out.stdout + out.stderr
    )


def _recomputed_in_backward(d, cid):
    """The file with forward collective `cid` issued once more by the backward graph, as a
    partition that recomputes it leaves it: an entry with ``recomputes``, its issue, its place last
    in the group's backward order (this rank's posted order too)."""
    g = _graph(d)
    first = next(c for c in g["collectives"] if c["id"] == cid)
    again = {
        **first,
        "id": "backward:" + cid.split(":", 1)[1],
        "direction": "backward",
        "partner": None,
        "recomputes": cid,
    }
    again["issued_as"] = again["id"]
    g["collectives"].append(again)
    issue = next(i for i in g["issued"] if i["id"] == first["issued_as"])
    g["issued"].append({**copy.deepcopy(issue), "id": again["id"], "members": [again["id"]], "direction": "backward"})
    group = g["groups"][first["group"]]
    group["backward"].append(again["id"])
    at = group["forward"].index(issue["id"])
    for orders in group.get("ranks", {}).values():
        orders["backward"].append(orders["forward"][at])
    return again


def test_a_forward_collective_the_backward_recomputes_is_checked_as_the_same_one(strategies):
    """AOTAutograd's partition may issue a forward collective again in the backward (it recomputed
    it rather than saving its result; seen on the zoo's Llama on a real (2, 2) mesh): the file has
    it as a backward entry naming the forward one (`recomputes`), which is no cotangent reduction.
    The verifier accepts it as it is, and names it when it differs from the forward one."""
    base = copy.deepcopy(strategies["tp_block"])
    alone = {i["id"] for i in _graph(base)["issued"] if len(i["members"]) == 1}
    gather = next(c for c in _graph(base)["collectives"] if c["direction"] == "forward" and c["issued_as"] in alone)
    clean = copy.deepcopy(base)
    _recomputed_in_backward(clean, gather["id"])
    assert problems(clean) == [], problems(clean)
    for key, wrong in (("bytes", gather["bytes"] * 2), ("origin", "elsewhere"), ("recomputes", "forward:nothing")):
        broken = copy.deepcopy(base)
        _recomputed_in_backward(broken, gather["id"])[key] = wrong
        found = [p for p in problems(broken) if p.rule == "recomputed"]
        assert found, (key, problems(broken))
