"""hca::attention runs the fused CPU kernel where it can: the same numbers as the math path
(forward and backward), for every mask kind, causal or not, grouped-query heads or not."""

import itertools

import pytest
import torch

from torch_hca.compiler import attention as A

CASES = list(itertools.product((1, 2), (0, 1), ("none", "bool [b,1,L,S]", "float [L,S]", "bool [L,S]")))


def _mask(kind: str, b: int, length: int):
    if kind == "none":
        return None
    shape = (b, 1, length, length) if "[b" in kind else (length, length)
    if kind.startswith("float"):
        return torch.randn(shape, dtype=torch.float64)
    mask = torch.rand(shape) > 0.3
    mask[..., 0] = True  # no query sees no key
    return mask


@pytest.mark.parametrize("groups,causal,mask_kind", CASES)
def test_fused_cpu_attention_matches_the_math(groups, causal, mask_kind):
    torch.manual_seed(0)
    b, h, length, e = 2, 4, 8, 16
    q = torch.randn(b, h, length, e, dtype=torch.float64)
    k, v = (torch.randn(b, h // groups, length, e, dtype=torch.float64) for _ in range(2))
    mask = _mask(mask_kind, b, length)
    assert A._fusable(q, mask)
    out = A.attention(q, k, v, mask, causal, 0.3, groups)
    grad = torch.randn_like(out)
    dq, dk, dv = A.attention_backward(grad, q, k, v, mask, causal, 0.3, groups)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = A._math(*leaves, mask, causal, 0.3, groups)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for got, leaf in zip((dq, dk, dv), leaves):
        assert got.shape == leaf.shape and got.is_contiguous()
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=1e-12)


def test_other_shapes_keep_the_math():
    q = torch.randn(2, 8, 16)  # 3-D: no head dim for the kernel
    assert not A._fusable(q, None)
    assert not A._fusable(torch.randn(1, 2, 4, 8), torch.ones(2, 4, 8, dtype=torch.bool))  # 3-D mask
    torch.testing.assert_close(A.attention(q, q, q, None, 1, 0.25, 1), A._math(q, q, q, None, 1, 0.25, 1))


@pytest.mark.parametrize("causal", [False, True])
def test_the_solvers_attention_filter_keeps_every_layout_dtensor_runs(fake_pg, causal):
    """`attention.runs_in_place` rules layouts out before the layout solver probes them; it may
    keep one DTensor would move, never drop one DTensor runs in place. Every combination it keeps,
    and a seeded sample of the rest, run on fake DTensors over a mesh of 4 (GQA, a [b,1,L,S] mask)."""
    import random

    from torch.distributed.tensor import DTensor, Replicate

    from torch_hca._torch_private import record_implicit_redistributions
    from torch_hca.compiler.layout.candidates import candidate_layouts
    from torch_hca.compiler.layout.probes import _fake_dtensor

    b, h, kv, length, e = 4, 8, 4, 8, 16
    whole = lambda *shape, **kw: DTensor.from_local(torch.randn(shape, **kw), fake_pg, (Replicate(),))
    q, k, v = whole(b, h, length, e), whole(b, kv, length, e), whole(b, kv, length, e)
    mask = DTensor.from_local(torch.rand(b, 1, length, length) > 0.3, fake_pg, (Replicate(),))
    values = (q, k, v, mask)
    combos = list(itertools.product(*(candidate_layouts(t, fake_pg, None) for t in values)))

    def kept(layouts):
        read = {id(t): lay for t, lay in zip(values, layouts)}
        return A.runs_in_place((q, k, v, mask), {"is_causal": causal, "enable_gqa": True}, lambda t: read.get(id(t)))

    def runs(layouts):
        args = [_fake_dtensor(t, lay) for t, lay in zip(values, layouts)]
        try:
            with record_implicit_redistributions() as moved:
                A.sdpa(*args, is_causal=causal, enable_gqa=True)
        except Exception:  # no rule at all
            return False
        return not moved

    keep = [c for c in combos if kept(c)]
    rest = random.Random(0).sample([c for c in combos if not kept(c)], 60)
    assert 0 < len(keep) < len(combos) / 20, (len(keep), len(combos))
    assert [c for c in rest if runs(c)] == [], "a layout DTensor runs in place was ruled out"
    ran = [c for c in keep if runs(c)]
    names = {tuple(str(p) for lay in c for p in lay) for c in ran}
    # The batch split, the heads split (the mask broadcasts over heads), the queries split (not causal).
    assert ("S(0)",) * 4 in names and ("S(1)", "S(1)", "S(1)", "R") in names and ("R",) * 4 in names, names
    assert (("S(2)", "R", "R", "S(2)") in names) == (not causal) and len(names) == 4 - causal, names
