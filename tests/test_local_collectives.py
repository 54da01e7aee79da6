"""Local-view collectives (`hca.collectives`): values, gradients, roles.

* The classic trap on real gloo ranks: a per-rank loss all-reduced P -> R,
  then ``.backward()``, gives the single-device gradients, not n times them
  (tensor-parallel and data-parallel shapes, eager and compiled).
* Each op, for each role pair it accepts, against single-device math (the
  forward value and the input gradient), on real gloo ranks.
* Structure (fake process group): which collectives forward and backward issue.
* Every role pair an op refuses raises `RoleError` naming the op, the roles and the fix.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import collective_cases
import torch_hca as hca
from torch_hca.api.collectives import Role, role

C = hca.collectives
c10d = torch.ops._c10d_functional
WORLD_SIZES = (2, 4)


# ------------------------------------------------------------ the trap


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_reduced_loss_gives_single_device_gradients(worlds, n, compiled):
    for rank, result in enumerate(worlds(n).run(collective_cases.trap, "R", compiled)):
        for layout, errs in result.items():
            for name, value in errs.items():
                if name.endswith("_ratio"):
                    assert value == pytest.approx(1.0, rel=1e-5), (rank, layout, name, value)
                else:
                    assert value <= 1e-5, (rank, layout, name, value)


def test_invariant_role_sums_the_gradient_pieces(worlds):
    # dst="I" says each rank's gradient is a summand; seeding 1 on every rank then
    # means n in total, and backward (an all_reduce) says so: n times the gradient.
    n = 4
    for result in worlds(n).run(collective_cases.trap, "I", False):
        for layout, errs in result.items():
            for name in ("w1", "b1", "v"):
                assert errs[name + "_ratio"] == pytest.approx(n, rel=1e-5), (layout, name)


# ------------------------------------------- each op against single-device math


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("op", sorted(collective_cases.OPS))
def test_op_values_and_gradients(worlds, op, n):
    results = worlds(n).run(collective_cases.op_case, op, 17)
    for rank, errs in enumerate(results):
        assert errs, op
        for what, err in errs.items():
            assert err <= 1e-12, (op, rank, what, err)


# ------------------------------------------------------ backward structure


def _collectives(fn, x: torch.Tensor, grad_shape) -> tuple[Counter, Counter]:
    """(forward, backward) counts of _c10d_functional collectives (waits left out)."""

    def forward_only(x):
        return fn(x)

    def with_backward(x, g):
        x = x.detach().requires_grad_(True)
        return torch.autograd.grad(fn(x), x, g)

    def count(gm):
        return Counter(
            n.target._opname
            for n in gm.graph.nodes
            if n.op == "call_function"
            and getattr(n.target, "namespace", None) == "_c10d_functional"
            and n.target is not c10d.wait_tensor.default
        )

    fwd = count(make_fx(forward_only)(x))
    both = count(make_fx(with_backward)(x, torch.randn(grad_shape)))
    return fwd, both - fwd


STRUCTURE = [  # op, src, dst, kwargs, input shape, output shape, forward, backward
    ("all_reduce", "P", "R", {}, (4, 2), (4, 2), ["all_reduce"], []),
    ("all_reduce", "P", "I", {}, (4, 2), (4, 2), ["all_reduce"], ["all_reduce"]),
    ("all_gather", "S(1)", "R", {}, (4, 2), (4, 8), ["all_gather_into_tensor"], []),
    ("all_gather", "S(1)", "I", {}, (4, 2), (4, 8), ["all_gather_into_tensor"], ["reduce_scatter_tensor"]),
    ("all_gather", "V", "I", {}, (3,), (4, 3), ["all_gather_into_tensor"], ["reduce_scatter_tensor"]),
    ("reduce_scatter", "P", "S(0)", {}, (8, 2), (2, 2), ["reduce_scatter_tensor"], ["all_gather_into_tensor"]),
    ("reduce_scatter", "P", "V", {}, (4, 3), (3,), ["reduce_scatter_tensor"], ["all_gather_into_tensor"]),
    ("all_to_all", "S(0)", "S(1)", {}, (2, 8), (8, 2), ["all_to_all_single"], ["all_to_all_single"]),
    ("broadcast", "V", "R", {"root": 1}, (3,), (3,), ["broadcast"], []),
    ("broadcast", "V", "I", {"root": 1}, (3,), (3,), ["broadcast"], ["all_reduce"]),
    ("ppermute", "V", "V", {"shift": 1}, (3,), (3,), ["all_to_all_single"], ["all_to_all_single"]),
]


@pytest.mark.parametrize(
    "op, src, dst, kwargs, shape, out_shape, forward, backward",
    STRUCTURE,
    ids=[f"{s[0]}-{s[1]}-{s[2]}" for s in STRUCTURE],
)
def test_backward_collectives_follow_the_roles(fake_pg, op, src, dst, kwargs, shape, out_shape, forward, backward):
    fn = getattr(C, op)
    fwd, bwd = _collectives(lambda x: fn(x, src=src, dst=dst, **kwargs), torch.randn(shape), out_shape)
    assert fwd == Counter(forward) and bwd == Counter(backward), (fwd, bwd)


# ------------------------------------------------------------- role errors

REFUSED = [  # op, src, dst, kwargs, words the message must contain
    (
        "all_reduce",
        "R",
        "R",
        {},
        ["all_reduce(src='R', dst='R')", "counting it 4 times", "src='P'", "do not reduce it"],
    ),
    ("all_reduce", "I", "R", {}, ["counting it 4 times", "src='P'"]),
    ("all_reduce", "V", "R", {}, ["src must be 'P'", "all_gather(src='V')"]),
    ("all_reduce", "S(0)", "R", {}, ["src must be 'P'", "all_gather(src='S(0)')"]),
    ("all_reduce", "P", "P", {}, ["dst must be 'R'", "or 'I'", "reduce_scatter"]),
    ("all_reduce", "P", "S(0)", {}, ["dst must be 'R'"]),
    ("all_gather", "P", "R", {}, ["summed, not gathered", "all_reduce(src='P', dst='R')"]),
    ("all_gather", "R", "R", {}, ["already whole on every rank"]),
    ("all_gather", "S(0)", "S(0)", {}, ["dst must be 'R'"]),
    ("reduce_scatter", "R", "S(0)", {}, ["counting it 4 times", "x.chunk(n, d)[rank]"]),
    ("reduce_scatter", "P", "R", {}, ["dst must be 'S(d)' or 'V'", "all_reduce(src='P', dst='R')"]),
    ("all_to_all", "S(0)", "S(0)", {}, ["same dim"]),
    ("all_to_all", "V", "S(1)", {}, ["src='S(a)', dst='S(b)'"]),
    ("broadcast", "R", "R", {}, ["nothing to broadcast"]),
    ("broadcast", "P", "R", {}, ["src must be 'V'"]),
    ("broadcast", "V", "V", {}, ["dst must be 'R'"]),
    ("ppermute", "R", "R", {"shift": 1}, ["src='V'", "dst='V'"]),
    ("ppermute", "V", "R", {"shift": 1}, ["dst='V'"]),
]


@pytest.mark.parametrize("op, src, dst, kwargs, words", REFUSED, ids=[f"{r[0]}-{r[1]}-{r[2]}" for r in REFUSED])
def test_inconsistent_roles_raise_role_error(fake_pg, op, src, dst, kwargs, words):
    with pytest.raises(hca.RoleError) as info:
        getattr(C, op)(torch.ones(8, 8), src=src, dst=dst, **kwargs)
    message = str(info.value)
    assert message.startswith(f"hca.collectives.{op}(src='{src}', dst='{dst}')"), message
    for word in words:
        assert word in message, (word, message)
    assert isinstance(info.value, hca.HCAError)


def test_roles_parse_from_text_and_placements():
    assert role("R") == Role("R") and role(" S( -1 ) ") == Role("S", -1) and str(role("S(2)")) == "S(2)"
    assert (
        role(hca.Replicate()) == Role("R") and role(hca.Partial()) == Role("P") and role(hca.Shard(1)) == Role("S", 1)
    )
    for bad in ("X", "S", "S(a)", "r", 3):
        with pytest.raises(hca.RoleError, match="is not a role"):
            role(bad)


def test_bad_arguments_raise_collective_error(fake_pg):
    with pytest.raises(hca.CollectiveError, match="exactly one of shift= .* or perm="):
        C.ppermute(torch.ones(2), src="V", dst="V")
    with pytest.raises(hca.CollectiveError, match="dim 0 must be the group size 4"):
        C.reduce_scatter(torch.ones(3, 2), src="P", dst="V")
    with pytest.raises(hca.CollectiveError, match="cannot split evenly"):
        C.reduce_scatter(torch.ones(6, 2), src="P", dst="S(0)")


def test_no_process_group_is_a_mesh_error():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(hca.MeshError, match="no process group is initialized"):
        C.all_reduce(torch.ones(2), src="P", dst="R")


def test_one_mesh_dimension_at_a_time(worlds):
    for rank, errs in enumerate(worlds(4).run(collective_cases.on_mesh_dims)):
        for what, err in errs.items():
            assert err <= 1e-12, (rank, what, err)
