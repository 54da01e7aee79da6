"""Random draws in a compiled program: every rank draws what one device would.

A program that draws random numbers (dropout, above all) equals the single-device
program only if every rank draws the numbers one device would and keeps its piece
of them. Left to DTensor on a CPU mesh, each rank draws a tensor of its local
shape from its own generator: a replicated value gets another mask on each rank
where the ranks' generators differ (the "replicated" parameters' gradients then
differ too, silently), and the shards of a sharded value get one mask repeated
where they agree. So:

* the lift pass places ``F.dropout`` as `torch_hca.compiler.dtensor_ops.dropout`, which
  draws the whole noise tensor as ``F.dropout`` does on one CPU and multiplies
  each rank's piece by its piece of it (the same numbers as one device, bit for
  bit, for a contiguous value); any other op that draws from a value laid out
  over the mesh is refused by name (`UnsupportedError`), not run per rank;
* a program that draws adds its ranks' default generators to the input check
  (`torch_hca.compiler.checks.agreement`): ranks seeded differently are a `CheckError` on the
  first call, not a silent divergence;
* compiling draws nothing, the backward draws nothing (AOTAutograd's partition
  copies unread draws into it: `without_dead_draws`), and the refinement check and
  ``layout="tune"`` put the generators back after their extra runs: a step draws
  what one device's would.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from torch_hca.errors import CheckError

# The torch functions the lift pass places as `dtensor_ops.dropout`.
DROPOUT = (F.dropout,)


def draws(op) -> bool:
    """Whether an aten op draws from a random number generator (its schema's tag)."""
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def graph_draws(gm: fx.GraphModule | None) -> list[str]:
    """The aten ops of a traced graph that draw random numbers, by name."""
    if gm is None:
        return []
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and draws(n.target)]


def without_dead_draws(backward: fx.GraphModule, what: str) -> fx.GraphModule:
    """`backward` less the draws nobody reads, which AOTAutograd's partition copies there
    from the forward.

    FX keeps them as side effects, and each would advance the generator a second time
    per step: the next step's masks would no longer be one device's. A draw the backward
    does read would be a mask drawn anew, not the forward's: a `CheckError`.
    """
    dead = [n for n in backward.graph.nodes if n.op == "call_function" and draws(n.target) and not n.users]
    for node in reversed(dead):
        backward.graph.erase_node(node)
    read = [n.name for n in backward.graph.nodes if n.op == "call_function" and draws(n.target)]
    if read:
        raise CheckError(
            f"{what}: the backward draws random numbers of its own ({', '.join(read)}), not the "
            "forward's masks; its gradients would be wrong. Please report this model"
        )
    if dead:
        backward.graph.eliminate_dead_code()
        backward.recompile()
    return backward


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.drawn: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if draws(func):
            self.drawn.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording_draws() -> Iterator[list[str]]:
    """The aten ops that draw random numbers while the block runs (DTensors' and plain tensors')."""
    recorder = _Recorder()
    with recorder:
        yield recorder.drawn


def generator_states(device_type: str) -> tuple:
    """The default generators' states: the CPU's, and every CUDA device's on a CUDA mesh."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if device_type == "cuda" else None


def set_generator_states(device_type: str, states: tuple) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])


def generator_digest(device_type: str) -> str:
    """A short digest of the default generators' states, for ranks to compare."""
    cpu, cuda = generator_states(device_type)
    h = hashlib.blake2b(cpu.numpy().tobytes(), digest_size=8)
    for state in cuda or ():
        h.update(state.numpy().tobytes())
    return h.hexdigest()


def generators_kept(device_type: str):
    """Put the default generators back after the block (compiling): torch's `fork_rng`."""
    devices = range(torch.cuda.device_count()) if device_type == "cuda" else []
    return torch.random.fork_rng(devices=devices)
