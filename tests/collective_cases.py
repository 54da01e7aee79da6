"""Work run on every rank by tests/test_collective_table.py and tests/test_local_collectives.py.

Plain module, importable by the spawned ranks; no pytest here. Every rank
draws its own data from a seed and its rank; the test process draws only the
parameters (shapes, dims, roots, shifts) and passes them in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import torch_hca as hca
from torch_hca.spmd.collective_kinds import Kind, emit, emit_transpose

C = hca.collectives


def _world() -> tuple[str, int, int]:
    return dist.group.WORLD.group_name, dist.get_rank(), dist.get_world_size()


def _params(raw: dict[str, Any]) -> dict[str, Any]:
    """Lists of indices travel as lists; the emitters take tensors."""
    return {k: torch.tensor(v, dtype=torch.long) if k == "index" else v for k, v in raw.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------- adjoint table


def _adjoint_one(kind: Kind, case: dict, dtype: torch.dtype) -> dict[str, Any]:
    group, rank, _ = _world()
    params = _params(case["params"])
    gen = torch.Generator().manual_seed(case["seed"] * 7919 + rank)
    x = torch.randn(case["shape"], dtype=dtype, generator=gen)
    ax = emit(kind, x, group, **params)
    y = torch.randn(ax.shape, dtype=dtype, generator=gen)
    aty = emit_transpose(kind, y, group, **params)
    if aty.shape != x.shape:
        return {"error": f"transpose maps back to shape {tuple(aty.shape)}, not {tuple(x.shape)}"}
    # Each side's local dot product, then summed over the mesh (in fp64, so the
    # cross-rank sum adds no error of its own); the scale is Cauchy-Schwarz's bound.
    norms = [ax.double().pow(2).sum(), y.double().pow(2).sum()]
    local = torch.stack([(ax * y).sum().double(), (x * aty).sum().double(), *norms])
    dist.all_reduce(local)
    lhs, rhs, ax2, y2 = local.tolist()
    return {"lhs": lhs, "rhs": rhs, "rel": abs(lhs - rhs) / max((ax2 * y2) ** 0.5, 1e-300)}


def adjoint_cases(kind_value: str, cases: list[dict]) -> list[dict[str, Any]]:
    """`<A x, y> = <x, A^T y>` over the mesh, for each case in fp64 and fp32."""
    kind = Kind(kind_value)
    out = []
    for case in cases:
        for dtype in (torch.float64, torch.float32):
            out.append({"case": case, "dtype": str(dtype), **_adjoint_one(kind, case, dtype)})
    return out


# -------------------------------------------------- the classic trap, per rank


def _trap_model(seed: int, dim: int, hidden: int):
    torch.manual_seed(seed)
    w1 = torch.randn(hidden, dim, dtype=torch.float32) / dim**0.5
    b1 = torch.randn(hidden, dtype=torch.float32)
    v = torch.randn(hidden, dtype=torch.float32)
    x = torch.randn(8, dim, dtype=torch.float32)
    return w1, b1, v, x


def _loss_terms(x, w1, b1, v):
    # Separable over hidden features and batch rows, so a rank's share of either
    # is a summand of the single-device loss.
    y = torch.tanh(x @ w1.T + b1) * v
    return (y * y).sum() + y.sum()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _reduce_local_loss(local_loss, dst):
    return C.all_reduce(local_loss, src="P", dst=dst)


def _tensor_parallel(dst: str, compiled: bool) -> dict[str, float]:
    """Hidden features sharded (Megatron column-parallel); the loss all-reduced; grads per shard."""
    _, rank, n = _world()
    w1, b1, v, x = _trap_model(0, 6, 4 * n)
    ref = [_leaf(t) for t in (w1, b1, v, x)]
    ref_loss = _loss_terms(*[ref[3], ref[0], ref[1], ref[2]])
    ref_loss.backward()
    mine = [_leaf(t.chunk(n, 0)[rank]) for t in (w1, b1, v)] + [_leaf(x)]

    def step(w1_, b1_, v_, x_):
        return _reduce_local_loss(_loss_terms(x_, w1_, b1_, v_), dst)

    loss = (torch.compile(step, backend="aot_eager") if compiled else step)(*mine)
    loss.backward()
    x_grad = mine[3].grad.clone()
    dist.all_reduce(x_grad)  # the replicated input's gradient is a summand per rank
    out = {"loss": rel(loss.detach(), ref_loss.detach())}
    for name, got, want in zip(("w1", "b1", "v"), mine, ref):
        out[name] = rel(got.grad, want.grad.chunk(n, 0)[rank])
        out[name + "_ratio"] = (got.grad.norm() / want.grad.chunk(n, 0)[rank].norm()).item()
    out["x"] = rel(x_grad, ref[3].grad)
    return out


def _data_parallel(dst: str, compiled: bool) -> dict[str, float]:
    """Batch sharded, weights replicated; each rank's loss is its rows' share."""
    _, rank, n = _world()
    w1, b1, v, x = _trap_model(1, 6, 5)
    ref = [_leaf(t) for t in (w1, b1, v, x)]
    ref_loss = _loss_terms(ref[3], ref[0], ref[1], ref[2])
    ref_loss.backward()
    mine = [_leaf(t) for t in (w1, b1, v)] + [_leaf(x.chunk(n, 0)[rank])]

    def step(w1_, b1_, v_, x_):
        return _reduce_local_loss(_loss_terms(x_, w1_, b1_, v_), dst)

    loss = (torch.compile(step, backend="aot_eager") if compiled else step)(*mine)
    loss.backward()
    out = {"loss": rel(loss.detach(), ref_loss.detach()), "x": rel(mine[3].grad, ref[3].grad.chunk(n, 0)[rank])}
    for name, got, want in zip(("w1", "b1", "v"), mine, ref):
        summed = got.grad.clone()
        dist.all_reduce(summed)  # what a data-parallel step sums: each rank's summand
        out[name] = rel(summed, want.grad)
        out[name + "_ratio"] = (summed.norm() / want.grad.norm()).item()
    return out


def trap(dst: str, compiled: bool) -> dict[str, dict[str, float]]:
    torch._dynamo.reset()
    return {"tp": _tensor_parallel(dst, compiled), "dp": _data_parallel(dst, compiled)}


# ------------------------------------------- each local-view op against math


def _globals(seed: int, n: int, shape, count: int) -> list[torch.Tensor]:
    """`count` tensors every rank draws alike (fp64): inputs, per-rank pieces, cotangents."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(count)]


