"""Every private torch API torch_hca uses, wrapped here and nowhere else.

Each wrapper is tested in tests/test_torch_private.py, so a torch upgrade
that moves one fails there first, with the name of what moved.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx


def graph_arg_example(placeholder: fx.Node) -> Any:
    """The real value Dynamo bound to a placeholder (its ``meta["grapharg"]``), or None: how the
    backend names the parameters a graph reads."""
    grapharg = placeholder.meta.get("grapharg")
    if grapharg is None:
        return None
    try:
        return grapharg.example
    except Exception:  # erased, or a weakref that expired: no name, not an error
        return None


def process_group(group_name: str):
    """The `ProcessGroup` a `_c10d_functional` op names (its group argument is a name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_size(group_name: str) -> int:
    """Size of the process group a `_c10d_functional` op names."""
    return process_group(group_name).size()


def group_rank(group_name: str) -> int:
    """This process's rank in the group a `_c10d_functional` op names: its coordinate along that group."""
    return process_group(group_name).rank()


def group_backend(group_name: str) -> str:
    """The backend string of the process group a `_c10d_functional` op names ("gloo", "nccl",
    or "cpu:gloo,cuda:nccl" for a group with one per device type)."""
    return str(torch.distributed.get_backend(process_group(group_name)))


def default_store():
    """The default process group's rendezvous store: compile-time agreement between ranks goes
    through it, so it never interleaves with the collectives the ranks' programs issue."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def graph_arg_source(placeholder: fx.Node) -> str:
    """Where Dynamo took a graph input from (``L['args'][0]``, ``L['self']._buffers['b']``), else its node name."""
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    name = getattr(source, "name", None)
    if callable(name):  # a method in some torch versions, a property in others
        name = name()
    return name if isinstance(name, str) else placeholder.name


def graph_arg_is_python_scalar(placeholder: fx.Node) -> bool:
    """Whether Dynamo passes a Python number the user gave as this graph input (a SymInt, or a float as a 0-d tensor)."""
    grapharg = placeholder.meta.get("grapharg")
    if grapharg is None or graph_arg_is_tensor_property(placeholder):
        return False
    return bool(getattr(grapharg, "pass_arg_as_tensor", False)) or not getattr(grapharg, "is_tensor", True)


def graph_arg_is_tensor_property(placeholder: fx.Node) -> bool:
    """Whether Dynamo passes a size, stride or storage offset of a tensor input as this graph
    input (a SymInt under dynamic shapes), not a value the user gave.

    A view's storage offset becomes one where it is not 0: ``x.chunk(n)[rank]`` is at offset
    0 on rank 0 only, so under dynamic shapes the ranks' graphs differ by that input alone.
    """
    from torch._dynamo.source import TensorPropertySource

    return isinstance(getattr(placeholder.meta.get("grapharg"), "source", None), TensorPropertySource)


@dataclass(frozen=True)
class RedistributionEvent:
    """DTensor moving one argument of an aten op to another placement on its own."""

    op: Any
    arg_index: int
    src: Any  # DTensorSpec
    dst: Any  # DTensorSpec


@contextlib.contextmanager
def record_implicit_redistributions() -> Iterator[list[RedistributionEvent]]:
    """Record every redistribution DTensor's op dispatcher performs by itself.

    DTensor has no public hook for this; `OpDispatcher.redistribute_local_args`
    is the single place it happens, so it is wrapped for the duration.
    """
    from torch.distributed.tensor._dispatch import OpDispatcher, DTensorSpec

    events: list[RedistributionEvent] = []
    original = OpDispatcher.__dict__["redistribute_local_args"]
    inner = original.__func__ if isinstance(original, staticmethod) else original

    def recording(op_info, suggested_input_schema, *args, **kwargs):
        # DTensor flattens the arguments only for ops with tensor-list arguments
        # (args_tree_spec set); otherwise both lists are indexed as they are.
        schema = suggested_input_schema.args_schema
        flat = getattr(op_info, "args_tree_spec", None) is not None
        targets = torch.utils._pytree.tree_leaves(schema) if flat else list(schema)
        for i, src in enumerate(op_info.flat_args_schema):
            if (
                isinstance(src, DTensorSpec)
                and i < len(targets)
                and isinstance(targets[i], DTensorSpec)
                and src != targets[i]
            ):
                events.append(RedistributionEvent(suggested_input_schema.op, i, src, targets[i]))
        return inner(op_info, suggested_input_schema, *args, **kwargs)

    OpDispatcher.redistribute_local_args = staticmethod(recording)
    try:
        yield events
    finally:
        OpDispatcher.redistribute_local_args = original


def copy_graph_module(gm):
    """A deep copy of `gm` while AOTAutograd's fake mode is active: its tensor constants are real,
    and copying them under a FakeTensorMode fails ("set the storage of a meta tensor")."""
    import copy

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return copy.deepcopy(gm)


@contextlib.contextmanager
def fake_dtensor_work(values):
    """Run DTensor on a traced graph's fake `values`: under their FakeTensorMode (if any), and
    forgetting on exit what DTensor's sharding cache learned meanwhile.

    The cache keeps state, not only placements: a vocabulary-sharded embedding's
    `_MaskPartial` keeps the fake mask a probe made, and a later eager embedding of the
    same shapes trips on it ("Please convert all Tensors to FakeTensors first").
    """
    mode = fake_mode_of(values)
    try:
        with mode if mode is not None else contextlib.nullcontext():
            yield
    finally:
        clear_dtensor_sharding_cache()


def fake_mode_of(values):
    """The FakeTensorMode that made these fake values (DTensors: their local part), if any."""
    from torch._subclasses.fake_tensor import FakeTensor

    for v in values:
        local = getattr(v, "_local_tensor", v)
        if isinstance(local, FakeTensor):
            return local.fake_mode
    return None


def inductor_waits_late():
    """Inductor with its "sink_waits" pass: each collective's wait moved to the first use of its
    result. Without it every wait followed its collective in `dp512`'s backward (no overlap at
    all: 46 ms a step against 38 ms with it, and DDP's 38)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(
        reorder_for_compute_comm_overlap=True, reorder_for_compute_comm_overlap_passes=["sink_waits"]
    )


