"""`python -m torch_hca bench`: hca next to other ways of training the same model.

Every contestant trains an identical copy of the same model (same initial
weights) on the same batches for the same steps (forward, backward, SGD
step), on local gloo ranks, one contestant after another in one run:

- ``hca``: ``torch.compile(model, backend="hca")`` on the ``hca.sharded`` model;
- ``hca_noschedule``: the same with ``options={"schedule": False}`` (the
  traced order, no overlap or bucketing), on the data-parallel and FSDP models;
- the layouts hca could have chosen instead, each compiled by hca (`ALTERNATIVES`;
  ``regret`` is hca's step time over the fastest of them):
  ``hca_dtensor_layout`` (``options={"layout": "dtensor"}``: DTensor's per-op
  choices on the same storage) and ``hca_dp`` (the plan's storage with the batch
  split, ``inputs=Shard(0), outputs=Shard(0)``: weights gathered where hca's solver
  finds it cheaper; on the tensor-parallel models, the other models split the batch
  already). An alternative that emits hca's own program counts at hca's time;
- ``hca_dp_replicated``: plain data parallel, the model replicated and the batch
  split (``hca.sharded({}, inputs=Shard(0), outputs=Shard(0))``), on every model but
  the data-parallel one (whose hca contestant is exactly this): a different storage,
  shown for reference and not counted in the regret;
- ``dtensor_eager``: the same ``hca.sharded`` DTensor model, not compiled;
- ``dtensor_inductor``: the same DTensor model under plain ``torch.compile`` (Inductor);
- ``expert`` (tensor-parallel models): ``parallelize_module`` with
  ColwiseParallel / RowwiseParallel, and SequenceParallel for the norms of the
  block and the LM, as production trainers write it;
- ``ddp`` (data-parallel model): ``DistributedDataParallel`` on the plain module;
- ``fsdp2`` (FSDP model): ``torch.distributed.fsdp.fully_shard`` per layer and at the root.

Bytes, collectives and peak memory come from one profiled step
(`torch_hca.tools.step_profile`), counted the same way for every contestant.
Contestants are built and take their first step one after another, then
take their timed steps in ``rounds`` round-robin rounds (``--rounds``), so a
burst of load on a shared machine falls on all of them alike.

The command is `main`; the parts live next to it: the models and contestants
(`bench_models`), running and measuring them on the ranks (`bench_run`), the
--profile breakdown (`bench_profile`), the speed targets read overall and
round by round (`bench_targets`) and the tables (`bench_tables`).
"""

from __future__ import annotations

import json
import os

from ..errors import HCAError
from torch_hca.runtime.launch import launch
from torch_hca.compiler.options import Options

# Also the names tests and users reach through the command's module.
from .bench_models import ALTERNATIVES, CONTESTANTS, MODELS, _expert, applies, specs  # noqa: F401
from .bench_profile import BREAKDOWN, step_breakdown, traced_step  # noqa: F401
from .bench_run import RunConfig, merge, run_rank
from .bench_tables import tables, wrong_gradients
from .progress import Progress


def main(
    world_size: int = 2,
    steps: int = 5,
    models=MODELS,
    contestants=CONTESTANTS,
    json_path=None,
    tiny: bool = False,
    default_costs: bool = False,
    *,
    recalibrate: bool = False,
    rounds: int = 1,
    profile_dir: str | None = None,
    round_ms: float = 250.0,
    hca_options: str | dict | None = None,
) -> int:
    models, contestants = list(models), list(contestants)
    hca_options = _hca_options(hca_options)
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for c in contestants:
        if c not in CONTESTANTS:
            raise SystemExit(f"unknown contestant {c!r}; choose from {', '.join(CONTESTANTS)}")
    if steps < 1:
        raise SystemExit("--steps must be >= 1")
    if rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if not round_ms >= 0:
        raise SystemExit("--round-ms must be >= 0")
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
    if hca_options:
        print(f"hca contestants' options: {json.dumps(hca_options, sort_keys=True)}")
    timed = f"{steps}+ timed" + (f" x {rounds} rounds" if rounds > 1 else "")
    print(
        f"torch_hca bench: {', '.join(models)} x {', '.join(contestants)} on {world_size} local gloo ranks, "
        f"{'tiny models, ' if tiny else ''}1 warm-up + {timed} + {2 if profile_dir else 1} profiled step(s)\n",
        flush=True,
    )
    cfg = RunConfig(
        steps,
        tiny,
        default_costs,
        recalibrate,
        rounds,
        os.path.abspath(profile_dir) if profile_dir else None,
        round_ms / 1e3,
        hca_options,
    )
    progress = Progress("bench")  # one line per model and contestant, on stderr
    progress(f"starting {world_size} local gloo ranks")
    records = merge(launch(run_rank, world_size, models, contestants, cfg, progress.since, timeout_s=1800.0))
    progress(f"done: {len(records)} records")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=2)
    print(tables(records))
    if json_path:
        print(f"\nwrote {len(records)} records to {os.path.abspath(json_path)}")
    if profile_dir:
        print(f"wrote Chrome traces ({{model}}_{{contestant}}_rank{{r}}.json) to {os.path.abspath(profile_dir)}")
    # A wrong gradient is the worst thing a run can show: the exit status says so too.
    return 1 if wrong_gradients(records) else 0


def _hca_options(given: str | dict | None) -> dict:
    """``--hca-options``: a JSON object of backend options, checked here (a typo would
    otherwise fail every hca row one by one)."""
    if given is None:
        return {}
    try:
        options = json.loads(given) if isinstance(given, str) else given
    except json.JSONDecodeError as e:
        raise SystemExit(f"--hca-options is not JSON ({e}); give an object such as '{{\"bucket_cap_mb\": 2}}'")
    if not isinstance(options, dict):
        raise SystemExit(f"--hca-options must be a JSON object, not {type(options).__name__}")
    try:
        Options.parse(options)
    except HCAError as e:
        raise SystemExit(f"--hca-options: {e}")
    return options
