"""Collective chains for tests/test_collective_rewrites.py, built and run on every rank.

Each case is a small function over `torch.distributed._functional_collectives`
with this rank's coordinate baked in as a constant (what tracing per rank
gives). `run_all` traces each with make_fx, runs it, rewrites it with the
pass, runs it again on the same inputs and returns what the tests assert on.
Plain module, importable by the spawned ranks; no pytest here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from torch_hca._torch_private import fake_mode_of
from torch_hca.spmd.collective_nodes import OPS
from torch_hca.passes.collective_rewrites import agree_across_ranks, rewrite_collectives
from torch_hca.compiler.checks.schedule_check import check_order


def cases(r: int, n: int, world, other) -> dict[str, tuple[Callable, list[tuple[int, ...]]]]:
    """name -> (function, input shapes). `other` is a second group over the same ranks."""
    ar = lambda x, g=world, op="sum": funcol.all_reduce(x, op, g)
    ag = lambda x, dim=0, g=world: funcol.all_gather_single(x, dim, g)
    rs = lambda x, g=world: funcol.reduce_scatter_single(x, "sum", 0, g)
    a2a = lambda x, out=None, inp=None, g=world: funcol.all_to_all_single(x, out, inp, g)
    sizes = [k + 1 for k in range(n)]  # rank r sends k + 1 rows to rank k, receives r + 1 from each
    rows, cols = (2 * n, 3), (3, 2 * n)
    return {
        # shard_r(all_reduce x) = reduce_scatter x
        "ar_chunk": (lambda x: torch.chunk(ar(x), n)[r], [rows]),
        "ar_chunk_dim1": (lambda x: torch.chunk(ar(x), n, dim=1)[r], [cols]),
        "ar_slice": (lambda x: ar(x)[2 * r : 2 * r + 2], [rows]),
        "ar_narrow_dim1": (lambda x: ar(x).narrow(1, 2 * r, 2), [cols]),
        "ar_other_chunk": (lambda x: torch.chunk(ar(x), n)[(r + 1) % n], [rows]),
        "ar_chunk_0": (lambda x: torch.chunk(ar(x), n)[0], [rows]),  # own piece on rank 0 only
        "ar_uneven": (lambda x: torch.split(ar(x), 2)[r], [(2 * n - 1, 3)]),
        "ar_full_used": (lambda x: reuse(ar(x), lambda s: (torch.chunk(s, n)[r], s)), [rows]),
        # shard_r(all_gather x) = x
        "ag_chunk": (lambda y: torch.chunk(ag(y), n)[r], [(2, 3)]),
        "ag_chunk_dim1": (lambda y: torch.chunk(ag(y, 1), n, dim=1)[r], [(3, 2)]),
        "ag_own_and_full": (lambda y: reuse(ag(y), lambda s: (torch.chunk(s, n)[r] * 2, s.sum(0))), [(2, 3)]),
        "ag_other_chunk": (lambda y: torch.chunk(ag(y), n)[(r + 1) % n], [(2, 3)]),
        # all_to_all(b->a)(all_to_all(a->b) x) = x
        "a2a_round_trip": (lambda x: a2a(a2a(x)), [rows]),
        "a2a_round_trip_uneven": (lambda x: a2a(a2a(x, [r + 1] * n, sizes), sizes, [r + 1] * n), [(sum(sizes), 3)]),
        "a2a_other_group": (lambda x: a2a(a2a(x), g=other), [rows]),
        "a2a_back_on_some_ranks": (lambda x: a2a(a2a(x, [1] * n, [1] * n), *_not_quite_back(r, n)), [(n, 3)]),
        # all_gather(reduce_scatter x) = all_reduce x
        "rs_ag": (lambda x: ag(rs(x)), [rows]),
        "rs_ag_other_use": (lambda x: reuse(rs(x), lambda s: (ag(s), s * 3)), [rows]),
        "rs_ag_other_group": (lambda x: ag(rs(x), g=other), [rows]),
        # all_reduce a + all_reduce b = all_reduce (a + b)
        "ar_sum": (lambda x, y: ar(x) + ar(y), [rows, rows]),
        "ar_sum_three": (lambda x, y: ar(x) + ar(y) + ar(x * y), [rows, rows]),
        "ar_sum_alpha": (lambda x, y: torch.add(ar(x), ar(y), alpha=0.5), [rows, rows]),
        "ar_sum_other_use": (lambda x, y: reuse(ar(x), lambda s: (s + ar(y), s)), [rows, rows]),
        "ar_sum_other_group": (lambda x, y: ar(x) + ar(y, g=other), [rows, rows]),
        "ar_sum_max": (lambda x, y: ar(x, op="max") + ar(y, op="max"), [rows, rows]),
        # several identities in a row, to a fixed point
        "ar_sum_then_shard": (lambda x, y: torch.chunk(ar(x) + ar(y), n)[r], [rows, rows]),
        "rs_ag_then_shard": (lambda x: torch.chunk(ag(rs(x)), n)[r], [rows]),
    }


def _not_quite_back(r: int, n: int) -> tuple[list[int], list[int]]:
    """(output, input) split sizes of a second all_to_all after one that moved one row to every rank.

    At n >= 3, ranks 0 and 3 (if any) get sizes that swap back, ranks 1 and 2 do not: rewriting
    where the sizes swap would leave ranks 1 and 2 alone in the exchange. At n = 2 no valid
    sizes do that; every rank sends both rows to rank 0 instead.
    """
    if n == 2:
        return ([2, 2] if r == 0 else [0, 0]), [2, 0]
    send = [[1] * n for _ in range(n)]
    send[1][1], send[1][2] = 2, 0  # rank 1 sends rank 2's row to itself instead
    return [send[k][r] for k in range(n)], send[r]


def reuse(value, fn):
    """`fn(value)`: lets a one-line case use one collective's result twice."""
    return fn(value)


