"""The verifier's per-op-family legality rules (torch_hca/verify/op_rules.py): each rule against the
ground truth (every placement of the reads, each rank's op run on its pieces, every output
placement that puts them together as the whole result), real strategy files accepted with their
op values counted, and seeded corruptions that pass every other structural rule caught, each
beside its unbroken control.

The files are real: zoo models compiled on a fake process group (world 4, and 2), saved once per module."""

from __future__ import annotations

import copy
import itertools
import operator
import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import model_zoo
import op_rule_cases
import torch_hca as hca
from torch_hca.verify import op_rules, problems
from torch_hca.verify.op_families import UNSURE, At, Operand, admits
from torch_hca.verify.op_shapes import groups, reshape
from torch_hca.verify.rules import Graph

from dist_cases import fake_world
from test_verify import MODELS

# ----------------------------------------------------------------------------- the ground truth
# On one mesh dim of n ranks: a read cut S(d) (torch.chunk's piece), whole (R), or random pieces
# that sum (P(sum)) or average (P(avg)) to it. The op runs on each rank's pieces; an output
# placement is legal when the ranks' results put together that way are the logical result.


def _pieces(x: torch.Tensor, p: str, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if p == "R":
        return [x] * n
    if p.startswith("S"):
        return list(x.chunk(n, int(p[2:-1])))
    noise = torch.randn((n, *x.shape), generator=gen, dtype=x.dtype)
    noise = noise - noise.mean(0)
    return [(x / n if p == "P(sum)" else x) + e for e in noise]


class Local:
    """An op whose arguments name the output's shape (view, expand): each rank passes its own piece's."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *xs, shape):
        return self.fn(*xs, shape)


def truth(fn, xs: list[torch.Tensor], ps: tuple[str, ...], n: int, shape: tuple[int, ...]) -> set[str]:
    """Every output placement under which the ranks' local results are `fn(*xs)`."""
    gen = torch.Generator().manual_seed(0)
    per_read = [_pieces(x, p, n, gen) for x, p in zip(xs, ps)]
    run = (lambda *a, shape: fn(*a, shape=shape)) if isinstance(fn, Local) else (lambda *a, shape: fn(*a))
    want = run(*xs, shape=shape)
    tol = 1e-9 if want.dtype is torch.float64 else 1e-5  # a cast to float32 rounds
    close = lambda a, b: a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=tol, rtol=tol)
    found = set()
    cuts = [d for d in range(want.dim()) if want.shape[d] % n == 0]
    for q in ["R", *(f"S({d})" for d in cuts)]:
        local = list(shape)
        if q != "R":
            local[int(q[2:-1])] //= n
        try:
            outs = [run(*(pieces[i] for pieces in per_read), shape=tuple(local)) for i in range(n)]
        except (RuntimeError, IndexError, ValueError):
            continue  # the local op does not even run on the pieces
        if q == "R" and all(close(o, want) for o in outs):
            found |= {"R", "P(avg)", "P(max)", "P(min)"}
        if q != "R" and all(close(o, c) for o, c in zip(outs, want.chunk(n, int(q[2:-1])))):
            found.add(q)
        if q == "R" and want.is_floating_point() and all(o.shape == want.shape for o in outs):
            total = sum(o.double() for o in outs)
            found |= {p for p, t in (("P(sum)", total), ("P(avg)", total / n)) if close(t, want)}
    return found


def _placements(x: torch.Tensor, n: int) -> list[str]:
    cut = [f"S({d})" for d in range(x.dim()) if x.shape[d] % n == 0 and x.shape[d] > 1]
    return ["R", *cut] + (["P(sum)", "P(avg)"] if x.is_floating_point() else [])


def _rand(shape, dtype=torch.float64):
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randn(shape, dtype=dtype)


