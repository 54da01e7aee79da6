"""Command line: `python -m torch_hca demo`, `bench`, `calibrate` and `verify`.

`demo` and `bench` print their results on stdout and one progress line per step of work,
with the elapsed time, on stderr (`torch_hca.tools.progress`).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "verify":
        from torch_hca.verify import verify as verify_file

        result = verify_file(args.strategy, raise_on_failure=False)
        print(result)
        return 0 if result.ok else 1
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
    return parser


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
        "--rows", default=None, metavar="R[,R...]", help="--real: rows per rank, each a table of its own (default 4)"
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
    """`bench --hetero`: 2 ranks, its own model and k's; reads --json, --tiny and --rounds (when > 1)."""
    from .tools.bench_hetero import main as hetero_main

    others = {
        "--real": args.real,
        "--models": args.models,
        "--contestants": args.contestants,
        "--rows": args.rows,
        "--seq": args.seq,
        "--profile": args.profile,
        "--hca-options": args.hca_options,
        "--world-size": args.world_size != 2,
    }
    given = [flag for flag, value in others.items() if value]
    if given:
        parser.error(
            f"--hetero runs its own model on 2 ranks; it takes --json, --tiny and --rounds, not {', '.join(given)}"
        )
    return hetero_main(args.json, args.tiny, rounds=args.rounds if args.rounds > 1 else None)


if __name__ == "__main__":
    sys.exit(main())