def _run_op(fn, x_local: torch.Tensor, g_local: torch.Tensor, **kwargs):
    x = _leaf(x_local)
    y = fn(x, **kwargs)
    y.backward(g_local)
    return y.detach(), x.grad


def _cotangent(dst: str, g_whole: torch.Tensor, pieces: list[torch.Tensor], rank: int) -> torch.Tensor:
    """A rank's gradient of a value the same on every rank: R holds the whole, I a summand."""
    return g_whole if dst == "R" else pieces[rank]


def op_all_reduce(seed: int) -> dict[str, float]:
    _, r, n = _world()
    out = {}
    for dst in ("R", "I"):
        xs = _globals(seed, n, (3, 5), n)  # the summands
        gs = _globals(seed + 1, n, (3, 5), n)  # I: cotangent summands
        g = sum(gs) if dst == "I" else gs[0]
        y, gx = _run_op(C.all_reduce, xs[r], _cotangent(dst, g, gs, r), src="P", dst=dst)
        out[f"P->{dst} value"] = rel(y, sum(xs))
        out[f"P->{dst} grad"] = rel(gx, g)  # every summand's gradient is the whole gradient
    return out


def op_all_gather(seed: int) -> dict[str, float]:
    _, r, n = _world()
    out = {}
    for src, d in (("S(0)", 0), ("S(1)", 1), ("S(-1)", 2), ("V", None)):
        for dst in ("R", "I"):
            shape = [2, 3, 2]
            whole_shape = (n, *shape) if d is None else [s * (n if i == d else 1) for i, s in enumerate(shape)]
            (whole,) = _globals(seed, n, whole_shape, 1)
            gs = _globals(seed + 1, n, whole_shape, n)
            g = sum(gs) if dst == "I" else gs[0]
            mine = whole[r] if d is None else whole.chunk(n, d)[r]
            y, gx = _run_op(C.all_gather, mine, _cotangent(dst, g, gs, r), src=src, dst=dst)
            want_gx = g[r] if d is None else g.chunk(n, d)[r]
            out[f"{src}->{dst} value"] = rel(y, whole)
            out[f"{src}->{dst} grad"] = rel(gx, want_gx)
    return out


def op_reduce_scatter(seed: int) -> dict[str, float]:
    _, r, n = _world()
    out = {}
    for dst, d in (("S(0)", 0), ("S(1)", 1), ("V", None)):
        shape = (n, 3) if d is None else (2 * n, 3 * n)
        xs = _globals(seed, n, shape, n)
        (g,) = _globals(seed + 1, n, shape, 1)  # the whole cotangent; each rank gets its part
        total = sum(xs)
        mine_g = g[r] if d is None else g.chunk(n, d)[r]
        y, gx = _run_op(C.reduce_scatter, xs[r], mine_g, src="P", dst=dst)
        out[f"P->{dst} value"] = rel(y, total[r] if d is None else total.chunk(n, d)[r])
        out[f"P->{dst} grad"] = rel(gx, g)
    return out


def op_all_to_all(seed: int) -> dict[str, float]:
    _, r, n = _world()
    out = {}
    for a, b in ((0, 1), (1, 0), (2, 0), (1, 2)):
        (whole,) = _globals(seed, n, (2 * n, 3 * n, n), 1)
        (g,) = _globals(seed + 1, n, (2 * n, 3 * n, n), 1)
        y, gx = _run_op(C.all_to_all, whole.chunk(n, a)[r], g.chunk(n, b)[r], src=f"S({a})", dst=f"S({b})")
        out[f"S({a})->S({b}) value"] = rel(y, whole.chunk(n, b)[r])
        out[f"S({a})->S({b}) grad"] = rel(gx, g.chunk(n, a)[r])
    return out


