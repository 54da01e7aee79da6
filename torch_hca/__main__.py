"""Command line: `python -m torch_hca demo`, `bench`, `calibrate` and `verify`.

`demo` and `bench` print their results on stdout and one progress line per step of work,
with the elapsed time, on stderr (`torch_hca.tools.progress`).
"""

from __future__ import annotations

import argparse
import math
import sys


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "verify":
        return _verify(parser, args)
    if args.command == "bench":
        return _bench(parser, args)
    if args.command == "calibrate":
        from torch_hca.api.calibrate import calibrate_local

        print(calibrate_local(args.world_size))
        return 0
    if args.command == "demo":
        from .tools.demo import main as demo_main

        return demo_main(args.world_size)
    return 2


def _parser() -> argparse.ArgumentParser:
    """The command line's parser: one subcommand each for calibrate, demo, bench and verify."""
    parser = argparse.ArgumentParser(prog="python -m torch_hca", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    calibrate = sub.add_parser(
        "calibrate",
        help="measure the cost model on local gloo ranks and cache it (what the compiler uses by default on this host)",
    )
    calibrate.add_argument("--world-size", type=int, default=2)
    demo = sub.add_parser("demo", help="train a tensor-parallel transformer block on local gloo ranks")
    demo.add_argument("--world-size", type=int, default=2)
    bench = sub.add_parser("bench", help="hca next to DTensor eager/Inductor, hand-written TP, DDP and FSDP2")
    _bench_arguments(bench)
    verify = sub.add_parser(
        "verify",
        help="check a strategy file (hca.report(c).save_strategy) by the move table "
        "alone: kinds, bytes, transposes, group order, Partial reduced (docs/strategy.md)",
    )
    verify.add_argument("strategy", help="path of the strategy file")
    verify.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="also check the file against the model FACTORY() returns (a plain or hca.sharded module; "
        "without a process group, one fake of the file's world size and mesh is made first): its "
        "parameters, and with --inputs every value's logical shape and dtype, re-traced",
    )
    verify.add_argument(
        "--inputs",
        metavar="MODULE:FACTORY",
        help="with --model: FACTORY() returns the example inputs (a tensor or a tuple: the whole tensors "
        "one device would see) the model is re-traced on; every rank is then also run in float64 against "
        "the model (the numerical refinement check)",
    )
    verify.add_argument("--no-numeric", action="store_true", help="with --inputs: skip the numerical refinement check")
    return parser


