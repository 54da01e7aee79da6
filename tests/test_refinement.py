"""The refinement check's tolerance follows the lowest precision the program computes in
(the check itself runs in tests/test_features.py, on real gloo ranks)."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_hca.compiler.checks.refinement import EPSILONS, TOLERANCE, tolerance


def test_tolerance_is_fp32s_unless_the_program_computes_in_less():
    fp32 = make_fx(lambda x: (x * 2).sum())(torch.ones(4))
    assert tolerance(fp32) == TOLERANCE
    bf16 = make_fx(lambda x: (x.to(torch.bfloat16) * 2).float().sum())(torch.ones(4))  # autocast's casts
    assert tolerance(bf16) == EPSILONS * torch.finfo(torch.bfloat16).eps == 0.03125
    fp16 = make_fx(lambda x: (x.half() * 2).float())(torch.ones(4))
    assert tolerance(fp16) == EPSILONS * torch.finfo(torch.float16).eps
    fp64 = make_fx(lambda x: x.double() * 2)(torch.ones(4))
    assert tolerance(fp64) == TOLERANCE
