"""Before each step of a compiled graph, check the ranks run one SPMD program on agreeing inputs.

SPMD is exact only when the ranks agree on what they share; if they do not,
the collectives still match and the gradients are silently wrong (a
``Replicate()`` input of another batch size on one rank, another value, a
rank-dependent Python scalar or branch). So on every call of a compiled graph
each rank posts, through `torch_hca.runtime.exchange`:

* the graph's program digest (its code and constants; Dynamo bakes Python
  scalars and branches into it), compared with every rank;
* each tensor input's local shape and dtype, compared with every rank (shards
  are even, so every rank holds the same local shape; an input cut by shares,
  ``hca.Shard(d, shares=...)``, holds rows in proportion to them);
* a digest of each input's bytes, compared with the ranks that must hold the
  same piece: all of them for a ``Replicate()`` input, a buffer or a Python
  scalar Dynamo passes as an input; for a sharded input, the ranks at the same
  mesh coordinate on every dimension it is sharded over;
* where the program draws random numbers (dropout), a digest of the default
  generators' states: every rank must draw what one device would
  (`torch_hca.compiler.randomness`), so ranks seeded apart cannot train on;

and a difference is a `CheckError` naming the input, the ranks and what each
holds. Option ``input_check``: ``"values"`` (the default, all of the above on
every call), ``"shapes"`` (no byte digests after the first call) or
``"first"`` (the whole check on the first call only; an input cut by shares
has its shapes compared on every call, since its gradients are weighted by
them); the generators are
compared wherever the byte digests are.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor

from torch_hca._torch_private import (
    graph_arg_example,
    graph_arg_is_python_scalar,
    graph_arg_is_tensor_property,
    graph_arg_source,
)
from torch_hca.errors import CheckError
from torch_hca.spmd.placements import dtype_str
from torch_hca.runtime.exchange import needs_exchange, post
from torch_hca.compiler.randomness import generator_digest
from torch_hca.compiler.logical import ENTER, decode, decode_shares, mesh_of
from torch_hca.spmd.shares import rows_agree, smallest_whole


@dataclass(frozen=True)
class Input:
    """One graph input the ranks must agree on."""

    index: int  # its position in the graph's arguments
    name: str  # where the user's program took it from
    sharded_dims: tuple[int, ...]  # mesh dimensions it is split over: peers there hold other pieces
    # Cut by shares (torch_hca.spmd.shares): (mesh dim, tensor dim, shares); its pieces' rows are in
    # proportion to the shares rather than equal.
    uneven: tuple[int, int, tuple[int, ...]] | None = None

    def describe(self) -> str:
        return self.name if not self.sharded_dims else f"{self.name} (sharded over mesh dims {list(self.sharded_dims)})"


def graph_inputs(gm: fx.GraphModule) -> tuple[list[Input], Any]:
    """The inputs of a sharded module's graph to agree on, and its mesh; none for per-rank code.

    Compared: forward arguments that enter the logical program (with their
    layout), registered buffers (hca replicates them) and Python numbers.
    Not compared: parameters (DTensors start equal and stay so) and arguments
    the plan leaves alone (``inputs=[..., None]``: per-rank data). A graph with
    no entering value is per-rank code (`hca.collectives`): its inputs may
    differ by design, so nothing is compared.
    """
    markers = list(gm.graph.find_nodes(op="call_function", target=ENTER))
    if not markers:
        return [], None
    inputs, mesh = [], mesh_of(markers[0].args[3])
    for index, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        if isinstance(graph_arg_example(node), DTensor):
            continue
        name = graph_arg_source(node)
        enters = [u for u in node.users if u.target is ENTER]
        if enters:
            layout, shares = decode(enters[0].args[1]), decode_shares(enters[0].args[1])
            uneven = next(((d, layout[d].dim, s) for d, s in enumerate(shares) if s is not None), None)
            inputs.append(Input(index, name, tuple(d for d, p in enumerate(layout) if p.is_shard()), uneven))
        elif "._buffers[" in name or graph_arg_is_python_scalar(node):
            inputs.append(Input(index, name, ()))
    return inputs, mesh


def program_digest(gm: fx.GraphModule) -> str:
    """A digest of the graph's code and tensor constants: equal on ranks that traced the same program.

    The code is read without the size and offset inputs the program never uses: under dynamic
    shapes Dynamo passes a view's nonzero storage offset as one (``x.chunk(n)[rank]``: on every
    rank but rank 0), and the program is the same without it."""
    h = hashlib.blake2b(_code_without_unused_sizes(gm).encode(), digest_size=8)
    for name, buf in sorted(list(gm.named_buffers()) + list(gm.named_parameters())):
        h.update(name.encode())
        h.update(_bytes_digest(buf).encode())
    return h.hexdigest()


def _code_without_unused_sizes(gm: fx.GraphModule) -> str:
    # Every rank's code comes from a copy, unused inputs or not, so all are written the same way.
    graph, copies = fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for node in gm.graph.find_nodes(op="placeholder"):
        if not node.users and graph_arg_is_tensor_property(node):
            graph.erase_node(copies[node])
    return graph.python_code("self").src


def _bytes_digest(t: torch.Tensor) -> str:
    """A cryptographic digest of the tensor's bytes (for the program's constants, hashed once)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return hashlib.blake2b(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


def _value_digest(t: torch.Tensor) -> str:
    """A checksum of the tensor's bytes for the per-call check, computed by torch where the
    tensor lives (5x faster than hashing its bytes in Python: this runs every step).

    Two sums over its 32-bit words (plain, and weighted by position), exact in int64: any one
    changed word changes the first, a swap of two the second. Not a defence against a crafted
    input, which the check does not claim; an accidental difference (another batch, a NaN,
    a rank-dependent value) changes it.
    """
    t = t.detach().contiguous().view(-1)
    words = t.view(torch.uint8)
    pad = (-words.numel()) % 4
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    words = words.view(torch.int32).to(torch.int64)
    return f"{int(words.sum()):x}.{int(words.dot(_weights(words.numel(), words.device))):x}"


@functools.lru_cache(maxsize=16)
def _weights(n: int, device: torch.device) -> torch.Tensor:
    """1..n as int64: the same inputs come back every step."""
    return torch.arange(1, n + 1, dtype=torch.int64, device=device)


def _shape_dtype(text: str) -> tuple[list[int], str]:
    """The inverse of `_describe_value`'s first part: ``"[2, 16] float32"`` -> ([2, 16], "float32")."""
    shape, _, dtype = text.rpartition(" ")
    return [int(n) for n in shape.strip("[]").split(",") if n.strip()], dtype


def _describe_value(v: Any, digest: bool) -> tuple[str, str]:
    """(shape and dtype, digest of the value) of one graph argument."""
    if isinstance(v, torch.Tensor):
        return f"{list(v.shape)} {dtype_str(v.dtype)}", _value_digest(v) if digest else "-"
    return type(v).__name__, repr(v) if digest else "-"


# Why every rank must make each call of a module whose parameters are stored split, and the fix:
# said by this check and by an eager call's own (torch_hca.api.sharded_forward).
EVERY_RANK_CALLS = (
    "a module with parameters stored split needs every rank in each call, compiled or eager (its collectives "
    "pair up across the ranks). Evaluate on every rank (each on its own rows), or save the model and evaluate "
    "it on one device (docs/huggingface.md)"
)


class InputAgreement:
    """Called with a graph's arguments before each call: raises unless every rank agrees on them."""

    def __init__(self, gm: fx.GraphModule, what: str, mode: str):
        self.what, self.mode = what, mode
        self.inputs, self.mesh = graph_inputs(gm)
        self.program = program_digest(gm)
        self.code = gm.code
        self.calls = 0
        self.draws: list[str] = []  # the program's random draws, set once it is lifted
        self._coordinates: dict[int, tuple[int, ...]] | None = None

    def post(self, args: list[Any]) -> Callable[[], None] | None:
        """Post this rank's view of the call without waiting; the returned `verify()` waits for
        the peers' and raises on a difference (None: nothing to check on this call).

        Between the two the caller may run work that cannot hang on a mismatch (a forward
        without collectives), so that the peers' posts arrive meanwhile."""
        first = self.calls == 0
        self.calls += 1
        # Rows cut by shares are weighted by the shares: their proportion is checked on every call.
        uneven = any(i.uneven is not None for i in self.inputs)
        if self.mesh is None or not needs_exchange() or (self.mode == "first" and not first and not uneven):
            return None
        digest = first or self.mode == "values"
        generators = generator_digest(self.mesh.device_type) if digest and self.draws else "-"
        text = "\n".join(
            [f"{self.what}\t{self.program}\t{generators}"]
            + ["\t".join(_describe_value(args[i.index], digest)) for i in self.inputs]
        )
        posted = post("step", text, range(dist.get_world_size()))

        def verify() -> None:
            texts = posted.collect(f"{self.what}, input check")
            texts[dist.get_rank()] = text
            # Every rank judges every pair, so all reach the same verdict (none goes on to wait for the others).
            ranks = sorted(texts)
            lines = {r: texts[r].split("\n") for r in ranks}
            for a in ranks:
                for b in ranks[ranks.index(a) + 1 :]:
                    self._compare(a, lines[a], b, lines[b])

        return verify

    def _compare(self, a: int, ours: list[str], b: int, theirs: list[str]) -> None:
        our_what, our_program, our_generators = ours[0].split("\t")
        their_what, their_program, their_generators = theirs[0].split("\t")
        if our_what != their_what and "eager call" in our_what + their_what:
            raise CheckError(
                f"{self.what}: rank {a} runs {our_what} while rank {b} runs {their_what}: {EVERY_RANK_CALLS}"
            )
        if our_what != their_what:
            raise CheckError(
                f"{self.what}: rank {a} runs {our_what} while rank {b} runs {their_what}: the ranks recompiled "
                "differently (another input shape or Python value on one rank) or take different branches; give "
                "every rank the same program and inputs of the same local shapes"
            )
        if len(ours) == len(theirs):
            for inp, mine, other in zip(self.inputs, ours[1:], theirs[1:]):
                self._compare_shapes(inp, a, mine.split("\t")[0], b, other.split("\t")[0])
        if our_program != their_program:
            self._one_row(a, ours, b, theirs)
            raise CheckError(
                f"{self.what}: rank {a} and rank {b} traced different programs from the same code (digest "
                f"{our_program} vs {their_program}): a Python value or branch depends on the rank (e.g. "
                "`x * rank` or `if rank == 0:` in forward). Pass rank-dependent data as a sharded input instead"
            )
        if our_generators != their_generators:
            raise CheckError(
                f"{self.what}: the program draws random numbers ({'; '.join(self.draws[:3])}) and rank {a}'s default "
                f"random number generator differs from rank {b}'s (digest {our_generators} vs {their_generators}), so "
                "their dropout masks would differ where they must be one. Seed every rank the same before the first "
                "step (torch.manual_seed(seed) with one seed on every rank), and draw rank-local randomness (data "
                "shuffling, augmentation) from a torch.Generator of its own"
            )
        same_piece = self._same_piece(a, b)
        for inp, mine, other in zip(self.inputs, ours[1:], theirs[1:]):
            shape, our_value = mine.split("\t")
            their_value = other.split("\t")[1]
            if our_value != their_value and same_piece(inp):
                raise CheckError(
                    f"{self.what}: input {inp.describe()} differs between rank {a} and rank {b} (digest "
                    f"{our_value} vs {their_value}, both {shape}), but they must hold the same value: a "
                    "Replicate() input, a buffer or a Python scalar is one value on every rank. Pass the same "
                    "value on every rank, or lay the input out as Shard(d) if each rank holds its own part of it"
                )

    def _compare_shapes(self, inp: Input, a: int, mine: str, b: int, theirs: str) -> None:
        """Equal local shapes and dtypes, but for an input cut by shares: rows in proportion to them."""
        if inp.uneven is None or mine == theirs:
            if mine != theirs:
                raise CheckError(
                    f"{self.what}: input {inp.describe()} is {mine} on rank {a} but {theirs} on rank {b}; every "
                    "rank must pass a piece of the same local shape and dtype (shards are even): give each rank the "
                    "same batch size, or cut the batch by shares: inputs=hca.Shard(0, shares=...)"
                )
            return
        mesh_dim, dim, shares = inp.uneven
        (shape_a, dtype_a), (shape_b, dtype_b) = _shape_dtype(mine), _shape_dtype(theirs)
        rows_a, rows_b = shape_a.pop(dim), shape_b.pop(dim)
        ca, cb = self._coordinate(a)[mesh_dim], self._coordinate(b)[mesh_dim]
        if (shape_a, dtype_a) != (shape_b, dtype_b) or not rows_agree(shares, {ca: rows_a, cb: rows_b}):
            raise CheckError(
                f"{self.what}: input {inp.describe()} is {mine} on rank {a} but {theirs} on rank {b}; it is cut "
                f"by shares {':'.join(map(str, shares))} on dim {dim}, so rank {a} (share {shares[ca]}) and rank "
                f"{b} (share {shares[cb]}) hold rows in that proportion and agree on every other dim and the dtype: "
                f"give each rank its share of a batch of a multiple of {smallest_whole(shares)} rows"
            )

    def _one_row(self, a: int, ours: list[str], b: int, theirs: list[str]) -> None:
        """Ranks whose programs differ because one holds a single row of an input cut by shares."""
        for inp, mine, other in zip(self.inputs, ours[1:], theirs[1:]):
            if inp.uneven is None:
                continue
            rows = {r: _shape_dtype(text.split("\t")[0])[0][inp.uneven[1]] for r, text in ((a, mine), (b, other))}
            if 1 in rows.values() and len(set(rows.values())) > 1:
                raise CheckError(
                    f"{self.what}: input {inp.describe()} holds {rows[a]} row(s) on rank {a} and {rows[b]} on rank "
                    f"{b}; a piece of one row is traced for exactly one row (torch.compile specializes sizes 0 and 1), "
                    "so the ranks' programs differ: give every rank at least 2 rows (a batch of a multiple of "
                    f"{2 * smallest_whole(inp.uneven[2])} rows)"
                )

    def _coordinate(self, rank: int) -> tuple[int, ...]:
        if self._coordinates is None:  # rank -> mesh coordinate, once: this runs every step
            mesh = self.mesh.mesh
            self._coordinates = {int(mesh[c]): c for c in itertools.product(*(range(n) for n in mesh.shape))}
        return self._coordinates[rank]

    def _same_piece(self, a: int, b: int) -> Callable[[Input], bool]:
        """Whether ranks `a` and `b` hold the same piece of an input (same coordinate on its sharded dims)."""
        ca, cb = self._coordinate(a), self._coordinate(b)
        return lambda inp: all(ca[d] == cb[d] for d in inp.sharded_dims)