def _verify(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`verify STRATEGY [--model M:F [--inputs M:F]]`: the file alone, or also against the model."""
    from torch_hca.verify import verify as verify_file

    if args.model is None:
        if args.inputs is not None or args.no_numeric:
            parser.error("--inputs and --no-numeric go with --model")
        result = verify_file(args.strategy, raise_on_failure=False)
    else:
        _fake_world_for(args.strategy)
        model = _factory(parser, args.model, "--model")()
        inputs = _factory(parser, args.inputs, "--inputs")() if args.inputs is not None else None
        numeric = inputs is not None and not args.no_numeric
        result = verify_file(model, args.strategy, inputs, numeric=numeric, raise_on_failure=False)
    print(result)
    return 0 if result.ok else 1


def _factory(parser: argparse.ArgumentParser, spec: str, flag: str):
    """`module:name` (a dotted name inside the module allowed) as the callable it names."""
    import importlib

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        parser.error(f"{flag} {spec!r}: write MODULE:FACTORY, e.g. {flag} mypkg.models:make")
    try:
        target = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        parser.error(f"{flag} {spec!r}: {e} (is the module on PYTHONPATH?)")
    if not callable(target):
        parser.error(f"{flag} {spec!r} names a {type(target).__name__}, not a function to call")
    return target


def _fake_world_for(strategy: str) -> None:
    """No process group yet: a fake one of the file's world size and its mesh, so that a factory
    returning an hca.sharded module can build it (graph only: no collective runs in verify)."""
    import json

    import torch.distributed as dist

    if dist.is_initialized():
        return
    try:
        with open(strategy) as f:
            mesh = json.load(f)["mesh"]
        shape, names = tuple(mesh["shape"]), mesh.get("dim_names")
    except (OSError, ValueError, KeyError, TypeError):
        return  # verify names what is wrong with the file
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch_hca.runtime.mesh import init_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    init_mesh(shape, tuple(names) if names else None, device_type="cpu")


def _bench_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--world-size", type=int, default=2)
    bench.add_argument(
        "--steps", type=int, default=5, help="timed steps per contestant and round, at least (see --round-ms)"
    )
    bench.add_argument(
        "--round-ms",
        type=float,
        default=250.0,
        metavar="MS",
        help="a model whose contestants' steps are short takes more timed steps per round, enough "
        "to fill about MS milliseconds each (default 250; 0: --steps exactly)",
    )
    bench.add_argument(
        "--models", default=None, help="comma-separated (default: all; with --real: gpt2_small, llama_100m)"
    )
    bench.add_argument(
        "--contestants", default=None, help="comma-separated (default: all); each runs on the models it applies to"
    )
    bench.add_argument(
        "--hetero",
        action="store_true",
        help="rank 1 made k times slower (k = 1, 1.5, 2, 3): the even split, the split by shares "
        'and the balanced bound (docs/heterogeneous.md, "Measuring heterogeneity here")',
    )
    bench.add_argument(
        "--real",
        action="store_true",
        help="real-size Hugging Face models (GPT-2 small, a 125M-parameter Llama) and their own "
        "contestants: one device, DDP, FSDP2, parallelize_module, hca (docs/bench.md, "
        '"Real-size models"); with --tiny, the same families at tiny sizes',
    )
    bench.add_argument(
        "--rows",
        default=None,
        metavar="R[,R...]",
        help="--real: rows per rank, each a table of its own (default 4); --hetero: the global batch's rows (default 24)",
    )
    bench.add_argument("--seq", type=int, default=None, help="--real: tokens per row (default 64; 16 with --tiny)")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the records as JSON")
    bench.add_argument("--tiny", action="store_true", help="tiny models (a smoke test, not a measurement)")
    bench.add_argument(
        "--default-costs",
        action="store_true",
        help="hca uses the cost model's documented defaults (default: this machine's calibration, "
        "if a quiet one is cached for this host, world size, backend and torch version, else "
        "measured for this run only: the bench never writes the cache; docs/bench.md)",
    )
    bench.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure the calibration for this run even when one is cached (the cache is left as it is)",
    )
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="K",
        help="timed steps in K round-robin rounds of --steps steps per contestant, medians over "
        "all (default 1: each contestant's timed steps in one block)",
    )
    bench.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="one more step per contestant under torch.profiler: Chrome traces "
        "DIR/{model}_{contestant}_rank{r}.json and a table of where the step time goes",
    )
    bench.add_argument(
        "--hca-options",
        default=None,
        metavar="JSON",
        help="options added to every hca contestant's, as JSON (e.g. '{\"bucket_cap_mb\": 2}'): "
        "rerun a comparison under other knobs; recorded per hca record as hca_options",
    )


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`bench`: the synthetic models, `--real` ones or `--hetero`."""
    from .tools.bench import main as bench_main
    from .tools.bench_models import CONTESTANTS, MODELS

    split = lambda s: [v.strip() for v in s.split(",") if v.strip()]
    if args.hetero:
        return _bench_hetero(parser, args)
    if args.real:
        from .tools.bench_real import REAL_CONTESTANTS, REAL_MODELS, main as real_main

        return real_main(
            args.world_size,
            args.steps,
            split(args.models or ",".join(REAL_MODELS)),
            split(args.contestants or ",".join(REAL_CONTESTANTS)),
            args.json,
            args.tiny,
            args.default_costs,
            rows=split(args.rows or "4"),
            seq=args.seq,
            recalibrate=args.recalibrate,
            rounds=args.rounds,
            profile_dir=args.profile,
            round_ms=args.round_ms,
            hca_options=args.hca_options,
        )
    if args.rows is not None or args.seq is not None:
        parser.error("--rows and --seq go with --real")
    return bench_main(
        args.world_size,
        args.steps,
        split(args.models or ",".join(MODELS)),
        split(args.contestants or ",".join(CONTESTANTS)),
        args.json,
        args.tiny,
        args.default_costs,
        recalibrate=args.recalibrate,
        rounds=args.rounds,
        profile_dir=args.profile,
        round_ms=args.round_ms,
        hca_options=args.hca_options,
    )


def _bench_hetero(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`bench --hetero`: 2 ranks, its own model and k's; reads --json, --tiny, --rounds (when > 1) and --rows."""
    from .tools.bench_hetero import main as hetero_main

    others = {
        "--real": args.real,
        "--models": args.models,
        "--contestants": args.contestants,
        "--seq": args.seq,
        "--profile": args.profile,
        "--hca-options": args.hca_options,
        "--world-size": args.world_size != 2,
    }
    given = [flag for flag, value in others.items() if value]
    if given:
        parser.error(
            f"--hetero runs its own model on 2 ranks; it takes --json, --tiny, --rounds and --rows, not {', '.join(given)}"
        )
    batch = None
    if args.rows is not None:  # with --hetero: the global batch's rows, one number
        if not args.rows.isdigit() or int(args.rows) < 8 or int(args.rows) % 2:
            parser.error(f"--hetero --rows {args.rows}: give the global batch's rows, one even number of at least 8")
        batch = int(args.rows)
    return hetero_main(args.json, args.tiny, rounds=args.rounds if args.rounds > 1 else None, batch=batch)


if __name__ == "__main__":
    sys.exit(main())
