"""The logical program: what Dynamo traces when a sharded module is compiled.

Under ``torch.compile`` the sharded ``forward`` runs the user's code over
plain tensors of *global* shape (the single-device program f of docs/theory.md,
section 1), so nothing of DTensor runs while Dynamo traces: factories, masks,
``arange``, indexing and in-place ops trace exactly as on one device. Each
value that comes from storage enters f through one marker op that records
its layout; each result leaves through one that records the layout the
caller receives:

    hca::enter(local, layout, global_shape, mesh)  local piece -> logical value
    hca::leave(value, layout, mesh, grad_scale)    logical value -> local piece

The backend (`torch_hca.passes.lift`) turns the markers back into DTensors,
and the layout pass places every other value. Run eagerly (code between two
graphs of a graph break) the markers are exact too: ``enter`` gathers the
whole value on every rank and ``leave`` cuts this rank's piece, each the
other's transpose, so eager code between graphs computes f replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from torch_hca.errors import PlacementError
from torch_hca.spmd.placements import letter
from torch_hca.spmd.shares import read_share_text, share_text

Layout = tuple[Placement, ...]

# Custom ops cannot take a DeviceMesh: they name one by its index here.
_MESHES: list[DeviceMesh] = []


def mesh_id(mesh: DeviceMesh) -> int:
    for i, m in enumerate(_MESHES):
        if m is mesh:
            return i
    _MESHES.append(mesh)
    return len(_MESHES) - 1


def mesh_of(index: int) -> DeviceMesh:
    return _MESHES[index]


def encode(layout: Layout, ndim: int | None = None) -> str:
    """``(Shard(0), Replicate())`` -> ``"S0,R"``: a layout as a custom op argument (an uneven
    shard's shares after a slash: ``"S0/1:3,R"``); with `ndim`, negative shard dims counted
    from the end of a tensor of that many dims."""
    return ",".join(
        (f"S{p.dim % ndim}" if ndim and isinstance(p, Shard) else letter(p)) + share_text(p) for p in layout
    )


def decode(text: str) -> Layout:
    """The layout DTensor runs: an uneven shard as the even ``Shard`` of its rank's own rows
    (`decode_shares` keeps the shares)."""
    letters = [read_share_text(t)[0] for t in text.split(",")]
    return tuple(Shard(int(t[1:])) if t.startswith("S") else Partial() if t == "P" else Replicate() for t in letters)


def decode_shares(text: str) -> tuple[tuple[int, ...] | None, ...]:
    """Per mesh dim, the shares of an uneven shard in marker text (None: even or not a shard)."""
    return tuple(read_share_text(t)[1] for t in text.split(","))


def contiguous_stride(shape) -> tuple:
    """Row-major strides of `shape` (symbolic sizes allowed): what DTensor.from_local needs with a shape."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step = step * size
    return tuple(strides)


def check_input_layout(x: torch.Tensor, layout: Layout, what: str, mesh: DeviceMesh | None = None) -> None:
    """A forward argument fits its stated layout: on the mesh's device, with every dim its placements shard.

    (Whether its shape and dtype fit the model only the model can tell: as on one device.)
    """
    if mesh is not None and x.device.type != mesh.device_type:
        raise PlacementError(
            f"{what}: a tensor on device {x.device.type!r} for a mesh of {mesh.device_type!r} devices; each rank "
            f"passes its local piece on its own device: move it with .to({mesh.device_type!r})"
        )
    if isinstance(x, DTensor):
        if mesh is not None and x.device_mesh != mesh:
            raise PlacementError(
                f"{what}: a DTensor on {x.device_mesh}, not on the module's mesh {mesh}; pass this rank's "
                "local piece (x.to_local()) laid out as `inputs=` says, or a DTensor on the module's mesh"
            )
        if any(p.is_partial() for p in x.placements):
            raise PlacementError(
                f"{what}: a DTensor with placements {tuple(x.placements)}; a Partial() value cannot enter a "
                "sharded module: x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim) first"
            )
        return
    for p in layout:
        if isinstance(p, Shard) and not -x.dim() <= p.dim < x.dim():
            raise PlacementError(
                f"{what}: inputs placement Shard({p.dim}) on a tensor of shape {tuple(x.shape)}; "
                "change `inputs=` in hca.sharded"
            )


def local_shape(shape, layout: Layout, mesh_shape) -> list[int]:
    local = list(shape)
    for p, n in zip(layout, mesh_shape):
        if isinstance(p, Shard):
            local[p.dim] //= n
    return local


def global_shape(local, layout: Layout, mesh_shape) -> list[int]:
    shape = list(local)
    for p, n in zip(layout, mesh_shape):
        if isinstance(p, Shard):
            shape[p.dim] *= n
    return shape


# ----------------------------------------------------------------------------- the markers


@torch.library.custom_op("hca::enter", mutates_args=())
def enter(local: torch.Tensor, layout: str, shape: list[int], mesh: int) -> torch.Tensor:
    """The logical value whose local piece, laid out as `layout`, is `local` (eagerly: gathered)."""
    whole = DTensor.from_local(
        local, mesh_of(mesh), decode(layout), run_check=False, shape=torch.Size(shape), stride=contiguous_stride(shape)
    )
    return whole.full_tensor().clone()


@enter.register_fake
def _(local, layout, shape, mesh):
    return local.new_empty(shape)


@torch.library.custom_op("hca::leave", mutates_args=())
def leave(value: torch.Tensor, layout: str, mesh: int, grad_scale: float = 1.0) -> torch.Tensor:
    """This rank's piece of the logical `value` laid out as `layout` (eagerly: a local chunk).

    ``grad_scale`` multiplies the cotangent on the way back: 1/n turns the sum
    of n ranks' losses over their pieces into their mean (``loss_reduction``).
    """
    # src_data_rank=None: every rank cuts its own piece, no communication.
    return distribute_tensor(value.detach(), mesh_of(mesh), decode(layout), src_data_rank=None).to_local().clone()


@leave.register_fake
def _(value, layout, mesh, grad_scale=1.0):
    return value.new_empty(local_shape(value.shape, decode(layout), mesh_of(mesh).shape))


def _enter_backward(ctx, grad):
    return leave(grad, ctx.layout, ctx.mesh), None, None, None


def _enter_context(ctx, inputs, output):
    ctx.layout, ctx.mesh = inputs[1], inputs[3]


def _leave_backward(ctx, grad):
    whole = enter(grad, ctx.layout, ctx.shape, ctx.mesh)
    return (whole if ctx.grad_scale == 1.0 else whole * ctx.grad_scale), None, None, None


def _leave_context(ctx, inputs, output):
    ctx.layout, ctx.mesh, ctx.shape, ctx.grad_scale = inputs[1], inputs[2], list(inputs[0].shape), inputs[3]


class ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the cotangent by a constant (``loss_reduction="mean"``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


enter.register_autograd(_enter_backward, setup_context=_enter_context)
leave.register_autograd(_leave_backward, setup_context=_leave_context)

ENTER = torch.ops.hca.enter.default
LEAVE = torch.ops.hca.leave.default


# ----------------------------------------------------------------------------- the sharded forward, traced logically


def enter_local(x: Any, layout: Layout | None, mesh: DeviceMesh, index: int, what: str) -> Any:
    """A forward argument (this rank's piece) or a DTensor parameter as its logical value."""
    if not isinstance(x, torch.Tensor) or layout is None:
        return x
    check_input_layout(x, layout, what, mesh)
    if isinstance(x, DTensor):
        return enter(x.to_local(), encode(tuple(x.placements)), list(x.shape), index)
    return enter(x, encode(layout, x.dim()), global_shape(x.shape, layout, mesh.shape), index)


class Holder(torch.nn.Module):
    """Calls the user's own ``forward`` on `inner`: what `call_logically` reparametrizes.

    Kept in the sharded module's ``__dict__`` (not as a submodule) so it adds
    no parameter names; calling ``forward`` directly avoids re-entering the
    sharded wrapper.
    """

    def __init__(self, inner: torch.nn.Module, forward):
        super().__init__()
        self.inner = inner
        self._user_forward = forward

    def forward(self, *args, **kwargs):
        return self._user_forward(self.inner, *args, **kwargs)


def call_logically(module: torch.nn.Module, spec, args: tuple, kwargs: dict) -> Any:
    """Run `forward` on the logical program: parameters, buffers and arguments as global tensors.

    Parameters enter once each (a tied parameter under all its names gets the
    same logical value); buffers are plain replicated tensors and stay
    themselves, so in-place updates (running statistics) reach them.
    """
    mesh, index = spec.mesh, spec.mesh_index  # registered before tracing: Dynamo defers list appends
    logical: dict[int, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in logical:
            logical[id(p)] = enter_local(p, (), mesh, index, f"parameter {name!r}") if isinstance(p, DTensor) else p
        values[name] = logical[id(p)]
    args = tuple(
        tree_map(lambda t, i=i: enter_local(t, spec.input_layout(i), mesh, index, f"forward argument {i}"), a)
        for i, a in enumerate(args)
    )
    kwargs = {
        k: tree_map(lambda t, k=k: enter_local(t, spec.input_layout(None), mesh, index, f"forward argument {k!r}"), v)
        for k, v in kwargs.items()
    }
    holder = module.__dict__["_hca_logical"]
    values = {f"inner.{name}": v for name, v in values.items()}
    out = torch.func.functional_call(holder, values, args, kwargs, tie_weights=False, strict=False)
    return tree_map(lambda t: leave_output(t, spec, index) if isinstance(t, torch.Tensor) else t, out)


def leave_output(t: torch.Tensor, spec, index: int) -> torch.Tensor:
    """This rank's piece of one result of the forward, laid out as ``outputs=`` says."""
    layout, scale = output_layout(t, spec.outputs, spec.grad_scale)
    return leave(t, encode(layout), index, scale)


def output_layout(t: torch.Tensor, outputs: Layout, grad_scale: float) -> tuple[Layout, float]:
    """How one result of the forward leaves: ``outputs=`` and its cotangent scale.

    A scalar (an HF model's ``loss`` beside its logits under ``outputs=Shard(0)``) has no dim to
    cut: every rank gets it whole, the loss of the global batch as one device computes it, and
    its cotangent is not scaled (each rank's backward of it is one device's backward). A result
    with dims but too few for the placement is a `PlacementError`.
    """
    cut = [p for p in outputs if isinstance(p, Shard)]
    if all(-t.dim() <= p.dim < t.dim() for p in cut):
        return tuple(outputs), grad_scale
    if t.dim() == 0:
        return tuple(Replicate() for _ in outputs), 1.0
    raise PlacementError(
        f"hca.sharded: outputs={tuple(outputs)} cuts dim {cut[0].dim} of a forward result of shape "
        f"{tuple(t.shape)}, which has {t.dim()} dims; give outputs= a placement this result can take "
        "(Replicate() returns it whole) or return the result with that dim"
    )
