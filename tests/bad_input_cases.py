"""Bad inputs, one row each: what a user might pass, the `HCAError` subclass it must raise, and a
regex its message must match, naming the problem (the parameter, option or argument, and its
value) and the fix.

`tests/test_bad_inputs.py` runs the rows; ``python tests/bad_input_cases.py`` counts how each
fares (good / poor / hang / abort / silent) for docs/reliability.md, and runs against any
checkout of torch_hca first on ``sys.path``.

Worlds: ``"fake"`` rows run in the fake process group of 4 ranks with its 1-D mesh current
(graph-only: no numbers are checked); ``"none"`` rows with no process group at all; ``"ranks"``
rows on 2 real gloo ranks, all of them in one `LocalWorld.run` (`run_on_ranks`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import torch_hca as hca
from torch_hca.api import collectives as C
from torch_hca.tools import zoo
from torch_hca.runtime.mesh import reset_current_mesh
from torch_hca.compiler.options import Options

NAN, INF = math.nan, math.inf
OWNED = "owned by the fault-handling work"


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[], Any]
    error: type
    match: str
    world: str = "fake"  # "fake", "none" or "ranks" (see the module docstring)
    owner: str = ""  # set while the row still fails and another piece of work owns the fix


# --------------------------------------------------------------------------- models and helpers


class Scalar(nn.Module):
    """A model with a 0-d parameter."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * self.scale


class TwoArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.fc(x) + y


class Then(nn.Module):
    """A linear layer, then `fn`: one op under test."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x))


class DropoutAttention(nn.Module):
    def __init__(self, dropout_p: float = 0.1):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.dropout_p = dropout_p

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p)
        return y.transpose(1, 2).reshape(b, s, 8)


class InPlace(nn.Module):
    def __init__(self, what: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.what = what

    def forward(self, x):
        if self.what == "input":
            x.mul_(2)
        elif self.what == "view":  # a view of an intermediate, whose base later readers read
            y = self.fc(x) * 1
            y[:, :4].mul_(2)
            return y
        else:
            with torch.no_grad():
                self.fc.weight.add_(1)
        return self.fc(x)


class Broken(nn.Module):
    """A graph break in the middle of forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc1(x)
        torch._dynamo.graph_break()
        return self.fc2(y)


def _noop() -> None:
    return None


def _mlp(plan=zoo.MEGATRON_MLP, model=None, **kwargs) -> nn.Module:
    return hca.sharded(plan, **kwargs)(model if model is not None else zoo.MLP())


def _mesh_2d():
    return hca.init_mesh((2, 2), ("dp", "tp"))


