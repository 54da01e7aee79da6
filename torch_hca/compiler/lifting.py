"""Lifting: the logical program becomes a DTensor program the layout solver can place.

Used by the lift pass (`torch_hca.passes.lift`) and by `hca.plan`.

Dynamo traced the sharded module over plain tensors of global shape
(`torch_hca.compiler.logical`). Here:

* ``hca::enter`` of a parameter becomes the parameter itself (a DTensor in its
  storage layout); of a forward argument, ``DTensor.from_local`` in the
  argument's stated layout;
* ``hca::leave`` becomes `dtensor_ops.to_output` in the result's layout, and
  any other result leaves replicated (the next graph of a graph break reads
  it whole);
* a plain tensor made in the graph (``arange``, a mask, ``torch.ones``, a
  buffer) stays plain while only plain tensors read it, and becomes a
  replicated DTensor where it meets a DTensor: every rank makes the same one;
* ``scaled_dot_product_attention`` becomes ``hca::attention`` (its own rule), ``F.embedding``
  `torch_hca.compiler.embedding.embedding` (a vocabulary-parallel read of a row-split table);
* ``F.dropout`` becomes `dtensor_ops.dropout`, which draws what one device
  draws; any other op that draws random numbers from a DTensor is refused
  (`torch_hca.compiler.randomness`), and the ops that draw are recorded;
* ops that return several tensors are split into one node per result
  (``split``/``chunk``/``unbind`` into slices of the input);
* an in-place update of an intermediate value becomes its out-of-place form,
  with later readers redirected (a move in front of it would otherwise update
  a copy); an in-place update of an input, a parameter or a view is refused;
* an op DTensor has no rule for runs replicated (`dtensor_ops.run_local`),
  listed in the report.

Every value is propagated replicated (DTensor's replicated rules always
apply), so the layout pass sees the whole program before it places anything.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_leaves

from torch_hca.compiler import attention, cross_entropy
from torch_hca.compiler.embedding import embedding
from torch_hca.compiler import dtensor_ops
from torch_hca.compiler.layout.probes import call_node
from torch_hca.compiler import randomness
from torch_hca.compiler.layout.candidates import op_name, source_line
from torch_hca._torch_private import fake_dtensor_work, storage_key
from torch_hca.errors import UnsupportedError
from torch_hca.compiler.logical import ENTER, LEAVE, decode, mesh_of

SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
LIFTED_OPS = {**dict.fromkeys(SDPA, attention.sdpa), F.embedding: embedding}  # ops given our own rule
PARTITIONS = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}
INPLACE_OPERATORS = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}


def _looks_inplace(node: fx.Node) -> bool:
    return (
        node.target in INPLACE_OPERATORS
        or bool(node.kwargs.get("inplace"))
        or op_name(node).endswith("_")
        and not op_name(node).startswith("_")
    )


def _replicated(v: DTensor) -> DTensor:
    full = (Replicate(),) * v.device_mesh.ndim
    return v if tuple(v.placements) == full else v.redistribute(v.device_mesh, full)


def lift(gm: fx.GraphModule) -> "Lifted | None":
    """Rewrite `gm` in place into a DTensor program; None if it holds no marker (nothing to lift)."""
    return lifted if (lifted := Lifted()).run(gm) else None


class Lifted:
    """What lifting decided: every rewrite, and the ops run replicated."""

    def __init__(self):
        self.decisions: list[str] = []
        self.run_replicated: list[str] = []
        self.draws: list[str] = []  # "node: aten op" of each random draw (torch_hca.compiler.randomness)
        self._drawn: list[str] = []  # the draws recorded while the current node lifts

    def run(self, gm: fx.GraphModule) -> bool:
        graph = gm.graph
        markers = [n for n in graph.nodes if n.target in (ENTER, LEAVE)]
        if not markers:
            return False  # per-rank code, or a replicated middle of a graph break
        attention.refuse_dropout(graph)  # under every plan, before anything runs
        self.mesh_index = (
            markers[0].args[3] if markers[0].target is ENTER else markers[0].args[2]
        )  # leave(value, layout, mesh, scale)
        self.mesh = mesh_of(self.mesh_index)
        self.split_tables = cross_entropy.split_table_rows(markers) if self.mesh.ndim == 1 else set()
        self.gm = gm
        self.env: dict[fx.Node, Any] = {}
        self.wrapped: dict[fx.Node, fx.Node] = {}
        self.erased: set[fx.Node] = set()
        placeholders = graph.find_nodes(op="placeholder")
        with fake_dtensor_work([n.meta.get("example_value") for n in placeholders]):
            for node in list(graph.nodes):
                if node in self.erased:  # a getitem replaced while splitting an op above
                    continue
                with randomness.recording_draws() as self._drawn:
                    self._lift(node)
                self.draws += [f"{node.name}: {op}" for op in dict.fromkeys(self._drawn)]
        return True  # no dead-code pass: in-place updates of buffers have no users and must stay

    # --------------------------------------------------------------------- one node

    def _lift(self, node: fx.Node) -> None:
        graph = self.gm.graph
        if node.op == "placeholder":
            v = node.meta.get("example_value")
            self.env[node] = _replicated(v) if isinstance(v, DTensor) else v
            return
        if node.op == "output":
            self._outputs(node)
            return
        if node.target is ENTER:
            self._enter(node)
            return
        if node.target is LEAVE:
            value, layout, _, *scale = node.args
            grad_scale = scale[0] if scale else node.kwargs.get("grad_scale", 1.0)
            self._as_dtensor(node, value)
            scaled = (grad_scale,) if grad_scale != 1.0 else ()  # the program shows only a scale it applies
            with graph.inserting_before(node):
                new = graph.call_function(dtensor_ops.to_output, (node.args[0], decode(layout), *scaled))
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            self.env[new] = dtensor_ops.to_output(self.env[new.args[0]], decode(layout), *scaled)
            return
        args, kwargs = self._values(node)
        if not any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
            self.env[node] = call_node(self.gm, node, args, kwargs)  # plain: every rank alike
            return
        for src in node.all_input_nodes:
            if isinstance(self.env.get(src), torch.Tensor) and not isinstance(self.env[src], DTensor):
                self._as_dtensor(node, src)
        if node.target is F.cross_entropy and self._cross_entropy(node):
            return
        node.target = LIFTED_OPS.get(node.target, node.target)
        if node.target in randomness.DROPOUT:
            self._dropout(node)
            return
        args, kwargs = self._values(node)
        before = len(self._drawn)  # what `run` records while this node lifts
        try:
            value = call_node(self.gm, node, args, kwargs)
        except UnsupportedError:
            raise
        except Exception as e:  # DTensor has no rule for it: run it whole on every rank
            self._run_replicated(
                node,
                f"DTensor has no rule for it ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
                if str(e)
                else f"DTensor has no rule for it ({type(e).__name__})",
            )
            return
        if drawn := self._drawn[before:]:
            raise UnsupportedError(
                f"lift: {node.name} ({op_name(node)}) draws random numbers ({', '.join(dict.fromkeys(drawn))}) from a "
                f"value laid out over the mesh; source: {source_line(node)}. Each rank would draw its own piece, not "
                "its piece of what one device draws, so only F.dropout / nn.Dropout is placed so far: draw a plain "
                "tensor of the whole shape instead (torch.rand(x.shape) * ..., every rank draws the same one), or "
                "draw outside the compiled module"
            )
        same = [a for a in node.all_input_nodes if self.env.get(a) is value and isinstance(value, DTensor)]
        if same and not _looks_inplace(node):  # returns its input (`.to` of the same dtype): an alias
            node.replace_all_uses_with(same[0])
            self.gm.graph.erase_node(node)
            return
        if same:
            value = self._functionalize(node, same[0])
        if isinstance(value, (tuple, list)) and any(isinstance(v, DTensor) for v in value):
            if op_name(node) in PARTITIONS:
                self._split_results(node, value)
            else:  # sort, max(dim), qr, multi-head attention...: the layout pass places one value per node
                self._run_replicated(node, f"it returns {len(value)} tensors")
            return
        self._set(node, value)

    def _dropout(self, node: fx.Node) -> None:
        """``F.dropout`` as `dtensor_ops.dropout` (in place made out of place)."""
        bound = inspect.signature(F.dropout).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        x, p, training, inplace = bound.args
        node.target, node.args, node.kwargs = dtensor_ops.dropout, (x, p, training), {}
        if inplace and isinstance(x, fx.Node):
            node.kwargs = {"inplace": True}
            self._set(node, self._functionalize(node, x))
            return
        args, kwargs = self._values(node)
        value = dtensor_ops.dropout(*args, **kwargs)
        if value is args[0]:  # not training, or p == 0: the input itself
            node.replace_all_uses_with(x)
            self.gm.graph.erase_node(node)
            return
        self._set(node, value)

    def _cross_entropy(self, node: fx.Node) -> bool:
        """The loss of logits whose classes may arrive split, as ops placed without gathering them."""
        logits = self.env.get(node.args[0] if node.args else node.kwargs.get("input"))
        if not (isinstance(logits, DTensor) and logits.ndim == 2 and logits.shape[1] in self.split_tables):
            return False
        if (new := cross_entropy.expand(self.gm.graph, node, self.mesh.size(0))) is None:
            return False
        self.decisions.append(f"{node.name}: cross-entropy over {logits.shape[1]} classes that may arrive split")
        for n in new:
            self._lift(n)
        return True

    def _set(self, node: fx.Node, value: Any) -> None:
        self.env[node] = value
        if isinstance(value, DTensor):
            node.meta["example_value"] = value

    def _values(self, node: fx.Node):
        return fx.node.map_arg((node.args, node.kwargs), lambda n: self.env[n])

    def _enter(self, node: fx.Node) -> None:
        graph = self.gm.graph
        src, layout, shape, _ = node.args
        placements = decode(layout)
        sizes = [self.env[s] if isinstance(s, fx.Node) else s for s in shape]  # symbolic under dynamic shapes
        if (
            src.op == "call_method"
            and src.target == "to_local"
            and isinstance(src.args[0].meta.get("example_value"), DTensor)
        ):
            param = src.args[0]  # a parameter: the DTensor itself, in its storage layout
            node.replace_all_uses_with(param)
            graph.erase_node(node)
            if not src.users:
                graph.erase_node(src)
            return
        with graph.inserting_before(node):
            new = graph.call_function(dtensor_ops.from_local, (src, self.mesh_index, placements, list(shape)))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        new.meta["example_value"] = dtensor_ops.from_local(self.env[src], self.mesh_index, placements, sizes)
        self.env[new] = _replicated(new.meta["example_value"])

    def _as_dtensor(self, user: fx.Node, src: fx.Node) -> None:
        """Read the plain value `src` as a replicated DTensor in `user` (one wrap per value)."""
        if isinstance(self.env.get(src), DTensor):
            return
        if src not in self.wrapped:
            graph = self.gm.graph
            with graph.inserting_after(src):
                self.wrapped[src] = graph.call_function(dtensor_ops.replicate, (src, self.mesh_index))
            self._set(self.wrapped[src], dtensor_ops.replicate(self.env[src], self.mesh_index))
        user.replace_input_with(src, self.wrapped[src])

    def _outputs(self, node: fx.Node) -> None:
        """Results that did not leave through hca::leave are read whole (a graph break's next graph)."""
        graph = self.gm.graph
        full = (Replicate(),) * self.mesh.ndim
        for src in node.all_input_nodes:
            if isinstance(self.env.get(src), DTensor):
                with graph.inserting_before(node):
                    new = graph.call_function(dtensor_ops.to_output, (src, full))
                node.replace_input_with(src, new)

    # --------------------------------------------------------------------- rewrites

    def _run_replicated(self, node: fx.Node, why: str, item: int | None = None) -> None:
        if node.op == "call_method":
            kind, target = "method", node.target
        elif node.op == "call_function":
            kind, target = "function", dtensor_ops.local_function(node.target)
        else:
            raise UnsupportedError(
                f"lift: cannot run {node.name} ({node.op} {node.target}) replicated; source: {source_line(node)}"
            )
        node.args = (kind, target, item, *node.args)
        node.target, node.op = dtensor_ops.run_local, "call_function"
        args, kwargs = self._values(node)
        value = dtensor_ops.run_local(*args, **kwargs)
        message = f"{node.name} ({target}) runs replicated: {why}"
        self.run_replicated.append(message)
        self.decisions.append(message)
        if isinstance(value, (tuple, list)) and item is None:
            self._split_results(node, value)
            return
        self._set(node, value)

    def _split_results(self, node: fx.Node, value) -> None:
        """One node per result: slices of the input for split/chunk/unbind, else one replicated run each."""
        graph = self.gm.graph
        users = list(node.users)
        if not all(
            u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int) for u in users
        ):
            raise UnsupportedError(
                f"lift: {node.name} ({op_name(node)}) returns {len(value)} tensors and is used other than by "
                f"indexing; source: {source_line(node)}"
            )
        partition = op_name(node) in PARTITIONS and node.target is not dtensor_ops.run_local
        source = node.args[0]
        whole = self.env[source] if partition else None
        for u in users:
            i = u.args[1]
            if partition:
                piece = value[i]
                dim, start = _slice_of(whole, value, i)
                with graph.inserting_before(u):
                    new = (
                        graph.call_method("select", (source, dim, start))
                        if piece.ndim < whole.ndim
                        else graph.call_method("narrow", (source, dim, start, piece.shape[dim]))
                    )
            else:
                with graph.inserting_before(u):
                    new = graph.call_function(
                        dtensor_ops.run_local, (*node.args[:2], i, *node.args[3:]), dict(node.kwargs)
                    )
            u.replace_all_uses_with(new)
            graph.erase_node(u)
            self.erased.add(u)
            args, kwargs = self._values(new)
            self._set(new, call_node(self.gm, new, args, kwargs))
        graph.erase_node(node)

    def _functionalize(self, node: fx.Node, target: fx.Node) -> Any:
        """`node` updates `target` in place: make it out of place and point later readers at it."""
        where = f"{node.name} ({op_name(node)}, source: {source_line(node)})"
        if target.op == "placeholder" or target.target in (dtensor_ops.from_local, dtensor_ops.replicate):
            raise UnsupportedError(
                f"lift: {where} updates {target.name}, an argument, parameter or buffer of the graph, in place; "
                "write it out of place (y = x * 2, not x.mul_(2))"
            )
        # Aliased: a value read later shares its storage (DTensor's local views do not record `_base`).
        key, order = storage_key(self.env[target]._local_tensor), {n: i for i, n in enumerate(self.gm.graph.nodes)}
        later = lambda n: any(order.get(u, -1) > order[node] for u in n.users)
        shared = lambda n, v: isinstance(v, DTensor) and storage_key(v._local_tensor) == key and later(n)
        if any(n is not target and shared(n, v) for n, v in self.env.items()):
            raise UnsupportedError(
                f"lift: {where} updates {target.name} in place while it is a view of, or viewed by, another value; "
                "write it out of place"
            )
        if node.op == "call_method" and node.target.endswith("_"):
            node.target = node.target[:-1]
        elif node.target in INPLACE_OPERATORS:
            node.target = INPLACE_OPERATORS[node.target]
        elif node.kwargs.get("inplace"):
            node.kwargs = {**node.kwargs, "inplace": False}
        elif (
            node.op == "call_function"
            and getattr(node.target, "__name__", "").endswith("_")
            and hasattr(torch, node.target.__name__[:-1])
        ):
            node.target = getattr(torch, node.target.__name__[:-1])
        else:
            raise UnsupportedError(f"lift: {where} updates {target.name} in place and has no out-of-place form here")
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)
        self.decisions.append(f"{node.name}: in-place update of {target.name} made out of place")
        args, kwargs = self._values(node)
        return call_node(self.gm, node, args, kwargs)


def _slice_of(whole, pieces, i: int) -> tuple[int, int]:
    """The dim a partition op cut `whole` along, and where piece `i` starts."""
    for dim in range(whole.ndim):
        if pieces[i].ndim < whole.ndim:  # unbind: the dim that disappeared
            if len(pieces) == whole.shape[dim] and tuple(pieces[i].shape) == tuple(whole.shape[:dim]) + tuple(
                whole.shape[dim + 1 :]
            ):
                return dim, i
            continue
        if sum(p.shape[dim] for p in pieces) == whole.shape[dim] and all(
            p.shape[:dim] == whole.shape[:dim] and p.shape[dim + 1 :] == whole.shape[dim + 1 :] for p in pieces
        ):
            return dim, sum(p.shape[dim] for p in pieces[:i])
    raise UnsupportedError(
        f"lift: cannot tell how a partition of {tuple(whole.shape)} into {[tuple(p.shape) for p in pieces]} was cut"
    )
