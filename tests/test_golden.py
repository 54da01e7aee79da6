"""Golden text of what the compiler produces, on a fake process group of world size 4.

The expectations are inline (`expecttest`); after a deliberate change to the
compiler, regenerate them with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py``
and review the diff.

The text is normalized first (`normalize`) so that the goldens show the
program, not FX's bookkeeping: no trailing whitespace or blank lines, no
``;  a = b = None`` liveness suffixes, short type annotations and placement
names, and (in the collectives table) no process-global graph index.
"""

from __future__ import annotations

import re

import expecttest
import torch
import torch.distributed as dist

import torch_hca as hca
from torch_hca._torch_private import clear_dtensor_sharding_cache
from torch_hca.tools import zoo
from torch_hca.runtime.mesh import reset_current_mesh

_LIVENESS = re.compile(r";  (?:\w+ = )+None$")
_SHORT_NAMES = {
    "torch.distributed.tensor.placement_types.": "",
    "torch.distributed.tensor.DTensor": "DTensor",
    "torch.distributed.device_mesh.DeviceMesh": "DeviceMesh",
    "torch.Tensor": "Tensor",
}


def _short(text: str) -> str:
    for long, short in _SHORT_NAMES.items():
        text = text.replace(long, short)
    return text


def _def_line(line: str) -> list[str]:
    """``def forward(self, a : T, b : U):`` -> one parameter a line, short annotations."""
    m = re.match(r"^(\s*)def (\w+)\((.*)\):$", line)
    if m is None:
        return [line]
    indent, name, params = m.groups()
    params = [p.strip().replace(" : ", ": ") for p in params.split(",")]
    if len(params) <= 3:
        return [f"{indent}def {name}({', '.join(params)}):"]
    return [f"{indent}def {name}("] + [f"{indent}    {p}," for p in params] + [f"{indent}):"]


_MESH_INDEX = re.compile(r"((?:from_local|replicate)\(\w+, )\d+,")


def normalize(code: str) -> str:
    """Generated code or table text, in the form the goldens hold."""
    out = []
    for line in code.splitlines():
        line = _LIVENESS.sub("", line.rstrip())
        line = _MESH_INDEX.sub(r"\1MESH,", line)  # a process-global index of torch_hca.compiler.logical
        if not line.strip():
            continue
        if line.lstrip().startswith("def "):
            out.extend(_def_line(_short(line)))
        else:
            out.append(_short(line))
    return "\n".join(out)


def normalize_table(table: str) -> str:
    """`CompileReport.table()` with the graph column (a process-global index) masked."""
    lines = [line.rstrip() for line in table.splitlines() if line.strip()]
    return "\n".join(lines[:1] + [re.sub(r"^\d+\s+", lambda m: "#".ljust(len(m.group(0))), line) for line in lines[1:]])


def _clear_sharding_prop_cache():
    clear_dtensor_sharding_cache()


class FakePGTestCase(expecttest.TestCase):
    """A fake process group of world size 4 and its 1-D mesh around every test
    (the `fake_pg` fixture of conftest.py, which expecttest classes cannot use)."""

    world_size = 4

    def setUp(self):
        super().setUp()
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch._dynamo.reset()
        _clear_sharding_prop_cache()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        self.addCleanup(self._teardown_pg)
        self.mesh = hca.init_mesh()

    @staticmethod
    def _teardown_pg():
        dist.destroy_process_group()
        reset_current_mesh()
        torch._dynamo.reset()
        _clear_sharding_prop_cache()

    def compile_and_step(self, model, x) -> hca.CompileReport:
        compiled = torch.compile(model, backend="hca")
        compiled(x).sum().backward()
        return hca.report(compiled)