A, B = (4, 6), (6, 4)
# (op as the file names it, the op on whole tensors, the reads' shapes[, their dtypes[, the output's shape]])
CASES = [
    ("_operator.add", operator.add, [A, A]),
    ("_operator.add", operator.add, [(2, 4, 6), (6,)]),
    ("_operator.add", operator.add, [(4, 1), (1, 6)]),
    ("_operator.sub", operator.sub, [A, (1, 6)]),
    ("_operator.mul", operator.mul, [(2, 4, 6), (4, 1)]),
    ("_operator.mul", lambda x: x * 2.0, [A]),  # the scalar is not a read
    ("_operator.truediv", operator.truediv, [A, A]),
    ("_operator.neg", operator.neg, [A]),
    ("torch._VariableFunctionsClass.tanh", torch.tanh, [A]),
    ("torch._C._nn.gelu", F.gelu, [A]),
    ("torch.nn.functional.silu", F.silu, [A]),
    ("torch._VariableFunctionsClass.exp", torch.exp, [A]),
    ("_operator.ge", operator.ge, [A, (6,)]),
    ("torch._VariableFunctionsClass.maximum", torch.maximum, [A, A]),
    ("torch._VariableFunctionsClass.where", torch.where, [A, A, A], [torch.bool, None, None]),
    ("contiguous", lambda x: x.contiguous(), [A]),
    ("to", lambda x: x.to(torch.float32), [A]),
    ("expand", Local(lambda x, s: x.expand(s)), [(1, 6)], [None], (4, 6)),
    ("torch._VariableFunctionsClass.matmul", torch.matmul, [(2, 4, 6), B]),
    ("torch._VariableFunctionsClass.matmul", torch.matmul, [A, (2, 6, 4)]),
    ("torch._VariableFunctionsClass.matmul", torch.matmul, [(6,), B]),
    ("_operator.matmul", operator.matmul, [(2, 4, 6), (2, 6, 4)]),
    ("torch._C._nn.linear", F.linear, [(2, 4, 6), (8, 6), (8,)]),
    ("torch._C._nn.linear", F.linear, [(4, 6), (2, 6)]),
    ("torch._VariableFunctionsClass.addmm", torch.addmm, [(8,), (4, 6), (6, 8)]),
    ("torch._VariableFunctionsClass.bmm", torch.bmm, [(2, 4, 6), (2, 6, 4)]),
    ("sum", lambda x: x.sum(-1), [(2, 4, 6)]),
    ("sum", lambda x: x.sum(), [A]),
    ("torch._VariableFunctionsClass.sum", lambda x: torch.sum(x, (0, 2)), [(4, 4, 6)]),
    ("mean", lambda x: x.mean(0), [A]),
    ("mean", lambda x: x.mean(-1, keepdim=True), [(2, 4, 6)]),
    ("mean", lambda x: x.mean(1), [(4, 4, 6)]),  # dim 0 or dim 1: the shapes cannot say
    ("view", Local(torch.reshape), [(2, 4, 6)], [None], (8, 6)),
    ("view", Local(torch.reshape), [A], [None], (6, 4)),
    ("view", Local(torch.reshape), [A], [None], (2, 12)),
    ("reshape", Local(torch.reshape), [A], [None], (2, 2, 6)),
    ("reshape", Local(torch.reshape), [A], [None], (4, 3, 2)),
    ("flatten", Local(torch.reshape), [(2, 4, 6)], [None], (2, 24)),
    ("unflatten", Local(torch.reshape), [A], [None], (4, 2, 3)),
    ("unsqueeze", Local(torch.reshape), [A], [None], (4, 1, 6)),
    ("squeeze", Local(torch.reshape), [(4, 1, 6)], [None], (4, 6)),
    ("transpose", lambda x: x.transpose(0, 1), [A]),
    ("transpose", lambda x: x.transpose(0, 1), [(4, 4, 6)]),  # or (1, 0), or none: the same shape
    ("permute", lambda x: x.permute(2, 0, 1), [(2, 4, 6)]),
    ("t", lambda x: x.t(), [A]),
    ("narrow", lambda x: x.narrow(1, 0, 2), [A]),
    ("torch._VariableFunctionsClass.cat", lambda a, b: torch.cat([a, b], 1), [A, (4, 2)]),
    ("torch._VariableFunctionsClass.cat", lambda a, b: torch.cat([a, b], 0), [A, A]),
    ("torch.nn.functional.layer_norm", lambda x, w, b: F.layer_norm(x, (6,), w, b), [(2, 4, 6), (6,), (6,)]),
    ("torch.nn.functional.layer_norm", lambda x: F.layer_norm(x, (6,)), [(2, 4, 6)]),
    ("torch.nn.functional.softmax", lambda x: F.softmax(x, -1), [A]),
]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].rsplit(".", 1)[-1])
def test_each_rule_against_the_ground_truth(case, n):
    """No false alarm (every placement the pieces make is one the rule allows, or it does not
    decide), and a rule that decides one placement allows only one the pieces make."""
    name, fn, shapes, *rest = case
    dtypes, shape = (rest + [None, None])[:2]
    torch.manual_seed(0)
    xs = [_rand(s, d or torch.float64) for s, d in zip(shapes, dtypes or [None] * len(shapes))]
    out = fn(*xs, shape=shape) if isinstance(fn, Local) else fn(*xs)
    _, rule = op_rules.TABLE[name]
    decided = 0
    for ps in itertools.product(*(_placements(x, n) for x in xs)):
        reads = tuple(Operand(tuple(x.shape), p, str(x.dtype)[6:]) for x, p in zip(xs, ps))
        verdict = rule(At(tuple(out.shape), str(out.dtype)[6:], reads, n))
        if verdict is None:
            continue
        allowed, why = verdict
        real = truth(fn, xs, ps, n, tuple(out.shape))
        assert all(admits(allowed, p) for p in real), (name, ps, "allows", allowed, "but the pieces make", real, why)
        if UNSURE not in allowed:
            decided += 1
            assert allowed <= real, (name, ps, "allows", allowed, "the pieces make", real, why)
    assert decided, f"{name}: no placement of the reads decided"