def counts(gm: fx.GraphModule) -> dict[str, int]:
    return dict(Counter(OPS[n.target].kind.value for n in gm.graph.nodes if n.target in OPS))


def rel_err(after, before) -> float:
    after, before = torch.utils._pytree.tree_leaves(after), torch.utils._pytree.tree_leaves(before)
    if len(after) != len(before) or any(a.shape != b.shape for a, b in zip(after, before)):
        return float("inf")
    return max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(after, before))


def wrong_vals(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> list[str]:
    """Nodes whose recorded ``meta["val"]`` disagrees with what they compute (shape, dtype)."""
    wrong = []

    class Check(fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            val = node.meta.get("val")
            if (
                node.op != "output"
                and isinstance(out, torch.Tensor)
                and (not isinstance(val, torch.Tensor) or val.shape != out.shape or val.dtype != out.dtype)
            ):
                wrong.append(node.name)
            return out

    Check(gm).run(*inputs)
    return wrong


def run_case(fn: Callable, shapes: list[tuple[int, ...]], seed: int, in_fake_mode: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(s, generator=gen) for s in shapes]
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    before, out_before = counts(gm), gm(*inputs)
    # AOTAutograd runs the partitioner, where the pass will run, with the graph's fake mode active.
    mode = fake_mode_of([n.meta.get("val") for n in gm.graph.nodes]) if in_fake_mode else contextlib.nullcontext()
    proposed: list[str] = []

    def agree(keys):  # what this rank found on its own, before the ranks agree
        proposed.extend(k.split("@")[0] for k in keys)
        return agree_across_ranks(keys)

    with mode:
        applied = rewrite_collectives(gm, agree)
    gm.recompile()
    check_order(gm, "rewritten")  # every collective still read only through its wait
    return {
        "before": before,
        "after": counts(gm),
        "rules": [a.rule for a in applied],
        "proposed": proposed,
        "err": rel_err(gm(*inputs), out_before),
        "wrong_vals": wrong_vals(gm, inputs),
    }


# Cases run a second time with the pass inside the graph's fake mode, as the pipeline will run it.
IN_FAKE_MODE = ("ar_chunk", "ar_chunk_0")


def run_all() -> dict[str, dict[str, Any]]:
    """Every case on this rank; the same inputs before and after, different on every rank."""
    r, n = dist.get_rank(), dist.get_world_size()
    other = dist.new_group(list(range(n)))  # same ranks, another group: must never be merged
    table = cases(r, n, dist.group.WORLD, other)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        results = {
            name: run_case(fn, shapes, seed=1000 * r + i) for i, (name, (fn, shapes)) in enumerate(table.items())
        }
        for name in IN_FAKE_MODE:
            results[f"{name}/in_fake_mode"] = run_case(*table[name], seed=1000 * r, in_fake_mode=True)
    return results
