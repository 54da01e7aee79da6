"""Seeded corruptions of real strategy files that every structural rule but the per-op-family
ones passes (torch_hca/verify/op_rules.py), used by tests/test_verify_op_rules.py and by the
MUTATIONS of tests/test_verify.py; and `Mixer`, a small model whose file holds a sum and a mean
over a sharded dim. Plain module, no pytest here.

Each mutation takes a copy of a real file and a seeded Random, changes one value's placement on
one mesh dim (and the move that reads it, where the move's step then has nothing to do: its
collective is taken out of the file cleanly), keeps the change only where today's other rules
still pass, and returns the rule that must catch it (None: nothing in the file to corrupt so)."""

from __future__ import annotations

import copy
import random
from typing import Callable

import torch
import torch.nn as nn

from torch_hca.verify import op_rules, problems

RULE = op_rules.RULE
# expand may cut a replicated read: each rank expands it to its own piece
EXPANDS = {op_rules.op_name(f) for f in (torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to)}
NONLINEAR = {
    op_rules.op_name(f)
    for f in (torch.tanh, torch.exp, torch.sigmoid, torch.rsqrt, torch.relu, nn.functional.gelu, nn.functional.silu)
} | {op_rules.op_name(nn.functional.relu)}


class Mixer(nn.Module):
    """A column-parallel linear, then a sum and a mean over its sharded output dim."""

    def __init__(self, dim: int = 16, hidden: int = 256):
        super().__init__()
        self.up = nn.Linear(dim, hidden)

    def forward(self, x):
        h = torch.tanh(self.up(x))
        s = h.sum(-1, keepdim=True)
        m = h.mean(-1, keepdim=True)
        return (x * s + m).transpose(0, 1).reshape(-1)


def _today(d: dict) -> list:
    """The problems every other rule finds."""
    return [p for p in problems(d) if p.rule != RULE]


def _write(d: dict, name: str, m: int, p: str) -> bool:
    """Value `name` written `p` on mesh dim `m`; a move of it whose step on `m` has nothing left to
    do loses the step and its collective. False where a move would need another step."""
    from test_verify import _remove_collective

    g = d["graphs"][0]
    g["values"][name]["placements"][m] = p
    for move in [mv for mv in g["moves"] if mv["value"] == name]:
        was = move["src"][m]
        move["src"][m] = p
        if was == move["dst"][m] or p != move["dst"][m]:
            return False  # the move would need a step it does not have, or another kind of step
        step = next(s for s in move["steps"] if s["mesh_dim"] == m)
        move["steps"].remove(step)
        if step["collective"] is not None:
            _remove_collective(d, step["collective"])
    return True


def _corrupt(d: dict, rng: random.Random, pick: Callable[[str, dict, int, str], list[str]]) -> str | None:
    """The first change (value, mesh dim, new placement) `pick` offers, in seeded order, that
    today's rules pass, made in `d`; its rule, or None where there is none."""
    g = d["graphs"][0]
    sizes = d["mesh"]["shape"]
    changes = [
        (name, m, p)
        for name, v in g["values"].items()
        if v["kind"] == "op" and v["op"] in op_rules.TABLE
        for m in range(len(sizes))
        if sizes[m] > 1
        for p in pick(op_rules.TABLE[v["op"]][0], v, m, v["placements"][m])
    ]
    rng.shuffle(changes)
    for name, m, p in changes:
        trial = copy.deepcopy(d)
        if _write(trial, name, m, p) and not _today(trial):
            assert _write(d, name, m, p)
            return RULE
    return None


def _cuts(v: dict, n: int, but: str) -> list[str]:
    """The other dims `v` can be cut on `n` ways, of another size than the dim of `but` (a swap of
    two dims of one size is the same shape: no file can tell it)."""
    size = v["shape"][int(but[2:-1])] if but.startswith("S") else None
    return [  # a symbolic size (a file cut by shares) is left alone: its divisibility is the samples'
        f"S({k})" for k, x in enumerate(v["shape"]) if isinstance(x, int) and x > 1 and x % n == 0 and x != size
    ]


def nonlinear_written_partial(d, rng):
    """A tanh, gelu, relu... written P(sum): a sum over ranks of a nonlinear op of the pieces."""
    return _corrupt(d, rng, lambda fam, v, m, p: ["P(sum)"] if v["op"] in NONLINEAR and p[0] != "P" else [])


def contraction_written_whole(d, rng):
    """A matmul whose operands are cut on the contracted dim (P(sum)) written R, its all_reduce dropped."""
    return _corrupt(d, rng, lambda fam, v, m, p: ["R"] if fam == "matmul" and p[0] == "P" else [])


def reduction_written_whole(d, rng):
    """A sum or mean over a sharded dim (a Partial) written R, with no all_reduce."""
    return _corrupt(d, rng, lambda fam, v, m, p: ["R"] if fam == "reduction" and p[0] == "P" else [])


def pointwise_shard_moved(d, rng):
    """An elementwise output's shard dim changed (the reads still cut on the old one)."""
    n = d["mesh"]["shape"]
    return _corrupt(d, rng, lambda fam, v, m, p: _cuts(v, n[m], p) if fam == "pointwise" and p[0] == "S" else [])


def view_shard_moved(d, rng):
    """A view's, transpose's or reshape's shard dim changed: not where the view maps it."""
    n = d["mesh"]["shape"]
    return _corrupt(d, rng, lambda fam, v, m, p: _cuts(v, n[m], p) if fam == "view" and p[0] == "S" else [])


def product_shard_lost(d, rng):
    """A matmul's output cut on a batch or free dim written whole or cut elsewhere."""
    n = d["mesh"]["shape"]
    return _corrupt(d, rng, lambda fam, v, m, p: ["R", *_cuts(v, n[m], p)] if fam == "matmul" and p[0] == "S" else [])


def replicated_written_cut(d, rng):
    """An op of whole reads, computed whole on every rank, written cut or partial."""
    n = d["mesh"]["shape"]
    return _corrupt(
        d, rng, lambda fam, v, m, p: [*_cuts(v, n[m], p), "P(sum)"] if p == "R" and v["op"] not in EXPANDS else []
    )


MUTATIONS = [
    nonlinear_written_partial,
    contraction_written_whole,
    reduction_written_whole,
    pointwise_shard_moved,
    view_shard_moved,
    product_shard_lost,
    replicated_written_cut,
]