def _on_2d(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` with a (2, 2) mesh current (the fake world has 4 ranks)."""
    return lambda: (_mesh_2d(), fn())[1]


def _compiled(module: nn.Module, *, options: dict | None = None, dynamic: bool | None = None):
    torch._dynamo.reset()
    return torch.compile(module, backend="hca", options=options, dynamic=dynamic)


def _backend(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn`, with the error the backend raised unwrapped from torch's BackendCompilerFailed."""

    def run():
        try:
            return fn()
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise e.inner_exception from None

    return run


def _train(make: Callable[[], nn.Module], x: torch.Tensor, **kwargs) -> Callable[[], Any]:
    """Compile the module `make()` returns, run one forward and backward on `x`."""
    return _backend(lambda: _compiled(make(), **kwargs)(x).sum().backward())


@contextlib.contextmanager
def _env(**values: str | None):
    """Environment variables set (a value) or removed (None) for the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _with_env(fn: Callable[[], Any], **values: str | None) -> Callable[[], Any]:
    def run():
        with _env(**values):
            return fn()

    return run


def _without_mesh(fn: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: (reset_current_mesh(), fn())[1]


def _dtensor_input(placements, mesh_fn=None) -> Callable[[], Any]:
    def run():
        mesh = hca.current_mesh()
        other = mesh_fn() if mesh_fn else mesh
        hca.init_mesh()  # the model's mesh stays the 1-D one
        x = torch.randn(8, 16)
        x = (
            DTensor.from_local(x, other, placements, run_check=False)
            if any(p.is_partial() for p in placements)
            else distribute_tensor(x, other, placements)
        )
        return _backend(lambda: _compiled(_mlp())(x))()

    return run


def _report_with_inner_dtensor():
    compiled = _compiled(_mlp(), options={"inner": "dtensor"})
    compiled(torch.randn(8, 16))
    timeline = hca.report(compiled).timeline
    return timeline() if callable(timeline) else timeline


def _report_after_other_backend():
    torch._dynamo.reset()
    compiled = torch.compile(_mlp(), backend="eager")
    compiled(torch.randn(8, 16))
    return hca.report(compiled)


def _deferred_mlp() -> nn.Module:
    return _mlp({}, grad_reduction="deferred")


# --------------------------------------------------------------------------- the rows


def _plans() -> list[Case]:
    P = hca.PlanError
    return [
        Case(
            "plan/plan-is-None",
            lambda: _mlp(None),
            P,
            r"hca\.sharded: the plan must map parameter-name patterns to placements, got NoneType",
        ),
        Case(
            "plan/value-is-a-list",
            lambda: _mlp({"fc1.weight": [Shard(0)]}),
            P,
            r"parameter 'fc1\.weight' .*\[Shard\(dim=0\)\] is not a placement; write Shard\(d\), Replicate\(\), or a tuple",
        ),
        Case(
            "plan/empty-pattern",
            lambda: _mlp({"": Shard(0)}),
            P,
            r"plan pattern '' matches no parameter of MLP; its parameters are \['fc1\.bias'",
        ),
        Case(
            "plan/pattern-wrong-case",
            lambda: _mlp({"FC1.*": Shard(0)}),
            P,
            r"plan pattern 'FC1\.\*' matches no parameter of MLP; its parameters are \['fc1\.bias'",
        ),
        Case(
            "plan/tuple-holding-a-string",
            _on_2d(lambda: _mlp({"fc1.weight": (Shard(0), "R")})),
            P,
            r"parameter 'fc1\.weight' .*is not a placement; write Shard\(d\), Replicate\(\), or a tuple of them, one per mesh dimension",
        ),
        Case(
            "plan/shard-a-0d-parameter",
            lambda: _mlp({"scale": Shard(0)}, model=Scalar()),
            hca.PlacementError,
            r"parameter 'scale' .*Shard\(0\) on a tensor of shape \(\).*nothing to shard: use Replicate\(\)",
        ),
        Case(
            "plan/fewer-rows-than-ranks",
            lambda: _mlp({"fc2.bias": Shard(0)}, model=zoo.MLP(dim=2)),
            hca.PlacementError,
            r"parameter 'fc2\.bias' .*dimension 0 of size 2 cut by S\(0\) over the mesh \(4,\) leaves the rank at mesh coordinate \(2,\) without rows.*change the size or the mesh, or shard another dimension",
        ),
        Case(
            "plan/partial-inside-a-2d-layout",
            _on_2d(lambda: _mlp({"fc1.weight": (Replicate(), Partial())})),
            hca.PlacementError,
            r"parameter 'fc1\.weight' .*Partial\(\) is not a storage placement.*use Shard\(d\) or Replicate\(\)",
        ),
        Case(
            "plan/inputs-is-None",
            lambda: _mlp(inputs=None),
            P,
            r"hca\.sharded inputs: None is not a placement; write Shard\(d\), Replicate\(\)",
        ),
        Case(
            "plan/inputs-list-holds-a-string",
            lambda: _mlp(inputs=[Shard(0), "x"]),
            P,
            r"hca\.sharded inputs\[1\]: 'x' is not a placement; write Shard\(d\), Replicate\(\)",
        ),
        Case(
            "plan/inputs-one-placement-on-2d",
            _on_2d(lambda: _mlp({}, inputs=(Shard(0),))),
            hca.PlacementError,
            r"hca\.sharded inputs: 1 placement\(s\) \(Shard\(dim=0\),\) for a 2-D mesh \(2, 2\); give one placement per mesh dimension",
        ),
        Case(
            "plan/outputs-three-placements-on-2d",
            _on_2d(lambda: _mlp({}, outputs=(Shard(0), Replicate(), Replicate()))),
            hca.PlacementError,
            r"hca\.sharded outputs: 3 placement\(s\) .* for a 2-D mesh \(2, 2\); give one placement per mesh dimension",
        ),
        Case(
            "plan/outputs-is-None",
            lambda: _mlp(outputs=None),
            P,
            r"hca\.sharded outputs: None is not a placement; write Shard\(d\), Replicate\(\)",
        ),
        Case(
            "plan/grad_reduction-mean",
            lambda: _mlp(grad_reduction="mean"),
            P,
            r"grad_reduction role 'mean' for '\*'; use one of \('eager', 'deferred'\)",
        ),
        Case(
            "plan/grad_reduction-None",
            lambda: _mlp(grad_reduction=None),
            P,
            r"grad_reduction=None; give 'eager', 'deferred', or a mapping of parameter patterns to one of them",
        ),
        Case(
            "plan/grad_reduction-bad-role-in-mapping",
            lambda: _mlp(grad_reduction={"fc1.*": "lazy"}),
            P,
            r"grad_reduction role 'lazy' for 'fc1\.\*'; use one of \('eager', 'deferred'\)",
        ),
        Case(
            "plan/grad_reduction-pattern-matches-nothing",
            lambda: _mlp(grad_reduction={"fc9.*": "deferred"}),
            P,
            r"grad_reduction pattern 'fc9\.\*' matches no parameter; the parameters are \['fc1\.bias'",
        ),
        Case(
            "plan/grad_reduction-key-not-a-string",
            lambda: _mlp(grad_reduction={3: "eager"}),
            P,
            r"grad_reduction key 3 must be a glob string like 'fc1\.\*'",
        ),
        Case(
            "plan/loss_reduction-avg",
            lambda: _mlp(loss_reduction="avg"),
            P,
            r"loss_reduction='avg'; use 'sum' .* or 'mean'",
        ),
        Case(
            "plan/mesh-is-a-string",
            lambda: _mlp(mesh="cpu"),
            hca.MeshError,
            r"mesh='cpu' is not a DeviceMesh; build one with hca\.init_mesh",
        ),
    ]


def _meshes() -> list[Case]:
    M = hca.MeshError
    return [
        Case(
            "mesh/shape-0",
            lambda: hca.init_mesh(0),
            M,
            r"init_mesh: shape \(?0,?\)? must be positive integers, e\.g\. init_mesh\(\(2, 2\)\)",
        ),
        Case(
            "mesh/shape-negative",
            lambda: hca.init_mesh(-4),
            M,
            r"init_mesh: shape \(?-4,?\)? must be positive integers",
        ),
        Case(
            "mesh/shape-a-float",
            lambda: hca.init_mesh(4.0),
            M,
            r"init_mesh: shape \(?4\.0,?\)? must be positive integers",
        ),
        Case(
            "mesh/shape-a-bool",
            lambda: hca.init_mesh((True,)),
            M,
            r"init_mesh: shape \(True,\) must be positive integers",
        ),
        Case(
            "mesh/product-2-in-a-world-of-4",
            lambda: hca.init_mesh((2, 1)),
            M,
            r"mesh shape \(2, 1\) holds 2 ranks but the world has 4; pick a shape whose product is 4",
        ),
        Case(
            "mesh/names-one-string",
            lambda: hca.init_mesh((4,), "dp"),
            M,
            r"names 'dp' is one string; give a sequence with one name per mesh dimension, e\.g\. names=\('dp',\)",
        ),
        Case(
            "mesh/two-names-for-1d",
            lambda: hca.init_mesh((4,), ("dp", "tp")),
            M,
            r"2 names \('dp', 'tp'\) for a 1-D shape \(4,\); give one name per mesh dimension",
        ),
        Case(
            "mesh/device-cuda-without-cuda",
            lambda: hca.init_mesh(device_type="cuda"),
            M,
            r"device_type='cuda' but CUDA is not available.*use device_type='cpu'",
        ),
        Case(
            "mesh/device-an-int",
            lambda: hca.init_mesh(device_type=3),
            M,
            r"init_mesh: unknown device 3; use 'cpu' or 'cuda'",
        ),
        Case(
            "mesh/device-uppercase",
            lambda: hca.init_mesh(device_type="CPU"),
            M,
            r"init_mesh: unknown device 'CPU'; use 'cpu' or 'cuda'",
        ),
        Case(
            "mesh/timeout-negative",
            lambda: hca.init_mesh(timeout=-1),
            M,
            r"init_mesh\(timeout=\.\.\.\): -1 is not a positive finite number of seconds.*give e\.g\. 600",
        ),
        Case(
            "mesh/timeout-a-string",
            lambda: hca.init_mesh(timeout="60"),
            M,
            r"init_mesh\(timeout=\.\.\.\): '60' is not a positive finite number of seconds",
        ),
        Case(
            "mesh/timeout-nan",
            lambda: hca.init_mesh(timeout=NAN),
            M,
            r"init_mesh\(timeout=\.\.\.\): nan is not a positive finite number of seconds",
        ),
        Case(
            "mesh/env-has-only-RANK",
            _with_env(
                lambda: hca.init_mesh(device_type="cpu"), RANK="0", WORLD_SIZE=None, MASTER_ADDR=None, MASTER_PORT=None
            ),
            M,
            r"the environment lacks WORLD_SIZE, MASTER_ADDR, MASTER_PORT\. Put the work in a function and end the script with `hca\.run\(main, n\)`.*`torchrun --nproc-per-node n script\.py`.*`hca\.launch",
            "none",
        ),
    ]


def _options() -> list[Case]:
    O = hca.OptionsError

    def parse(options):
        return lambda: Options.parse(options)

    def number(key, value, fix=""):
        shown = re.escape(repr(value))
        return Case(
            f"options/{key}-{value}",
            parse({key: value}),
            O,
            rf"backend 'hca': options\['{key}'\] must be a (finite )?number( >= 0)?, got {shown}{fix}",
            "none",
        )

    return [
        number("memory_weight", NAN),
        number("memory_weight", -1e-9),
        number("memory_budget", INF, "; leave it out or give None for no bound"),
        number("memory_budget", "1GB"),
        number("memory_budget", True),
        number("solver_time_limit_s", NAN),
        number("solver_time_limit_s", -1),
        number("bucket_cap_mb", "1"),
        number("bucket_cap_mb", INF, "; leave it out or give None for no bound"),
        number("max_in_flight_mb", -64),
        number("max_in_flight_mb", NAN),
        Case(
            "options/rank_rewrites-a-string",
            parse({"rank_rewrites": "no"}),
            O,
            r"options\['rank_rewrites'\] must be a bool, got 'no'",
            "none",
        ),
        Case("options/check-an-int", parse({"check": 1}), O, r"options\['check'\] must be a bool, got 1", "none"),
        Case(
            "options/input_check-all",
            parse({"input_check": "all"}),
            O,
            r"options\['input_check'\]='all'; use one of \('values', 'shapes', 'first'\)",
            "none",
        ),
        Case(
            "options/layout-None",
            parse({"layout": None}),
            O,
            r"options\['layout'\]=None; use one of \('solve', 'dtensor', 'tune', 'as_written'\)",
            "none",
        ),
        Case(
            "options/tune_rounds-zero",
            parse({"layout": "tune", "tune_rounds": 0}),
            O,
            r"options\['tune_rounds'\] must be an int >= 1, got 0",
            "none",
        ),
        Case(
            "options/tune_rounds-a-float",
            parse({"layout": "tune", "tune_rounds": 2.5}),
            O,
            r"options\['tune_rounds'\] must be an int >= 1, got 2.5",
            "none",
        ),
        Case(
            "options/tune-with-inner-dtensor",
            parse({"layout": "tune", "inner": "dtensor"}),
            O,
            r"layout='tune' times compiled programs, and inner='dtensor' compiles none; use inner='eager' or 'inductor'",
            "none",
        ),
        Case(
            "options/inner-uppercase",
            parse({"inner": "EAGER"}),
            O,
            r"options\['inner'\]='EAGER'; use one of \('eager', 'inductor', 'dtensor'\)",
            "none",
        ),
        Case(
            "options/mode-as-an-option",
            parse({"mode": "max-autotune"}),
            O,
            r"unknown option\(s\) \['mode'\]; the options are \['bucket_cap_mb'",
            "none",
        ),
        Case(
            "options/options-a-list",
            parse([("inner", "eager")]),
            O,
            r"options must be a dict, got list .*; write options=\{'inner': 'inductor'\}",
            "none",
        ),
        Case(
            "options/cost_model-unknown-field",
            parse({"cost_model": {"latency": 1e-6}}),
            O,
            r"options\['cost_model'\]: unknown field\(s\) \['latency'\]; the fields are \['alpha_s', 'bytes_per_s'",
            "none",
        ),
        Case(
            "options/cost_model-zero-bandwidth",
            parse({"cost_model": {"bytes_per_s": 0}}),
            O,
            r"options\['cost_model'\]\['bytes_per_s'\] = 0; give a (finite )?number > 0",
            "none",
        ),
        Case(
            "options/cost_model-negative-latency",
            parse({"cost_model": {"alpha_s": -1}}),
            O,
            r"options\['cost_model'\]\['alpha_s'\] = -1; give a (finite )?number >= 0",
            "none",
        ),
        Case(
            "options/cost_model-nan-compute",
            parse({"cost_model": {"flops_per_s": NAN}}),
            O,
            r"options\['cost_model'\]\['flops_per_s'\] = nan; give a finite number > 0",
            "none",
        ),
        Case(
            "options/cost_model-inf-launch",
            parse({"cost_model": {"launch_s": INF}}),
            O,
            r"options\['cost_model'\]\['launch_s'\] = inf; give a finite number >= 0",
            "none",
        ),
        Case(
            "options/cost_model-a-string-value",
            parse({"cost_model": {"launch_s": "fast"}}),
            O,
            r"options\['cost_model'\]\['launch_s'\] = 'fast'; give a (finite )?number >= 0",
            "none",
        ),
        Case(
            "options/cost_model-a-list",
            parse({"cost_model": [("launch_s", 1e-5)]}),
            O,
            r"options\['cost_model'\] must be a dict of CostModel fields, got \[\('launch_s'",
            "none",
        ),
        Case(
            "options/debug_dir-a-list",
            parse({"debug_dir": ["out"]}),
            O,
            r"options\['debug_dir'\] must be a directory path, got \['out'\]",
            "none",
        ),
        Case(
            "options/nan-through-torch.compile",
            _backend(lambda: _compiled(_mlp(), options={"memory_weight": NAN})(torch.randn(8, 16))),
            O,
            r"backend 'hca': options\['memory_weight'\] must be a finite number, got nan",
        ),
        Case(
            "options/bool-option-through-torch.compile",
            _backend(lambda: _compiled(_mlp(), options={"schedule": "off"})(torch.randn(8, 16))),
            O,
            r"backend 'hca': options\['schedule'\] must be a bool, got 'off'",
        ),
    ]


def _inputs() -> list[Case]:
    PE = hca.PlacementError
    x = lambda *shape, **kw: torch.randn(*shape, **kw)  # noqa: E731
    return [
        Case(
            "input/shard-dim-past-rank-compiled",
            _backend(lambda: _compiled(_mlp(inputs=Shard(2)))(x(8, 16))),
            PE,
            r"forward argument 0: inputs placement Shard\(2\) on a tensor of shape \(8, 16\); change `inputs=` in hca\.sharded",
        ),
        Case(
            "input/negative-shard-dim-past-rank",
            _backend(lambda: _compiled(_mlp(inputs=Shard(-3)))(x(8, 16))),
            PE,
            r"forward argument 0: inputs placement Shard\(-3\) on a tensor of shape \(8, 16\); change `inputs=`",
        ),
        Case(
            "input/0d-tensor-for-shard",
            _backend(lambda: _compiled(_mlp(inputs=Shard(0)))(torch.tensor(1.0))),
            PE,
            r"forward argument 0: inputs placement Shard\(0\) on a tensor of shape \(\); change `inputs=`",
        ),
        Case(
            "input/second-argument-lacks-the-dim",
            _backend(lambda: _compiled(_mlp({}, model=TwoArgs(), inputs=[Shard(0), Shard(1)]))(x(8, 8), x(8))),
            PE,
            r"forward argument 1: inputs placement Shard\(1\) on a tensor of shape \(8,\); change `inputs=`",
        ),
        Case(
            "input/meta-device-compiled",
            _backend(lambda: _compiled(_mlp())(x(8, 16, device="meta"))),
            PE,
            r"forward argument 0: a tensor on device 'meta' for a mesh of 'cpu' devices.*move it with \.to\('cpu'\)",
        ),
        Case(
            "input/meta-device-eager",
            lambda: _mlp()(x(8, 16, device="meta")),
            PE,
            r"forward argument 0: a tensor on device 'meta' for a mesh of 'cpu' devices.*move it with \.to\('cpu'\)",
        ),
        Case(
            "input/dtensor-on-another-mesh-compiled",
            _dtensor_input((Replicate(), Replicate()), _mesh_2d),
            PE,
            r"forward argument 0: a DTensor on DeviceMesh\(\(dp=2, tp=2\).*not on the module's mesh.*pass this rank's local piece \(x\.to_local\(\)\)",
        ),
        Case(
            "input/dtensor-on-another-mesh-eager",
            lambda: (
                m := _mlp(),
                _mesh_2d(),
                m(distribute_tensor(x(8, 16), hca.current_mesh(), (Replicate(), Replicate()))),
            )[2],
            PE,
            r"forward argument 0: a DTensor on DeviceMesh\(\(dp=2, tp=2\).*not on the module's mesh.*pass this rank's local piece",
        ),
        Case(
            "input/partial-dtensor",
            _dtensor_input((Partial(),)),
            PE,
            r"forward argument 0: a DTensor with placements \(Partial\(sum\),\); a Partial\(\) value cannot enter.*redistribute",
        ),
        Case(
            "input/wrong-feature-size-compiled",
            _backend(lambda: _compiled(_mlp())(x(8, 17))),
            hca.HCAError,
            r"forward argument 0 .*\(8, 17\).*",
            owner=OWNED,
        ),
        Case(
            "input/wrong-dtype-compiled",
            _backend(lambda: _compiled(_mlp())(x(8, 16, dtype=torch.float64))),
            hca.HCAError,
            r"forward argument 0 .*float64.*",
            owner=OWNED,
        ),
        Case(
            "input/1d-for-a-2d-model-compiled",
            _backend(lambda: _compiled(_mlp(inputs=Shard(0)))(x(16))),
            hca.HCAError,
            r"forward argument 0 .*\(16,\).*",
            owner=OWNED,
        ),
        Case(
            "input/list-instead-of-tensor-compiled",
            _backend(lambda: _compiled(_mlp())([x(8, 16)])),
            hca.HCAError,
            r"forward argument 0 .*list.*",
            owner=OWNED,
        ),
        Case(
            "input/wrong-feature-size-eager",
            lambda: _mlp()(x(8, 17)),
            hca.HCAError,
            r"forward argument 0 .*\(8, 17\).*",
            owner=OWNED,
        ),
    ]


def _ops() -> list[Case]:
    U = hca.UnsupportedError
    x = torch.randn(8, 8)
    return [
        Case(
            "op/sdpa-with-dropout",
            _train(lambda: _mlp({}, model=DropoutAttention()), torch.randn(2, 4, 8)),
            U,
            r"scaled_dot_product_attention with dropout_p=0\.1: attention dropout is not supported.*set the model's attention dropout to 0\.0",
        ),
        Case(
            "op/sdpa-with-dropout-eager",
            lambda: _mlp({}, model=DropoutAttention())(torch.randn(2, 4, 8)),
            U,
            r"scaled_dot_product_attention with dropout_p=0\.1: attention dropout is not supported, under any plan .*nor in "
            r"eager calls.*set the model's attention dropout to 0\.0",
        ),
        Case(
            "op/sdpa-on-a-2d-query",
            _train(lambda: _mlp({}, model=Then(lambda t: F.scaled_dot_product_attention(t, t, t))), x),
            U,
            r"scaled_dot_product_attention on a 2-D query; give \[\.\.\., L, E\] with a batch dim",
        ),
        Case(
            "op/one_hot-decomposes-to-an-op-without-rule",
            _train(
                lambda: _mlp({"fc.weight": Shard(0)}, model=Then(lambda t: F.one_hot(t.argmax(-1), 8).float() * t)), x
            ),
            U,
            r"DTensor has no sharding rule for aten\._assert_async\.msg, which its decomposition runs, in one_hot .*source: .*one_hot"
            r".*Write that line with other ops, compute it outside the compiled module.*options=\{'inner': 'dtensor'\}",
        ),
        Case(
            "op/cumprod-backward-mixes-tensors",
            _train(lambda: _mlp({"fc.weight": Shard(0)}, model=Then(lambda t: t.cumprod(0))), x),
            U,
            r"DTensor cannot mix plain tensors and DTensors in aten\.where\.self, which its backward runs, in \w+ \(cumprod, "
            r"source: .*cumprod.*\) with inputs laid out as \{.*\}.*Write that line with other ops",
        ),
        Case(
            "op/trace-backward-mixes-tensors",
            _train(lambda: _mlp({"fc.weight": Shard(0)}, model=Then(lambda t: torch.trace(t).view(1, 1) * t)), x),
            U,
            r"aten\.index_fill\.int_Tensor, which its backward runs, in \w+ \(trace, source: .*trace.*Write that line with other ops",
        ),
        Case(
            "op/in-place-update-of-an-input",
            _train(lambda: _mlp({}, model=InPlace("input"), inputs=Shard(0)), x),
            U,
            r"updates from_local, an argument, parameter or buffer of the graph, in place; write it out of place \(y = x \* 2, not x\.mul_\(2\)\)",
        ),
        Case(
            "op/in-place-update-of-a-parameter",
            _train(lambda: _mlp({}, model=InPlace("parameter")), x),
            U,
            r"add_ .*updates l_self_modules_fc_parameters_weight_, an argument, parameter or buffer of the graph, in place; write it out of place",
        ),
        Case(
            "op/in-place-update-of-a-view",
            _train(lambda: _mlp({}, model=InPlace("view"), inputs=Shard(0)), x),
            U,
            r"mul_ .*updates \w+ in place while it is a view of, or viewed by, another value; write it out of place",
        ),
        Case(
            "op/random-draw-from-a-dtensor",
            _train(lambda: _mlp({"fc.weight": Shard(0)}, model=Then(lambda t: t * torch.rand_like(t))), x),
            U,
            r"draws random numbers \(aten\.rand_like\.default\) from a value laid out over the mesh; source: .*rand_like.*only "
            r"F\.dropout / nn\.Dropout is placed so far: draw a plain tensor of the whole shape instead \(torch\.rand\(x\.shape\)",
        ),
        Case(
            "op/attention-under-dynamic-shapes",
            _backend(lambda: _compiled(_mlp({}, model=zoo.Attention(8, 2)), dynamic=True)(torch.randn(2, 4, 8))),
            U,
            r"with dynamic shapes failed .*compile with torch\.compile\(\.\.\., dynamic=False\) to recompile per shape",
        ),
    ]


def _auto_plans() -> list[Case]:
    P = hca.PlanError
    x = (torch.randn(8, 16),)
    return [
        Case(
            "hca.plan/not-a-module",
            lambda: hca.plan(lambda t: t, x),
            P,
            r"hca\.plan: expected an nn\.Module, got function",
        ),
        Case(
            "hca.plan/already-sharded",
            lambda: hca.plan(_mlp(), x),
            P,
            r"hca\.plan: this model is already sharded; pass the plain model",
        ),
        Case(
            "hca.plan/example_inputs-a-tensor",
            lambda: hca.plan(zoo.MLP(), x[0]),
            P,
            r"hca\.plan: example_inputs must be a tuple of forward's arguments, got Tensor; write \(x,\) for one argument",
        ),
        Case(
            "hca.plan/memory_budget-a-string",
            lambda: hca.plan(zoo.MLP(), x, memory_budget="1GB"),
            P,
            r"hca\.plan: memory_budget='1GB'; give bytes per rank as a finite number >= 0 \(e\.g\. 2e9 for 2 GB\), or None",
        ),
        Case(
            "hca.plan/memory_budget-nan",
            lambda: hca.plan(zoo.MLP(), x, memory_budget=NAN),
            P,
            r"hca\.plan: memory_budget=nan; give bytes per rank as a finite number >= 0",
        ),
        Case(
            "hca.plan/memory_budget-negative",
            lambda: hca.plan(zoo.MLP(), x, memory_budget=-1),
            P,
            r"hca\.plan: memory_budget=-1; give bytes per rank as a finite number >= 0",
        ),
        Case(
            "hca.plan/memory_budget-too-small",
            lambda: hca.plan(zoo.MLP(), x, memory_budget=1),
            P,
            r"no layout fits memory_budget=1 B per rank \(needs at least \d+ B\).*raise the budget or shard more",
        ),
        Case(
            "hca.plan/example-input-wrong-shape",
            lambda: hca.plan(zoo.MLP(), (torch.randn(8, 17),)),
            P,
            r"hca\.plan: MLP\.forward fails on example_inputs \(\(8, 17\) float32, .*\): RuntimeError\('a and b must have same "
            r"reduction dim.*give the arguments forward takes",
        ),
        Case(
            "hca.plan/bad-options",
            lambda: hca.plan(zoo.MLP(), x, options={"memory_weight": -1}),
            hca.OptionsError,
            r"options\['memory_weight'\] must be a number >= 0, got -1",
        ),
        Case(
            "hca.plan/mesh-a-string",
            lambda: hca.plan(zoo.MLP(), x, mesh="cpu"),
            hca.MeshError,
            r"mesh='cpu' is not a DeviceMesh; build one with hca\.init_mesh",
        ),
        Case(
            "hca.plan/graph-break",
            lambda: hca.plan(Broken(), (torch.randn(8, 8),)),
            P,
            r"hca\.plan: Dynamo split the model into \d+ graphs; plan needs one \(remove the graph breaks",
        ),
    ]


def _tools() -> list[Case]:
    H = hca.HCAError
    return [
        Case(
            "calibrate/no-process-group",
            lambda: hca.calibrate(),
            hca.MeshError,
            r"hca\.calibrate\(\): no process group; call hca\.init_mesh\(\) first",
            "none",
        ),
        Case("calibrate/repeats-0", lambda: hca.calibrate(0), H, r"hca\.calibrate: repeats=0; give a positive int"),
        Case(
            "calibrate/repeats-a-string",
            lambda: hca.calibrate("5"),
            H,
            r"hca\.calibrate: repeats='5'; give a positive int",
        ),
        Case(
            "calibrate/repeats-a-float",
            lambda: hca.calibrate(2.5),
            H,
            r"hca\.calibrate: repeats=2\.5; give a positive int",
        ),
        Case(
            "report/a-compiled-function",
            lambda: hca.report(torch.compile(lambda t: t, backend="hca")),
            H,
            r"hca\.report: expected the module torch\.compile returned, got function",
            "none",
        ),
        Case(
            "report/compiled-by-another-backend",
            _report_after_other_backend,
            H,
            r"hca\.report: no graph of this MLP was compiled with backend='hca'",
        ),
        Case(
            "report/timeline-with-inner-dtensor",
            _report_with_inner_dtensor,
            H,
            r"timeline\(\): no forward or backward graph was compiled \(options inner='dtensor'.*\); compile with inner='eager' or 'inductor'",
        ),
        Case(
            "reduce_gradients/not-a-module",
            lambda: hca.reduce_gradients(42),
            H,
            r"hca\.reduce_gradients: expected the sharded nn\.Module, got int",
        ),
        Case(
            "reduce_gradients/bucket_bytes-0",
            lambda: hca.reduce_gradients(_deferred_mlp(), 0),
            H,
            r"hca\.reduce_gradients: bucket_bytes=0; give a positive int",
        ),
        Case(
            "reduce_gradients/bucket_bytes-a-string",
            lambda: hca.reduce_gradients(_deferred_mlp(), "25MB"),
            H,
            r"hca\.reduce_gradients: bucket_bytes='25MB'; give a positive int",
        ),
    ]


def _launches() -> list[Case]:
    H = hca.HCAError
    timeout = r"is not a positive finite number of seconds.*give e\.g\. 600"
    return [
        Case(
            "launch/world_size-True",
            lambda: hca.LocalWorld(True),
            H,
            r"world_size must be a positive int, got True",
            "none",
        ),
        Case(
            "launch/LocalWorld-world_size-0",
            lambda: hca.LocalWorld(0),
            H,
            r"world_size must be a positive int, got 0",
            "none",
        ),
        Case(
            "launch/timeout_s-negative",
            lambda: hca.launch(_noop, 2, timeout_s=-1),
            H,
            rf"hca\.launch\(timeout_s=\.\.\.\): -1 {timeout}",
            "none",
        ),
        Case(
            "launch/timeout_s-a-string",
            lambda: hca.LocalWorld(2, timeout_s="60"),
            H,
            rf"hca\.LocalWorld\(timeout_s=\.\.\.\): '60' {timeout}",
            "none",
        ),
        Case(
            "launch/timeout_s-inf",
            lambda: hca.LocalWorld(2, timeout_s=INF),
            H,
            rf"hca\.LocalWorld\(timeout_s=\.\.\.\): inf {timeout}",
            "none",
        ),
        Case(
            "launch/run-world_size-0",
            _with_env(lambda: hca.run(_noop, 0), RANK=None),
            H,
            r"world_size must be a positive int, got 0",
            "none",
        ),
        Case(
            "launch/run-timeout_s-negative",
            _with_env(lambda: hca.run(_noop, 2, timeout_s=-5), RANK=None),
            H,
            rf"hca\.run\(timeout_s=\.\.\.\): -5 {timeout}",
            "none",
        ),
        Case(
            "launch/fn-not-callable",
            lambda: hca.launch("main", 2),
            H,
            r"hca\.launch: fn='main' is not callable",
            "none",
        ),
        Case(
            "launch/fn-a-lambda",
            lambda: hca.launch(lambda: 0, 2),
            H,
            r"hca\.launch: .*lambda.*module-level function",
            "none",
        ),
    ]


def _collectives() -> list[Case]:
    CE, ME = hca.CollectiveError, hca.MeshError
    x = torch.ones(8, 8)
    return [
        Case(
            "collectives/mesh_dim-unknown-name",
            lambda: C.all_reduce(x, "P", "R", mesh_dim="zz"),
            ME,
            r"mesh_dim='zz'.*",
        ),
        Case("collectives/mesh_dim-out-of-range", lambda: C.all_reduce(x, "P", "R", mesh_dim=5), ME, r"mesh_dim=5.*"),
        Case(
            "collectives/group-unknown-name",
            lambda: C.all_reduce(x, "P", "R", group="nonexistent"),
            ME,
            r"group='nonexistent'.*",
        ),
        Case("collectives/group-an-int", lambda: C.all_reduce(x, "P", "R", group=3), ME, r"group=3.*"),
        Case("collectives/input-a-list", lambda: C.all_reduce([1.0], "P", "R"), CE, r"\[1\.0\].*tensor"),
        Case(
            "collectives/all_gather-dim-past-rank",
            lambda: C.all_gather(x, "S(3)", "R"),
            CE,
            r"all_gather: dim 3 is out of range for a 2-d tensor \(got shape \(8, 8\)\)",
        ),
        Case(
            "collectives/all_gather-0d-shard",
            lambda: C.all_gather(torch.tensor(1.0), "S(0)", "R"),
            CE,
            r"all_gather: dim 0 is out of range for a 0-d tensor",
        ),
        Case(
            "collectives/all_to_all-dim-past-rank",
            lambda: C.all_to_all(x, "S(0)", "S(5)"),
            CE,
            r"all_to_all: dim 5 is out of range for a 2-d tensor",
        ),
        Case(
            "collectives/all_to_all-indivisible",
            lambda: C.all_to_all(torch.ones(6, 8), "S(1)", "S(0)"),
            CE,
            r"all_to_all: dim 0 of shape \(6, 8\) has size 6, which the 4 ranks cannot split evenly; pad it to a multiple of 4",
        ),
        Case(
            "collectives/reduce_scatter-dim-past-rank",
            lambda: C.reduce_scatter(x, "P", "S(2)"),
            CE,
            r"reduce_scatter: dim 2 is out of range for a 2-d tensor",
        ),
        Case(
            "collectives/broadcast-root-outside-group",
            lambda: C.broadcast(x, "V", "R", root=7),
            CE,
            r"broadcast: root 7 is not a rank of a group of 4; use 0\.\.3",
        ),
        Case(
            "collectives/broadcast-root-negative",
            lambda: C.broadcast(x, "V", "R", root=-1),
            CE,
            r"broadcast: root -1 is not a rank of a group of 4; use 0\.\.3",
        ),
        Case("collectives/broadcast-root-a-string", lambda: C.broadcast(x, "V", "R", root="0"), CE, r"root='0'.*"),
        Case(
            "collectives/ppermute-perm-repeats-a-rank",
            lambda: C.ppermute(x, "V", "V", perm=[0, 0, 1, 2]),
            CE,
            r"permute: perm \(0, 0, 1, 2\) is not a permutation of the 4 ranks 0\.\.3",
        ),
        Case(
            "collectives/ppermute-perm-too-short",
            lambda: C.ppermute(x, "V", "V", perm=[1, 0]),
            CE,
            r"permute: perm \(1, 0\) is not a permutation of the 4 ranks 0\.\.3",
        ),
        Case("collectives/ppermute-shift-a-string", lambda: C.ppermute(x, "V", "V", shift="1"), CE, r"shift='1'.*"),
        Case(
            "collectives/ppermute-both-shift-and-perm",
            lambda: C.ppermute(x, "V", "V", shift=1, perm=[1, 2, 3, 0]),
            CE,
            r"ppermute: give exactly one of shift= \(a ring shift\) or perm=",
        ),
        Case(
            "collectives/role-misspelt",
            lambda: C.all_reduce(x, "partial", "R"),
            hca.RoleError,
            r"hca\.collectives: 'partial' is not a role; write 'R', 'I', 'V', 'P', 'S\(d\)'",
        ),
        Case(
            "collectives/mesh_dim-without-a-mesh",
            _without_mesh(lambda: C.all_reduce(x, "P", "R", mesh_dim=0)),
            ME,
            r"mesh_dim=0 given but no mesh; call hca\.init_mesh\(\.\.\.\) first",
        ),
        Case(
            "collectives/no-process-group",
            lambda: C.all_reduce(x, "P", "R"),
            ME,
            r"hca\.collectives: no process group is initialized; run under torchrun or hca\.launch",
            "none",
        ),
    ]


def _in_tmp(fn: Callable[[str], Any]) -> Callable[[], Any]:
    """`fn(directory)` on a fresh temporary directory."""

    def run():
        with tempfile.TemporaryDirectory() as d:
            return fn(d)

    return run


def _linear_and_sgd():
    model = nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _file_in(d: str) -> str:
    path = os.path.join(d, "notes.txt")
    with open(path, "w") as f:
        f.write("not a checkpoint")
    return path


def _training_tools() -> list[Case]:
    K, O = hca.CheckpointError, hca.OptionsError
    lin = lambda: nn.Linear(4, 4)  # noqa: E731
    return [
        Case(
            "step/optimizer-not-an-optimizer",
            lambda: hca.step(42),
            O,
            r"hca\.step: expected a torch\.optim\.Optimizer, got int",
            "none",
        ),
        Case(
            "step/nonfinite-ignore",
            lambda: hca.step(_linear_and_sgd()[1], nonfinite="ignore"),
            O,
            r"hca\.step: nonfinite='ignore'; use one of \('raise', 'skip_step'\)",
            "none",
        ),
        Case(
            "save/keep-0",
            _in_tmp(lambda d: hca.save(lin(), None, d, keep=0)),
            K,
            r"hca\.save\('.*'\): keep=0; give how many versions to keep, an int >= 1",
            "none",
        ),
        Case(
            "save/extra-not-json",
            _in_tmp(lambda d: hca.save(lin(), None, d, extra={"when": object()})),
            K,
            r"hca\.save\('.*'\): extra must hold JSON values \(numbers, strings, lists, dicts\)",
            "none",
        ),
        Case(
            "save/path-is-a-file",
            _in_tmp(lambda d: hca.save(lin(), None, _file_in(d))),
            K,
            r"notes\.txt is a file; give hca\.save a directory",
            "none",
        ),
        Case(
            "load/no-such-directory",
            _in_tmp(lambda d: hca.load(lin(), None, os.path.join(d, "nope"))),
            K,
            r"hca\.load\('.*nope'\): no checkpoint at .*nope \(no such directory\); hca\.save\(model, optimizer, path\) writes one",
            "none",
        ),
        Case(
            "load/nothing-published",
            _in_tmp(lambda d: hca.load(lin(), None, d)),
            K,
            r"no published checkpoint in .* \(no LATEST file\); hca\.save publishes a checkpoint once every rank has written it",
            "none",
        ),
        Case(
            "load_full_state_dict/not-a-state-dict",
            lambda: hca.load_full_state_dict(lin(), 42),
            K,
            r"hca\.load_full_state_dict: expected a state dict \(name -> tensor\), got int",
            "none",
        ),
        Case(
            "load_full_state_dict/missing-key",
            lambda: hca.load_full_state_dict(lin(), {"weight": torch.zeros(4, 4)}),
            K,
            r"the state dict lacks \['bias'\] and has \[\] the model does not \(or pass strict=False\)",
            "none",
        ),
        Case(
            "load_full_state_dict/wrong-shape",
            lambda: hca.load_full_state_dict(lin(), {"weight": torch.zeros(4, 5), "bias": torch.zeros(4)}),
            K,
            r"'weight' has shape \(4, 5\) in the state dict; the model's full \(single-device\) shape is \(4, 4\)\. Give full tensors",
            "none",
        ),
        Case(
            "load_full_state_dict/no-such-file",
            _in_tmp(lambda d: hca.load_full_state_dict(lin(), os.path.join(d, "nope.pt"))),
            K,
            r"hca\.load_full_state_dict\('.*nope\.pt'\): cannot read it as a state dict: .*No such file",
            "none",
        ),
    ]


# ------------------------------------------------------------------ rows that need real ranks


def _on_rank(fn: Callable[[int], Any]) -> Callable[[], Any]:
    return lambda: fn(dist.get_rank())


def _ranks() -> list[Case]:
    CE = hca.CollectiveError
    return [
        Case(
            "ranks/all_reduce-different-sizes",
            _on_rank(lambda r: C.all_reduce(torch.ones(r + 1), "P", "R")),
            CE,
            r"the ranks of the world disagree on the collective they call: rank 0: .*\[1\].*rank 1: .*\[2\].*uneven last batch",
            "ranks",
        ),
        Case(
            "ranks/all_gather-different-dtypes",
            _on_rank(lambda r: C.all_gather(torch.ones(2, dtype=(torch.float32, torch.float64)[r]), "S(0)", "R")),
            CE,
            r"disagree on the collective they call: rank 0: .*float32.*rank 1: .*float64",
            "ranks",
        ),
        Case(
            "ranks/different-ops",
            _on_rank(lambda r: (C.all_reduce, C.reduce_scatter)[r](torch.ones(4), "P", ("R", "S(0)")[r])),
            CE,
            r"disagree on the collective they call: rank 0: .*all_reduce.*rank 1: .*reduce_scatter",
            "ranks",
        ),
        Case(
            "ranks/dropout-with-generators-seeded-apart",
            _on_rank(
                lambda r: (
                    torch.manual_seed(r),
                    _train(lambda: _mlp({}, model=Then(nn.Dropout(0.5))), torch.ones(8, 8))(),
                )
            ),
            hca.CheckError,
            r"the program draws random numbers \(.*bernoulli.*\) and rank 0's default random number generator "
            r"differs from rank 1's.*Seed every rank the same before the first step \(torch\.manual_seed\(seed\) with one seed on "
            r"every rank\)",
            "ranks",
        ),
        Case(
            "ranks/different-plans",
            _on_rank(lambda r: hca.sharded({"fc1.weight": Shard(r)})(zoo.MLP())),
            hca.PlanError,
            r"rank \d and rank \d were given different plans or models; the first difference: .*fc1\.weight.*Give every rank the same model, plan and mesh",
            "ranks",
        ),
    ]


def run_on_ranks(ids: list[str]) -> list[tuple[str, str, str]]:
    """On each rank: every row of `ids` (in order), as (id, exception type or "", message)."""
    hca.init_mesh()
    by_id = {c.id: c for c in CASES}
    out = []
    for case_id in ids:
        try:
            by_id[case_id].call()
            out.append((case_id, "", ""))
        except Exception as e:  # noqa: BLE001 - the row says what it should have been
            out.append((case_id, type(e).__name__, str(e)))
    return out


CASES: list[Case] = [
    *_plans(),
    *_meshes(),
    *_options(),
    *_inputs(),
    *_ops(),
    *_auto_plans(),
    *_tools(),
    *_launches(),
    *_collectives(),
    *_training_tools(),
    *_ranks(),
]
assert len({c.id for c in CASES}) == len(CASES), "row ids must be distinct"


# ------------------------------------------------------------------ the census for docs/reliability.md


def outcome(case: Case, type_name: str, message: str) -> str:
    """good / poor / silent for one row's result: the exception's type name ("" if none) and message."""
    if not type_name:
        return "silent"
    cls = getattr(hca, type_name, None)
    ok_type = isinstance(cls, type) and issubclass(cls, case.error)
    return "good" if ok_type and re.search(case.match, message) else "poor"


def _census() -> None:  # pragma: no cover - a script
    import collections
    import signal
    import sys

    from torch.testing._internal.distributed.fake_pg import FakeStore

    counts: collections.Counter = collections.Counter()
    poor = []

    def alarm(*_):
        raise TimeoutError("hang")

    signal.signal(signal.SIGALRM, alarm)
    for case in CASES:
        if case.world == "ranks":
            continue
        if case.world == "fake":
            torch._dynamo.reset()
            reset_current_mesh()
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
            hca.init_mesh()
        signal.alarm(60)
        try:
            case.call()
            kind = "silent"
        except TimeoutError:
            kind = "hang"
        except Exception as e:  # noqa: BLE001
            e = getattr(e, "inner_exception", None) or e  # the census runs rows of any checkout: unwrap here too
            kind = outcome(case, type(e).__name__, str(e))
            if kind == "poor":
                poor.append(f"{case.id}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        finally:
            signal.alarm(0)
            if dist.is_initialized():
                dist.destroy_process_group()
            reset_current_mesh()
        counts[kind] += 1
        if kind == "silent":
            poor.append(f"{case.id}: no error")
    ranks = [c for c in CASES if c.world == "ranks"]
    for case in ranks:  # one world each: a gloo abort or a hang takes its world down
        try:
            with hca.LocalWorld(2, timeout_s=30) as world:
                results = world.run(run_on_ranks, [case.id], timeout_s=60)
            ((_, name, message),) = results[0]
            kind = outcome(case, name, message)
        except hca.RankError as e:
            kind = "hang" if "timeout" in e.kind else "abort" if "exit" in e.kind or "signal" in e.kind else "poor"
        counts[kind] += 1
        if kind != "good":
            poor.append(f"{case.id}: {kind}")
    print(dict(counts), f"of {len(CASES)}", file=sys.stderr)
    print("\n".join(poor))


if __name__ == "__main__":
    _census()