def test_the_view_rule_is_the_ground_truth_on_random_shapes():
    """reshape's group rule against the pieces, on 300 random pairs of shapes of one size."""
    rng = random.Random(0)
    sizes = [1, 2, 3, 4, 6, 8, 12]
    tried = decided = 0
    while tried < 300:
        s = tuple(rng.choice(sizes) for _ in range(rng.randint(1, 4)))
        numel, o = s and __import__("math").prod(s), []
        while numel > 1:  # another shape of the same size, from its divisors
            k = rng.choice([x for x in range(2, numel + 1) if numel % x == 0])
            o.append(k)
            numel //= k
            if rng.random() < 0.2:
                o.append(1)
        o = tuple(o)
        n = rng.choice([2, 3, 4])
        x = torch.randn(s, dtype=torch.float64)
        for j in [j for j in range(len(s)) if s[j] % n == 0 and s[j] > 1]:
            tried += 1
            verdict = reshape(At(o, "float64", (Operand(s, f"S({j})", "float64"),), n))
            real = truth(Local(torch.reshape), [x], (f"S({j})",), n, o)
            assert verdict is not None, (s, o, j)
            assert real <= verdict[0] and (not verdict[0] or verdict[0] <= real), (s, o, j, n, verdict, real)
            decided += bool(verdict[0])
    assert decided > 50
    assert groups((8, 6), (48,)) == [([0, 1], [0])] and groups((4, 6), (6, 4)) == [([0, 1], [0, 1])]


# ----------------------------------------------------------------------------- tiny synthetic files


def _graph(values: dict, mesh: list[int] | None = None) -> Graph:
    """A graph of `values` (name -> (op, shape, placements, reads)) on a mesh, the fields the rules read."""
    mesh = mesh or [2]
    entries = {
        name: {
            "kind": "input" if op is None else "op",
            "op": op or "placeholder",
            "shape": list(shape),
            "dtype": "float32",
            "placements": list(ps),
            "reads": list(reads),
        }
        for name, (op, shape, ps, reads) in values.items()
    }
    ranks = torch.arange(__import__("math").prod(mesh)).reshape(mesh).tolist()
    data = {
        "mesh": {"shape": mesh, "ranks": ranks},
        "graphs": [{"values": entries, "moves": [], "collectives": [], "issued": []}],
    }
    return Graph(0, data["graphs"][0], data)


def _found(values: dict, mesh: list[int] | None = None) -> list:
    return list(op_rules.op_placement(_graph(values, mesh)))


