"""`hca.step`: an optimizer step taken on every rank or on none.

A non-finite gradient on one rank (a NaN in its piece of the batch, an
overflow in its shard) must not let that rank step while the others skip, or
let every rank step into NaN parameters unnoticed. `step` checks each rank's
local gradient pieces, agrees on the verdict through `torch_hca.runtime.exchange`
(named ranks, no collective) and then steps everywhere, raises everywhere,
or skips everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch_hca.errors import CheckError, OptionsError
from torch_hca.runtime.exchange import exchange, needs_exchange
from torch_hca.compiler.parameters import parameter_name

NONFINITE = ("raise", "skip_step")


def _nonfinite_gradients(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the parameters whose local gradient piece holds a NaN or an infinity."""
    named, flags = [], []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            named.append(parameter_name(p) or f"param_groups[{g}]['params'][{i}]")
            flags.append(torch.isfinite(local).all())
    if not flags:
        return []
    finite = torch.stack(flags).tolist()  # one device sync for all of them
    return [name for name, ok in zip(named, finite) if not ok]


def step(optimizer: torch.optim.Optimizer, *, nonfinite: str = "raise") -> bool:
    """``optimizer.step()`` on every rank if every rank's gradients are finite; return whether it stepped.

    ``nonfinite``: ``"raise"`` (default): a `CheckError` on every rank naming
    the ranks and parameters with non-finite gradients, no rank stepped;
    ``"skip_step"``: every rank zeroes its gradients and returns False.
    Every rank must call it once per step.
    """
    if nonfinite not in NONFINITE:
        raise OptionsError(f"hca.step: nonfinite={nonfinite!r}; use one of {NONFINITE}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OptionsError(f"hca.step: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    bad = _nonfinite_gradients(optimizer)
    verdicts = {0: ",".join(bad)}
    if needs_exchange():
        verdicts = exchange("optimizer_step", ",".join(bad), range(dist.get_world_size()), "hca.step")
        verdicts[dist.get_rank()] = ",".join(bad)
    culprits = {rank: text.split(",") for rank, text in sorted(verdicts.items()) if text}
    if not culprits:
        optimizer.step()
        return True
    if nonfinite == "raise":
        where = "; ".join(
            f"rank {r}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}" for r, names in culprits.items()
        )
        raise CheckError(
            f"hca.step: non-finite gradients ({where}); no rank took the optimizer step. Look for the NaN or "
            "infinity in that rank's inputs, loss or learning rate, or pass nonfinite='skip_step' to skip such steps"
        )
    optimizer.zero_grad()
    return False