def inductor_random_as_eager():
    """Inductor drawing random numbers through aten's own kernels (its ``fallback_random``).

    On CPU Inductor calls aten's ``bernoulli_`` anyway (its lowering falls back); on CUDA
    its decompositions replace it with Inductor's own generator: every rank would still
    draw the same numbers, but not those one device's eager program draws, which the
    refinement check compares against. Both the decomposition table AOTAutograd applies
    and Inductor's lowering read the flag. (No GPU here: the CUDA half is untested.)
    """
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True)


def no_donated_buffers():
    """AOTAutograd without "donated buffers" for the compile inside this context.

    AOTAutograd lets Inductor reuse a saved-for-backward tensor's memory once the
    backward is done reading it, when that tensor shares storage with no input or
    output; it does not check saved tensors against each other. Our partition can save
    a value and an alias of it (a ReLU's output for the weight gradient, and its
    detached alias for the mask): Inductor then wrote the mask's result into the
    buffer a later weight-gradient matmul still read, and gradients came out wrong
    with no error. The cost is a little memory Inductor may not reuse in backward.
    """
    return torch._functorch.config.patch(donated_buffer=False)


def dynamo_fallback_exceptions() -> tuple[type[BaseException], ...]:
    """The backend exceptions Dynamo answers with a graph break (a warning) instead of an error."""
    from torch._dynamo.exc import exceptions_allowed_to_be_fallback

    return tuple(exceptions_allowed_to_be_fallback)