class TestGolden(FakePGTestCase):
    def mlp_report(self) -> hca.CompileReport:
        torch.manual_seed(0)
        # Weights large enough that the layout solver picks Megatron (docs/layout.md).
        model = hca.sharded(zoo.MEGATRON_MLP)(zoo.MLP(64, 256))
        return self.compile_and_step(model, torch.randn(8, 64))

    def test_normalize(self):
        code = (
            "\n\n\ndef forward(self, L_x_ : torch.Tensor, L_w_ : torch.distributed.tensor.DTensor, "
            "L_m_ : torch.distributed.device_mesh.DeviceMesh, L_b_ : torch.Tensor):   \n"
            "    y = f(L_x_, (torch.distributed.tensor.placement_types.Replicate(),));  L_x_ = L_w_ = None\n"
            "    \n    return (y,)\n    \n"
        )
        self.assertExpectedInline(
            normalize(code),
            """\
def forward(
    self,
    L_x_: Tensor,
    L_w_: DTensor,
    L_m_: DeviceMesh,
    L_b_: Tensor,
):
    y = f(L_x_, (Replicate(),))
    return (y,)""",
        )
        self.assertEqual(
            normalize("def forward(self, a, b):\n    return (a,)"), "def forward(self, a, b):\n    return (a,)"
        )

    def test_mlp_dtensor_program(self):
        r = self.mlp_report()
        self.assertExpectedInline(
            normalize(r.dtensor_code),
            """\
def forward(
    self,
    L_self_modules_fc1_parameters_weight_: DTensor,
    L_self_modules_fc1_parameters_bias_: DTensor,
    L_self_modules_fc2_parameters_weight_: DTensor,
    L_self_modules_fc2_parameters_bias_: DTensor,
    L_args_0_: Tensor,
):
    l_self_modules_fc1_parameters_weight_ = L_self_modules_fc1_parameters_weight_
    l_self_modules_fc1_parameters_bias_ = L_self_modules_fc1_parameters_bias_
    l_self_modules_fc2_parameters_weight_ = L_self_modules_fc2_parameters_weight_
    l_self_modules_fc2_parameters_bias_ = L_self_modules_fc2_parameters_bias_
    reduce_gradient_eagerly = torch_hca_compiler_dtensor_ops_reduce_gradient_eagerly(l_self_modules_fc2_parameters_bias_)
    l_args_0_ = L_args_0_
    from_local = torch_hca_compiler_dtensor_ops_from_local(l_args_0_, MESH, (Replicate(),), [8, 64])
    linear = torch._C._nn.linear(from_local, l_self_modules_fc1_parameters_weight_, l_self_modules_fc1_parameters_bias_)
    gelu = torch._C._nn.gelu(linear)
    redistribute = torch_hca_compiler_dtensor_ops_redistribute(reduce_gradient_eagerly, (Partial('sum'),))
    out = torch._C._nn.linear(gelu, l_self_modules_fc2_parameters_weight_, redistribute)
    redistribute_1 = torch_hca_compiler_dtensor_ops_redistribute(out, (Replicate(),))
    to_output = torch_hca_compiler_dtensor_ops_to_output(redistribute_1, (Replicate(),))
    return (to_output,)""",
        )

    def test_mlp_forward_graph(self):
        r = self.mlp_report()
        self.assertExpectedInline(
            normalize(r.forward.code),
            """\
def forward(
    self,
    primals_1,
    primals_2,
    primals_3,
    primals_4,
    primals_5,
    primals_6,
    primals_7,
    primals_8,
    primals_9,
):
    view = torch.ops.aten.view.default(primals_7, [64])
    view_1 = torch.ops.aten.view.default(primals_9, [8, 64])
    t = torch.ops.aten.t.default(primals_1)
    addmm = torch.ops.aten.addmm.default(primals_3, view_1, t)
    gelu = torch.ops.aten.gelu.default(addmm)
    div = torch.ops.aten.div.Tensor(view, 4)
    t_1 = torch.ops.aten.t.default(primals_5)
    addmm_1 = torch.ops.aten.addmm.default(div, gelu, t_1)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(addmm_1, 'sum', '0')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    view_2 = torch.ops.aten.view.default(wait_tensor, [8, 64])
    return (view_2, view_1, addmm, gelu, t_1, primals_2)""",
        )

    def test_mlp_backward_graph(self):
        r = self.mlp_report()
        self.assertExpectedInline(
            normalize(r.backward.code),
            """\
def forward(
    self,
    view_1,
    addmm,
    gelu,
    t_1,
    primals_2,
    tangents_1,
):
    view_3 = torch.ops.aten.view.default(tangents_1, [8, 64])
    t_2 = torch.ops.aten.t.default(t_1)
    mm = torch.ops.aten.mm.default(view_3, t_2)
    t_3 = torch.ops.aten.t.default(view_3)
    mm_1 = torch.ops.aten.mm.default(t_3, gelu)
    t_4 = torch.ops.aten.t.default(mm_1)
    sum_1 = torch.ops.aten.sum.dim_IntList(view_3, [0], True)
    view_4 = torch.ops.aten.view.default(sum_1, [64])
    t_5 = torch.ops.aten.t.default(t_4)
    gelu_backward = torch.ops.aten.gelu_backward.default(mm, addmm)
    t_6 = torch.ops.aten.t.default(gelu_backward)
    mm_2 = torch.ops.aten.mm.default(t_6, view_1)
    t_7 = torch.ops.aten.t.default(mm_2)
    sum_2 = torch.ops.aten.sum.dim_IntList(gelu_backward, [0], True)
    view_5 = torch.ops.aten.view.default(sum_2, [64])
    t_8 = torch.ops.aten.t.default(t_7)
    return (t_8, primals_2, view_5, primals_2, t_5, primals_2, view_4, primals_2, None)""",
        )

    def test_mlp_collectives_table(self):
        r = self.mlp_report()
        self.assertExpectedInline(
            normalize_table(r.table()),
            """\
graph  dir  kind        group  n  shape  dtype    bytes  wire/rank  partner  rule
#      for  all_reduce  0      4  8x64   float32  2048   3072       -        all_reduce of redistribute_1 (redistribute; mesh dim 0: P -> R); no backward collective transposes it""",
        )
        self.assertEqual(r.collective_counts("forward"), {"all_reduce": 1})
        self.assertEqual(r.collective_counts("backward"), {})

    def test_transformer_block_dtensor_program(self):
        torch.manual_seed(0)
        model = hca.sharded(zoo.TP_BLOCK)(zoo.TransformerBlock(128, 4, 512))
        r = self.compile_and_step(model, torch.randn(2, 6, 128))
        self.assertExpectedInline(
            normalize(r.dtensor_code),
            """\
def forward(
    self,
    L_self_modules_norm1_parameters_weight_: DTensor,
    L_self_modules_norm1_parameters_bias_: DTensor,
    L_self_modules_attn_modules_wq_parameters_weight_: DTensor,
    L_self_modules_attn_modules_wk_parameters_weight_: DTensor,
    L_self_modules_attn_modules_wv_parameters_weight_: DTensor,
    L_self_modules_attn_modules_wo_parameters_weight_: DTensor,
    L_self_modules_norm2_parameters_weight_: DTensor,
    L_self_modules_norm2_parameters_bias_: DTensor,
    L_self_modules_mlp_modules_fc1_parameters_weight_: DTensor,
    L_self_modules_mlp_modules_fc1_parameters_bias_: DTensor,
    L_self_modules_mlp_modules_fc2_parameters_weight_: DTensor,
    L_self_modules_mlp_modules_fc2_parameters_bias_: DTensor,
    L_args_0_: Tensor,
):
    l_self_modules_norm1_parameters_weight_ = L_self_modules_norm1_parameters_weight_
    reduce_gradient_eagerly = torch_hca_compiler_dtensor_ops_reduce_gradient_eagerly(l_self_modules_norm1_parameters_weight_)
    l_self_modules_norm1_parameters_bias_ = L_self_modules_norm1_parameters_bias_
    reduce_gradient_eagerly_1 = torch_hca_compiler_dtensor_ops_reduce_gradient_eagerly(l_self_modules_norm1_parameters_bias_)
    l_self_modules_attn_modules_wq_parameters_weight_ = L_self_modules_attn_modules_wq_parameters_weight_
    l_self_modules_attn_modules_wk_parameters_weight_ = L_self_modules_attn_modules_wk_parameters_weight_
    l_self_modules_attn_modules_wv_parameters_weight_ = L_self_modules_attn_modules_wv_parameters_weight_
    l_self_modules_attn_modules_wo_parameters_weight_ = L_self_modules_attn_modules_wo_parameters_weight_
    l_self_modules_norm2_parameters_weight_ = L_self_modules_norm2_parameters_weight_
    reduce_gradient_eagerly_2 = torch_hca_compiler_dtensor_ops_reduce_gradient_eagerly(l_self_modules_norm2_parameters_weight_)
    l_self_modules_norm2_parameters_bias_ = L_self_modules_norm2_parameters_bias_
    reduce_gradient_eagerly_3 = torch_hca_compiler_dtensor_ops_reduce_gradient_eagerly(l_self_modules_norm2_parameters_bias_)
    l_self_modules_mlp_modules_fc1_parameters_weight_ = L_self_modules_mlp_modules_fc1_parameters_weight_
    l_self_modules_mlp_modules_fc1_parameters_bias_ = L_self_modules_mlp_modules_fc1_parameters_bias_
    l_self_modules_mlp_modules_fc2_parameters_weight_ = L_self_modules_mlp_modules_fc2_parameters_weight_
    l_self_modules_mlp_modules_fc2_parameters_bias_ = L_self_modules_mlp_modules_fc2_parameters_bias_
    reduce_gradient_eagerly_4 = torch_hca_compiler_dtensor_ops_reduce_gradient_eagerly(l_self_modules_mlp_modules_fc2_parameters_bias_)
    l_args_0_ = L_args_0_
    from_local = torch_hca_compiler_dtensor_ops_from_local(l_args_0_, MESH, (Replicate(),), [2, 6, 128])
    layer_norm = torch.nn.functional.layer_norm(from_local, (128,), reduce_gradient_eagerly, reduce_gradient_eagerly_1, 1e-05)
    reduce_cotangent = torch_hca_compiler_dtensor_ops_reduce_cotangent(layer_norm, (0,))
    linear = torch._C._nn.linear(reduce_cotangent, l_self_modules_attn_modules_wq_parameters_weight_, None)
    view = linear.view(2, 6, 4, 32)
    q = view.transpose(1, 2)
    linear_1 = torch._C._nn.linear(reduce_cotangent, l_self_modules_attn_modules_wk_parameters_weight_, None)
    view_1 = linear_1.view(2, 6, 4, 32)
    k = view_1.transpose(1, 2)
    linear_2 = torch._C._nn.linear(reduce_cotangent, l_self_modules_attn_modules_wv_parameters_weight_, None)
    view_2 = linear_2.view(2, 6, 4, 32)
    v_12 = view_2.transpose(1, 2)
    y = torch_hca_compiler_attention_sdpa(q, k, v_12, is_causal = True)
    transpose_3 = y.transpose(1, 2)
    reshape = transpose_3.reshape(2, 6, 128)
    linear_3 = torch._C._nn.linear(reshape, l_self_modules_attn_modules_wo_parameters_weight_, None)
    redistribute = torch_hca_compiler_dtensor_ops_redistribute(linear_3, (Replicate(),))
    x = from_local + redistribute
    layer_norm_1 = torch.nn.functional.layer_norm(x, (128,), reduce_gradient_eagerly_2, reduce_gradient_eagerly_3, 1e-05)
    reduce_cotangent_1 = torch_hca_compiler_dtensor_ops_reduce_cotangent(layer_norm_1, (0,))
    linear_4 = torch._C._nn.linear(reduce_cotangent_1, l_self_modules_mlp_modules_fc1_parameters_weight_, l_self_modules_mlp_modules_fc1_parameters_bias_)
    gelu = torch._C._nn.gelu(linear_4)
    redistribute_1 = torch_hca_compiler_dtensor_ops_redistribute(reduce_gradient_eagerly_4, (Partial('sum'),))
    linear_5 = torch._C._nn.linear(gelu, l_self_modules_mlp_modules_fc2_parameters_weight_, redistribute_1)
    redistribute_2 = torch_hca_compiler_dtensor_ops_redistribute(linear_5, (Replicate(),))
    out = x + redistribute_2
    to_output = torch_hca_compiler_dtensor_ops_to_output(out, (Replicate(),))
    return (to_output,)""",
        )
        self.assertEqual(r.collective_counts("forward"), {"all_reduce": 2})
        self.assertEqual(r.collective_counts("backward"), {"all_reduce": 2})


if __name__ == "__main__":
    import unittest

    unittest.main()