TANH, MM, SUM = "torch._VariableFunctionsClass.tanh", "torch._VariableFunctionsClass.matmul", "sum"


@pytest.mark.parametrize(
    "values,should",
    [
        # a tanh of a replicated read written as a partial sum: n copies of tanh(x) summed
        ({"x": (None, (4, 6), ["R"], []), "t": (TANH, (4, 6), ["P(sum)"], ["x"])}, "it should be R"),
        # a nonlinear op of a partial
        ({"x": (None, (4, 6), ["P(sum)"], []), "t": (TANH, (4, 6), ["P(sum)"], ["x"])}, "not linear in it"),
        # the contracted dim cut on both operands: a partial sum, not a shard
        (
            {
                "a": (None, (4, 6), ["S(1)"], []),
                "b": (None, (6, 8), ["S(0)"], []),
                "c": (MM, (4, 8), ["S(0)"], ["a", "b"]),
            },
            "it should be P(sum)",
        ),
        # the contracted dim cut on one operand only
        (
            {
                "a": (None, (4, 6), ["S(1)"], []),
                "b": (None, (6, 8), ["R"], []),
                "c": (MM, (4, 8), ["P(sum)"], ["a", "b"]),
            },
            "must be S(0), not R",
        ),
        # a sum over the sharded dim written whole: nothing reduced it
        ({"x": (None, (4, 6), ["S(1)"], []), "s": (SUM, (4,), ["R"], ["x"])}, "it should be P(sum)"),
        # a mean over it: each rank's mean of its piece averages to the mean
        ({"x": (None, (4, 6), ["S(1)"], []), "s": ("mean", (4, 1), ["P(sum)"], ["x"])}, "it should be P(avg)"),
        # an elementwise output's shard dim changed
        (
            {
                "x": (None, (4, 6), ["S(0)"], []),
                "y": (None, (6,), ["R"], []),
                "z": ("_operator.add", (4, 6), ["S(1)"], ["x", "y"]),
            },
            "it should be S(0)",
        ),
        # reads cut on different dims
        (
            {
                "x": (None, (4, 6), ["S(0)"], []),
                "y": (None, (4, 6), ["S(1)"], []),
                "z": ("_operator.mul", (4, 6), ["S(0)"], ["x", "y"]),
            },
            "different output dims",
        ),
        # a product of two partials
        (
            {
                "x": (None, (4, 6), ["P(sum)"], []),
                "y": (None, (4, 6), ["P(sum)"], []),
                "z": ("_operator.mul", (4, 6), ["P(sum)"], ["x", "y"]),
            },
            "read from other placements",
        ),
        # a partial plus a replicated value: the replicated one counted n times
        (
            {
                "x": (None, (4, 6), ["P(sum)"], []),
                "y": (None, (6,), ["R"], []),
                "z": ("_operator.add", (4, 6), ["P(sum)"], ["x", "y"]),
            },
            "read from other placements",
        ),
        # a view merging an inner cut dim: each rank's piece is strided in the flat value
        ({"x": (None, (8, 6), ["S(1)"], []), "y": ("view", (48,), ["S(0)"], ["x"])}, "not the outermost"),
        # a transpose whose shard stayed put
        ({"x": (None, (4, 6), ["S(0)"], []), "y": ("transpose", (6, 4), ["S(0)"], ["x"])}, "it should be S(1)"),
        # a layer norm over its cut dim
        (
            {
                "x": (None, (4, 6), ["S(1)"], []),
                "w": (None, (6,), ["R"], []),
                "y": ("torch.nn.functional.layer_norm", (4, 6), ["S(1)"], ["x", "w"]),
            },
            "is normalized",
        ),
    ],
)
def test_an_illegal_placement_is_named(values, should):
    (found,) = _found(values)
    last = list(values)[-1]
    assert found.rule == "op placement" and found.where.startswith(f"graph 0, value {last!r} (")
    assert should in str(found) and "the file says" in str(found), str(found)