def op_broadcast(seed: int) -> dict[str, float]:
    _, r, n = _world()
    out = {}
    for root in sorted({0, n - 1}):
        for dst in ("R", "I"):
            xs = _globals(seed + root, n, (4,), n)
            gs = _globals(seed + 1, n, (4,), n)
            g = sum(gs) if dst == "I" else gs[0]
            y, gx = _run_op(C.broadcast, xs[r], _cotangent(dst, g, gs, r), src="V", dst=dst, root=root)
            out[f"root {root} V->{dst} value"] = rel(y, xs[root])
            want = g if r == root else torch.zeros_like(g)
            out[f"root {root} V->{dst} grad"] = (gx - want).norm().item() / g.norm().item()
    return out


def op_ppermute(seed: int) -> dict[str, float]:
    _, r, n = _world()
    out = {}
    perm = tuple((3 * i + 1) % n for i in range(n)) if n % 3 else tuple(reversed(range(n)))
    for src, route in (("V", {"shift": 1}), ("V", {"shift": -3}), ("S(0)", {"perm": perm})):
        xs = _globals(seed, n, (2, 3), n)
        gs = _globals(seed + 1, n, (2, 3), n)
        dest = [(i + route["shift"]) % n for i in range(n)] if "shift" in route else list(perm)
        y, gx = _run_op(C.ppermute, xs[r], gs[r], src=src, dst="V", **route)
        out[f"{src} {route} value"] = rel(y, xs[dest.index(r)])  # I receive from whoever sends to me
        out[f"{src} {route} grad"] = rel(gx, gs[dest[r]])  # my gradient comes back from where I sent
    return out


OPS = {
    "all_reduce": op_all_reduce,
    "all_gather": op_all_gather,
    "reduce_scatter": op_reduce_scatter,
    "all_to_all": op_all_to_all,
    "broadcast": op_broadcast,
    "ppermute": op_ppermute,
}


def op_case(name: str, seed: int) -> dict[str, float]:
    return OPS[name](seed)


def on_mesh_dims() -> dict[str, float]:
    """A (2, 2) mesh: all_reduce along "tp" (current mesh) and ppermute along "dp" (mesh passed)."""
    _, r, _ = _world()
    mesh = hca.init_mesh((2, 2), ("dp", "tp"))
    row, col = divmod(r, 2)  # rank = 2 * dp + tp
    x = _leaf(torch.full((3,), float(r + 1), dtype=torch.float64))
    y = C.all_reduce(x, src="P", dst="I", mesh_dim="tp")
    y.backward(torch.ones(3, dtype=torch.float64))
    z = C.ppermute(_leaf(x.detach()), src="V", dst="V", shift=1, group=mesh, mesh_dim="dp")
    tp_peers = [2 * row + c for c in range(2)]
    dp_peer = 2 * (1 - row) + col
    return {
        "tp sum": rel(y.detach(), torch.full((3,), float(sum(p + 1 for p in tp_peers)), dtype=torch.float64)),
        "tp grad": rel(x.grad, torch.full((3,), 2.0, dtype=torch.float64)),  # I: two summands of 1
        "dp shift": rel(z.detach(), torch.full((3,), float(dp_peer + 1), dtype=torch.float64)),
    }


# ------------------------------------------------------------- the eager emitter on gloo


def reduce_scatter_as_emitted(seed: int, flat: bool = False) -> dict[str, Any]:
    """A bucket's reduce_scatter as `backends.emit` runs it on gloo: the ops it runs, and its
    result against the sum's rows this rank owns. ``flat``: the bucket is viewed flat first,
    as the schedule pass's buckets are (`passes/buckets.py`)."""
    import torch.fx as fx

    from torch_hca.backends.emit import eager_graph, emit

    name, rank, n = _world()
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    bucket = g.call_function(aten.cat.default, ([a, b],))
    bucket.meta["val"] = torch.empty(3 * n, 3)
    if flat:
        bucket = g.call_function(aten.view.default, (bucket, [-1]))
        bucket.meta["val"] = torch.empty(9 * n)
    scattered = g.call_function(c10d.reduce_scatter_tensor.default, (bucket, "sum", n, name))
    g.output((g.call_function(c10d.wait_tensor.default, (scattered,)),))
    a.meta["val"], b.meta["val"] = torch.empty(n, 3), torch.empty(2 * n, 3)
    gm = fx.GraphModule({}, g)
    firsts = [torch.randn(n, 3, generator=torch.Generator().manual_seed(seed + r)) for r in range(n)]
    inputs = [[x, torch.cat([x, x])] for x in firsts]
    total = sum(torch.cat(pair) for pair in inputs)
    (out,) = emit(gm, inputs[rank], "eager")(list(inputs[rank]))
    return {
        "ops": [str(node.target) for node in eager_graph(gm).graph.nodes if node.op == "call_function"],
        "report_ops": [str(node.target) for node in gm.graph.nodes if node.op == "call_function"],
        "err": rel(out, (total.view(-1)[9 * rank : 9 * rank + 9] if flat else total[3 * rank : 3 * rank + 3])),
        "shape": list(out.shape),
        "own_storage": out._base is None,
    }