def is_mask_partial(placement) -> bool:
    """DTensor's `_MaskPartial`: the vocabulary-sharded embedding's partial, which carries the
    mask of the indices it masked (mutable state shared by the placement objects)."""
    from torch.distributed.tensor.placement_types import _MaskPartial

    return isinstance(placement, _MaskPartial)


def mask_buffer_states(values) -> Callable[[], None]:
    """Snapshot the mask state of every `_MaskPartial` these DTensors carry; call the result
    to put it back.

    Reducing a `_MaskPartial` value consumes its mask. A pass that runs an op once only to
    see what DTensor would move, and then runs it again, must give the second run the mask.
    """
    states = []
    for v in values:
        for p in getattr(v, "placements", ()):
            if is_mask_partial(p):
                states.append((p.mask_buffer, p.mask_buffer.data, p.mask_buffer.refcount))

    def restore() -> None:
        for buffer, data, refcount in states:
            buffer.data, buffer.refcount = data, refcount

    return restore


def redistribute_to_partial(x, placements):
    """`x.redistribute(...)` allowing a move to Partial (R -> P, no communication).

    DTensor does such moves inside its ops but refuses them in the public
    `redistribute`; the layout pass needs them explicit, so this calls the
    same autograd function `redistribute` calls, with the same dtype options.
    """
    from torch.distributed.tensor._redistribute import Redistribute

    dtype = x._local_tensor.dtype
    config = {"op_dtype": dtype, "out_dtype": dtype, "backward_options": {"op_dtype": dtype, "out_dtype": dtype}}
    return Redistribute.apply(x, x.device_mesh, tuple(placements), False, config)


def clear_dtensor_sharding_cache() -> None:
    """Forget DTensor's cached sharding decisions (Python and C++ fast path).

    Its caches key on specs whose meshes compare equal across process groups:
    after a process group is destroyed and made again, a cached decision would
    hand back the old (dead) mesh object.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def group_members(group_name: str) -> list[int]:
    """Global ranks of the process group a `_c10d_functional` op names."""
    return torch.distributed.get_process_group_ranks(process_group(group_name))


@dataclass(frozen=True)
class ProfiledEvent:
    """One event of a finished profile: an op and its arguments, or a memory event."""

    name: str
    start_ns: int
    shapes: tuple  # per argument: a shape, or for a tensor list a list of shapes
    dtypes: tuple  # per argument: the C++ scalar type name; "TensorList" for a tensor list
    nbytes: int  # "[memory]" events: bytes allocated (negative: freed); 0 otherwise
    on_cpu: bool


def profiled_events(prof) -> list[ProfiledEvent]:
    """Every event a finished `torch.profiler.profile` recorded, tensor-list shapes included.

    The public ``prof.events()`` records a tensor-list argument (what the c10d
    ops take) as shape ``[]`` and folds memory events into the ops around them;
    the kineto results behind it keep both.
    """
    from torch.autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        memory = e.name() == "[memory]"
        out.append(
            ProfiledEvent(
                e.name(),
                e.start_ns(),
                tuple(e.structured_input_shapes()),
                tuple(e.dtypes()),
                e.nbytes() if memory else 0,
                e.device_type() == DeviceType.CPU,
            )
        )
    return out


def ddp_bucket_bytes(ddp) -> int:
    """Bytes of a `DistributedDataParallel` module's gradient buckets (they live across steps)."""
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(s) for s in str(sizes).split(",") if s.strip())


def structured_trace_enabled() -> bool:
    """Whether torch's structured trace (``TORCH_TRACE=dir``, read by tlparse) is recording.

    The same test `torch._logging.trace_structured` makes first: its log has a
    handler only while a trace directory is set.
    """
    from torch._logging._internal import trace_log

    return bool(trace_log.handlers)