@pytest.mark.parametrize(
    "values",
    [
        {"x": (None, (4, 6), ["S(1)"], []), "s": (SUM, (4,), ["P(sum)"], ["x"])},
        {"x": (None, (4, 6), ["S(0)"], []), "s": ("mean", (4,), ["S(0)"], ["x"])},
        {
            "a": (None, (4, 6), ["S(1)"], []),
            "b": (None, (6, 8), ["S(0)"], []),
            "c": (MM, (4, 8), ["P(sum)"], ["a", "b"]),
        },
        {
            "a": (None, (2, 4, 6), ["S(0)"], []),
            "b": (None, (6, 8), ["R"], []),
            "c": (MM, (2, 4, 8), ["S(0)"], ["a", "b"]),
        },
        {
            "x": (None, (4, 6), ["P(sum)"], []),
            "y": (None, (6,), ["R"], []),
            "z": ("_operator.mul", (4, 6), ["P(sum)"], ["x", "y"]),
        },
        # a replicated value is its own average: R + P(avg) is P(avg) (DTensor writes these)
        {
            "x": (None, (4, 6), ["R"], []),
            "y": (None, (4, 1), ["P(avg)"], []),
            "z": ("_operator.add", (4, 6), ["P(avg)"], ["x", "y"]),
        },
        {"x": (None, (8, 6), ["S(0)"], []), "y": ("view", (48,), ["S(0)"], ["x"])},
        {"x": (None, (1, 6), ["R"], []), "y": ("expand", (4, 6), ["S(0)"], ["x"])},  # each rank expands to its piece
    ],
)
def test_a_legal_placement_passes(values):
    assert _found(values) == []


def test_what_the_rules_cannot_decide_is_counted_not_guessed():
    g = _graph(
        {
            "x": (None, (4, 6), ["P(sum)"], []),
            "sq": ("_operator.mul", (4, 6), ["P(sum)"], ["x"]),  # x * x or x * 2: one read either way
            "e": ("torch_hca.compiler.embedding.embedding", (4, 6), ["S(0)"], ["x"]),  # no family here
            "y": (None, (4, 4, 6), ["S(1)"], []),
            "t": ("transpose", (4, 4, 6), ["S(0)"], ["y"]),  # (0, 1) or (1, 0): the same shapes
            "r": ("_operator.neg", (4, 6), ["P(sum)"], ["x"]),  # decided: neg is linear
        }
    )
    assert list(op_rules.op_placement(g)) == []
    data = {"mesh": g.data["mesh"], "graphs": [g.g]}
    tally = op_rules.tally(data)
    assert tally.checked == 1 and dict(tally.not_checked) == {
        "_operator.mul": 1,
        "torch_hca.compiler.embedding.embedding": 1,
        "transpose": 1,
    }
    assert str(tally) == "op rules: 1 values checked, 3 not checked"


def test_a_mesh_dim_of_one_rank_is_not_asked():
    assert (
        _found({"x": (None, (4, 6), ["R", "S(0)"], []), "t": (TANH, (4, 6), ["P(sum)", "S(0)"], ["x"])}, [1, 2]) == []
    )
    assert len(_found({"x": (None, (4, 6), ["R", "S(0)"], []), "t": (TANH, (4, 6), ["R", "S(1)"], ["x"])}, [1, 2])) == 1


def test_the_op_table_is_keyed_by_the_ops_themselves():
    assert op_rules.op_name(operator.add) == "_operator.add" and op_rules.op_name(torch.Tensor.view) == "view"
    assert op_rules.TABLE[op_rules.op_name(F.linear)][0] == "matmul"
    with pytest.raises(ValueError, match="registered twice"):
        op_rules._family("pointwise", op_rules.TABLE["view"][1], [torch.Tensor.view])


