"""Command line: `python -m torch_hca demo` and `python -m torch_hca bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_hca", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tensor-parallel transformer block on local gloo ranks")
    demo.add_argument("--world-size", type=int, default=2)
    bench = sub.add_parser("bench", help="hca next to DTensor eager/Inductor, hand-written TP, DDP and FSDP2")
    bench.add_argument("--world-size", type=int, default=2)
    bench.add_argument("--steps", type=int, default=5)
    bench.add_argument("--models", default="mlp,block,lm,dp,fsdp", help="comma-separated (default: all)")
    bench.add_argument("--contestants", default="hca,hca_noschedule,dtensor_eager,dtensor_inductor,expert,ddp,fsdp2",
                       help="comma-separated (default: all); each runs on the models it applies to")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the records as JSON")
    bench.add_argument("--tiny", action="store_true", help="tiny models (a smoke test, not a measurement)")
    bench.add_argument("--calibrate", action="store_true",
                       help="hca uses cost-model figures hca.calibrate() measures on the ranks first "
                            "(default: the cost model's documented defaults, for run-to-run stable layouts)")
    args = parser.parse_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        split = lambda s: [v.strip() for v in s.split(",") if v.strip()]
        return bench_main(args.world_size, args.steps, split(args.models), split(args.contestants), args.json,
                          args.tiny, args.calibrate)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.world_size)
    return 2


if __name__ == "__main__":
    sys.exit(main())
