"""Which moves of a value cut unevenly (torch.chunk's pieces, torch_hca.spmd.chunks) the solver may make.

A parameter stored so is read only as stored: the buckets its gathers and gradient reductions
would join assume equal pieces. Of an activation's moves only the gather is built: DTensor's own
padded all_gather (each piece padded to the largest, the padding dropped after; the report's
bytes are the padded ones, what goes on the wire), whose transpose is a replicated cotangent's
local chunk. Everything else (a scatter, a reduce-scatter of a partial cotangent, a move to
another dim) is priced out, and a program that still needs one is refused by name.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate

from torch_hca.compiler.layout.candidates import Layout, Op
from torch_hca.errors import UnsupportedError
from torch_hca.spmd.chunks import is_uneven, uneven_mesh_dims
from torch_hca.spmd.collective_kinds import cotangent_letter
from torch_hca.spmd.placements import layout_str

# What a move not built costs the solver: no program it may pick makes one.
UNEVEN_MOVE_S = 1e6


def moves_uneven(producer: Op, out: Layout, key: tuple, sizes: tuple[int, ...]) -> bool:
    """Whether reading `producer`'s value, written as `out`, with `key` = (layout, varying) moves
    uneven pieces in a way not built."""
    q, varying = key
    if out == q:
        return False
    shape = producer.value.shape
    if is_uneven(shape, q, sizes):
        return True
    uneven = uneven_mesh_dims(shape, out, sizes)
    if not uneven:
        return False
    if producer.is_parameter or not all(isinstance(q[m], Replicate) for m in uneven):
        return True
    # The gather's transpose: a replicated cotangent's local chunk; a partial one's reduce-scatter is not built.
    return producer.requires_grad and any(cotangent_letter(q[m], varying[m]) != "R" for m in uneven)


def refuse_uneven_moves(reads: list[tuple[Op, Op, int]], choice: dict, sizes: tuple[int, ...]) -> None:
    """Refuse a chosen program with a move not built, naming the value, the reader and the fix.
    `reads`: (producer, consumer, the consumer's input slot) per edge of the program."""
    for producer, consumer, slot in reads:
        out, read = choice[producer.node].output, choice[consumer.node]
        key = (read.inputs[slot], read.varying)
        if moves_uneven(producer, out, key, sizes):
            raise UnsupportedError(
                f"layout: {producer.node.name} (shape {tuple(producer.value.shape)}) is cut unevenly "
                f"({layout_str(out)}, torch.chunk's pieces) and {consumer.node.name} needs it as {layout_str(key[0])}; "
                "torch_hca reads a parameter cut unevenly only as stored and moves an uneven value only by "
                "gathering it whole. Store the parameter it comes from so that its sharded dimension divides "
                "by the mesh, or replicate it"
            )