# ----------------------------------------------------------------------------- real files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Real files: `Mixer` (a sum and a mean over a sharded dim, DTensor's own layout), the TP
    transformer block and data parallel (fake world 4); the zoo's GPT-2 under its Megatron plan
    (world 2). test_verify.py's MUTATIONS run these corruptions on its five files too."""
    out = {}

    def save(name, model, *xs, options=None):
        torch._dynamo.reset()
        options = {"strict": True, "schedule": False, **(options or {})}
        c = torch.compile(model, backend="hca", options=options, dynamic=False)
        y = c(*xs)
        (y if y.dim() == 0 else y.float().sum()).backward()
        out[name] = hca.report(c).save_strategy(tmp_path_factory.mktemp(name) / "s.json")

    with fake_world(4):
        plan = {"up.weight": Shard(0), "up.bias": Shard(0)}
        save("mixer", hca.sharded(plan)(op_rule_cases.Mixer()), torch.randn(512, 16), options={"layout": "dtensor"})
        for name in ("tp_block", "data_parallel"):
            save(name, *MODELS[name]())
    with fake_world(2):
        torch.manual_seed(0)
        ref, make_inputs, _ = model_zoo.build("gpt2")
        spec = model_zoo.plan_spec("gpt2", "megatron", 2, ref)
        mesh = hca.init_mesh(spec.mesh_shape, spec.mesh_names)
        save("gpt2", hca.sharded(spec.plan, mesh=mesh)(ref), *make_inputs(model_zoo.BATCH))
    return out


def test_real_files_pass_and_their_op_values_are_counted(files):
    for name, data in files.items():
        result = hca.verify(data)
        tally = result.op_rules
        assert result.ok and tally.checked > 0, (name, result)
        assert f"; op rules: {tally.checked} values checked, {sum(tally.not_checked.values())} not checked" in str(
            result
        )
        print(f"\n{name}: {tally}; not checked: {dict(tally.not_checked.most_common(4))}")
    # the ops of a family are all decided in these files: what is left is of no family
    left = {op for d in files.values() for op in op_rules.tally(d).not_checked}
    assert not left & {"torch._C._nn.linear", "_operator.add", "_operator.mul", "view", "transpose", "sum", "mean"}


SEEDS = (0, 1, 2)


def test_seeded_corruptions_pass_every_other_rule_and_are_named(files):
    """Each corruption (op_rule_cases.MUTATIONS) passes every structural rule the verifier had
    before the op rules, and the op rules name it; every unbroken file passes."""
    tried, kinds = 0, set()
    for name, data in files.items():
        assert problems(data) == [], name  # the unbroken control
        for mutate in op_rule_cases.MUTATIONS:
            for seed in SEEDS:
                broken = copy.deepcopy(data)
                rule = mutate(broken, random.Random(f"{name}/{mutate.__name__}/{seed}"))
                if rule is None:
                    continue
                tried += 1
                kinds.add(mutate.__name__)
                found = problems(broken)
                assert found and {p.rule for p in found} == {"op placement"}, (name, mutate.__name__, seed, found)
                text = str(found[0])
                assert "rule 'op placement': the file says" in text and "on mesh dim" in text and "it should be" in text
    assert kinds == {m.__name__ for m in op_rule_cases.MUTATIONS} and tried >= 40, (kinds, tried)
    print(f"\nop rules: {tried} of {tried} seeded corruptions caught ({len(kinds)} kinds x {len(files)} files)")


def test_the_named_corruptions_of_the_brief(files):
    """A tanh written P(sum), a matmul of contraction-cut operands written whole with its all_reduce
    dropped, a sum over a sharded dim written whole, on the files that hold them."""
    mixer = copy.deepcopy(files["mixer"])
    assert op_rule_cases.nonlinear_written_partial(mixer, random.Random(0)) == "op placement"
    (p,) = [p for p in problems(mixer) if "(torch._VariableFunctionsClass.tanh)" in p.where]
    assert p.says.startswith("P(sum) on mesh dim 0") and p.should.startswith("S(1) (pointwise")
    mixer = copy.deepcopy(files["mixer"])
    mixer["graphs"][0]["values"]["s"]["placements"] = ["R"]  # its reader multiplies it: no move to fix
    assert {p.rule for p in problems(mixer)} == {"op placement"}
    assert any(
        p.where == "graph 0, value 's' (sum)" and p.should.startswith("P(sum) (reduction") for p in problems(mixer)
    )
    tp = copy.deepcopy(files["tp_block"])
    assert op_rule_cases.contraction_written_whole(tp, random.Random(0)) == "op placement"
    (p,) = problems(tp)
    assert "value 'linear_3' (torch._C._nn.linear)" in p.where and p.should.startswith("P(sum) (matmul")
