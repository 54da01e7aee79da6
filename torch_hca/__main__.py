"""Command line: `python -m torch_hca demo`, `bench` and `calibrate`.

`demo` and `bench` print their results on stdout and one progress line per step of work,
with the elapsed time, on stderr (`torch_hca.tools.progress`).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from .tools.bench_models import CONTESTANTS, MODELS

    parser = argparse.ArgumentParser(prog="python -m torch_hca", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    calibrate = sub.add_parser("calibrate", help="measure the cost model on local gloo ranks and cache it "
                               "(what the compiler uses by default on this host)")
    calibrate.add_argument("--world-size", type=int, default=2)
    demo = sub.add_parser("demo", help="train a tensor-parallel transformer block on local gloo ranks")
    demo.add_argument("--world-size", type=int, default=2)
    bench = sub.add_parser("bench", help="hca next to DTensor eager/Inductor, hand-written TP, DDP and FSDP2")
    bench.add_argument("--world-size", type=int, default=2)
    bench.add_argument("--steps", type=int, default=5,
                       help="timed steps per contestant and round, at least (see --round-ms)")
    bench.add_argument("--round-ms", type=float, default=250.0, metavar="MS",
                       help="a model whose contestants' steps are short takes more timed steps per round, enough "
                            "to fill about MS milliseconds each (default 250; 0: --steps exactly)")
    bench.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: all)")
    bench.add_argument("--contestants", default=",".join(CONTESTANTS),
                       help="comma-separated (default: all); each runs on the models it applies to")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the records as JSON")
    bench.add_argument("--tiny", action="store_true", help="tiny models (a smoke test, not a measurement)")
    bench.add_argument("--default-costs", action="store_true",
                       help="hca uses the cost model's documented defaults (default: this machine's calibration, "
                            "cached for this host, world size, backend and torch version, else measured and "
                            "cached first; docs/bench.md)")
    bench.add_argument("--recalibrate", action="store_true",
                       help="measure the calibration again even when cached (and replace the cache)")
    bench.add_argument("--rounds", type=int, default=1, metavar="K",
                       help="timed steps in K round-robin rounds of --steps steps per contestant, medians over "
                            "all (default 1: each contestant's timed steps in one block)")
    bench.add_argument("--profile", default=None, metavar="DIR",
                       help="one more step per contestant under torch.profiler: Chrome traces "
                            "DIR/{model}_{contestant}_rank{r}.json and a table of where the step time goes")
    bench.add_argument("--hca-options", default=None, metavar="JSON",
                       help="options added to every hca contestant's, as JSON (e.g. '{\"bucket_cap_mb\": 2}'): "
                            "rerun a comparison under other knobs; recorded per hca record as hca_options")
    args = parser.parse_args(argv)
    if args.command == "bench":
        from .tools.bench import main as bench_main

        split = lambda s: [v.strip() for v in s.split(",") if v.strip()]
        return bench_main(args.world_size, args.steps, split(args.models), split(args.contestants), args.json,
                          args.tiny, args.default_costs, recalibrate=args.recalibrate, rounds=args.rounds,
                          profile_dir=args.profile, round_ms=args.round_ms, hca_options=args.hca_options)
    if args.command == "calibrate":
        from .calibrate import calibrate_local

        print(calibrate_local(args.world_size))
        return 0
    if args.command == "demo":
        from .tools.demo import main as demo_main

        return demo_main(args.world_size)
    return 2


if __name__ == "__main__":
    sys.exit(main())