def trace_artifact(name: str, encoding: str, payload: Callable[[], str]) -> None:
    """Record one named artifact (``encoding`` "string" or "json") in torch's structured trace.

    tlparse lists it under the compile it belongs to (Dynamo's frame id, when
    called inside a compile) as ``{name}``; ``payload`` runs only if the trace records.
    """
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=payload,
        expect_trace_id=False,
    )


@contextlib.contextmanager
def quiet_cpu_alltoall_fallback() -> Iterator[None]:
    """Skip DTensor's "CPU process group does not support alltoall yet" warning for the duration.

    DTensor logs it through `torch._logging.warning_once`, cached per message:
    filtering the log record would still use up the one warning, and a program
    that does move Shard(i) -> Shard(j) on gloo would then never say so. The
    call is skipped instead, so the cache stays untouched.
    """
    from torch.distributed.tensor import _collective_utils

    original = _collective_utils.warning_once

    def quiet(logger, message, *args, **kwargs):
        if "does not support alltoall" not in str(message):
            original(logger, message, *args, **kwargs)

    _collective_utils.warning_once = quiet
    try:
        yield
    finally:
        _collective_utils.warning_once = original


# The key under ``node.meta["custom"]`` that names a node's origin. AOTAutograd copies
# ``meta["custom"]`` from the node it is tracing to every node that node's forward makes
# (`torch.fx.proxy._COPY_META_FIELDS`), and from a forward node to the backward nodes of
# the same autograd node (`copy_fwd_metadata_to_bw_nodes`, matched by ``seq_nr``).
_ORIGIN = "hca_origin"


def set_origin(node: fx.Node, origin: str) -> None:
    """Name `origin` (a node of the DTensor program) as where `node` and what it traces to came from."""
    custom = dict(node.meta.get("custom") or {})
    custom[_ORIGIN] = origin
    node.meta["custom"] = custom


def origin_of(node: fx.Node) -> str | None:
    """The DTensor program node `node` was traced from (forward) or differentiates (backward)."""
    custom = node.meta.get("custom")
    return custom.get(_ORIGIN) if isinstance(custom, dict) else None


def cpu_flash_attention(q, k, v, mask, causal: bool, scale: float):
    """(output, logsumexp) of the fused CPU kernel `F.scaled_dot_product_attention` runs on one
    CPU (``aten._scaled_dot_product_flash_attention_for_cpu``): q, k, v [b, h, L, E] with equal
    heads, `mask` additive (float) or None, no dropout."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def cpu_flash_attention_backward(grad, q, k, v, out, logsumexp, mask, causal: bool, scale: float):
    """(dq, dk, dv) of `cpu_flash_attention`, from its output and logsumexp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad, q, k, v, out, logsumexp, 0.0, causal, attn_mask=mask, scale=scale
    )


def size_hint(value) -> int:
    """A size as this compile's example has it: a symbolic size (uneven shares trace the batch
    symbolic) read as its hint, without a guard; a plain int as itself."""
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

    return int(guarding_hint_or_throw(value)) if isinstance(value, torch.SymInt) else int(value)


def storage_key(t: torch.Tensor):
    """A key equal for tensors that share storage (views of one another), fake tensors included.

    DTensor computes its local results below autograd, where views do not record `_base`, so the
    storage is the one sign of an alias there.
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


@functools.cache
def _plan_mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape), _init_backend=False, _rank=0)


def redistribute_plan(mesh_shape, shape, src, dst) -> list[tuple[int, Any, Any]]:
    """DTensor's own steps moving a value of `shape` from placements `src` to `dst` on a mesh of
    `mesh_shape`, in the order it runs them: (mesh dim, from, to). Its planner is private; a mesh
    without process groups is enough to ask it (the plan reads only shapes and placements)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), torch.float32)
    spec = lambda placements: DTensorSpec(_plan_mesh(tuple(mesh_shape)), tuple(placements), meta)  # noqa: E731
    return [(i.mesh_dim, *i.src_dst_placements) for i in _gen_transform_infos(spec(src), spec(dst))]
