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
