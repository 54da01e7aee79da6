"""Collective rewrite pass: replace chains of collectives by cheaper programs that compute the same values.

The rules, each named after the identity that justifies it, are the table of
`torch_hca.passes.rewrite_rules` (`RULES`, keyed by the OpOverload a pattern starts from).
The driver runs the rules to a fixed point, removes what they leave
dead, gives every new node its ``meta["val"]`` and returns what it applied.

Rules that read something particular to this rank are rank dependent: "this
rank's shard" (a graph that takes piece 0 on every rank matches on rank 0
alone), or all_to_all split sizes (each rank has its own). Rewriting on some
ranks only would leave them issuing different collectives (a hang), so such a
match is applied only where every rank found it (`agree`, one exchange per
round). The other rules read only what every rank of the group shares.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch.distributed as dist
import torch.fx as fx

from torch_hca._torch_private import fake_mode_of
from torch_hca.spmd.collective_nodes import OPS, WAIT
from torch_hca.errors import CheckError
from torch_hca.runtime.exchange import exchange, needs_exchange

from .infra import PassContext, PassResult
from .rewrite_rules import RULES, Builder, Match, Rule


@dataclass(frozen=True)
class Applied:
    """One rewrite: the rule, its identity, the nodes it matched and the nodes it made."""

    rule: str
    identity: str
    matched: tuple[str, ...]
    made: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.rule}: {self.identity}; [{', '.join(self.matched)}] -> [{', '.join(self.made)}]"


# ---------------------------------------------------------------- the driver


def agree_across_ranks(keys: list[str]) -> set[str]:
    """The keys every rank of the world proposed. Every rank must call this the same number of times.

    Needs no exchange without a process group, with one rank, or on the fake
    process group (one rank standing for all; graph-only work). The ranks post
    56-bit hashes of their keys through `torch_hca.runtime.exchange` (text, no pickle,
    no collective at compile time; a rank that never posts is an error after
    the mesh's timeout, not a hang). Like torch's own compile-time exchanges it
    assumes every rank compiles the same graphs in the same order; hence opt-in
    (``options={"rank_rewrites": True}``).
    """
    if not needs_exchange():
        return set(keys)
    by_hash = {hashlib.sha256(k.encode()).hexdigest()[:14]: k for k in keys}
    posted = exchange(
        "rewrites",
        ",".join(sorted(by_hash)),
        range(dist.get_world_size()),
        "collective rewrites (turn options['rank_rewrites'] off if the ranks compile different graphs)",
    )
    common = set(by_hash)
    for text in posted.values():
        common &= set(filter(None, text.split(",")))
    return {by_hash[h] for h in common}


def no_rank_rewrites(keys: list[str]) -> set[str]:
    """Agree to nothing: rules that depend on the rank never apply (the default)."""
    return set()


class _Rewriter:
    def __init__(self, graph: fx.Graph, mode):
        self.graph, self.mode = graph, mode
        self.applied: list[Applied] = []
        self.erased: set[fx.Node] = set()
        self.limit = 4 * len(graph.nodes) + 16  # every rule shrinks the graph's communication or its size

    def matches(self, rank_dependent: bool) -> Iterator[tuple[Rule, fx.Node, Match]]:
        for node in list(self.graph.nodes):
            for r in RULES.get(node.target, ()):
                if r.rank_dependent == rank_dependent and node not in self.erased and (m := r.fn(node)):
                    yield r, node, m

    def apply(self, r: Rule, m: Match) -> None:
        if len(self.applied) >= self.limit:
            raise CheckError(
                f"collective rewrites: no fixed point after {self.limit} rewrites (last: {r.name}); a rule undoes another"
            )
        b = Builder(self.graph, self.mode, r, m.nodes[-1])
        replace = m.build(b)
        for old, new in replace.items():
            old.replace_all_uses_with(new)
        self.applied.append(Applied(r.name, r.identity, tuple(n.name for n in m.nodes), tuple(n.name for n in b.made)))
        self.remove_dead(replace)

    def remove_dead(self, work: Iterable[fx.Node]) -> None:
        """Erase what a rewrite left unused: its old nodes and, transitively, their inputs."""
        work = list(work)
        while work:
            n = work.pop()
            if n in self.erased or n.op != "call_function":
                continue
            for u in [u for u in n.users if u.target is operator.getitem and not u.users]:
                self.graph.erase_node(u)
                self.erased.add(u)
            if n.users or not (n.target in OPS or n.target is WAIT or not n.is_impure()):
                continue
            work.extend(n.all_input_nodes)
            self.graph.erase_node(n)
            self.erased.add(n)

    def run(self, agree: Callable[[list[str]], set[str]]) -> list[Applied]:
        while True:
            while (hit := next(self.matches(rank_dependent=False), None)) is not None:
                self.apply(hit[0], hit[2])
            found = [(f"{r.name}@{node.name}", r, node) for r, node, _ in self.matches(rank_dependent=True)]
            agreed = agree([key for key, _, _ in found])
            chosen = [(r, node) for key, r, node in found if key in agreed]
            for r, node in chosen:
                m = r.fn(node) if node not in self.erased else None  # an earlier rewrite may have moved it
                if m:
                    self.apply(r, m)
            if not chosen:
                return self.applied


def rewrite_collectives(
    gm: fx.GraphModule,
    agree: Callable[[list[str]], set[str]] = agree_across_ranks,
) -> list[Applied]:
    """Apply the rules to a fixed point, in place; return what was applied, in order.

    Needs fake values in ``node.meta["val"]`` (AOTAutograd and make_fx record
    them): rules read shapes from them and new nodes get theirs the same way.
    Without them nothing is rewritten, but `agree` is still called once, so
    that every rank makes the same number of calls.
    """
    mode = fake_mode_of([n.meta.get("val") for n in gm.graph.nodes])
    if mode is None:
        agree([])
        return []
    return _Rewriter(gm.graph, mode).run(agree)


class CollectiveRewritePass:
    name = "collective_rewrites"
    reads = "joint forward+backward graph (local tensors, _c10d_functional)"
    writes = "the same graph with collective chains replaced by equal, cheaper ones"

    def __init__(self, agree: Callable[[list[str]], set[str]] = agree_across_ranks):
        self.agree = agree

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        before = {n.name for n in gm.graph.nodes if n.target in OPS}
        applied = rewrite_collectives(gm, self.agree)
        ctx.rewritten |= before - {n.name for n in gm.graph.nodes if n.target in OPS}
        return PassResult(gm, bool(applied), [str(a) for a in applied])
