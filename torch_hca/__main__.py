"""Command line: `python -m torch_hca demo` and `python -m torch_hca bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_hca", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tensor-parallel transformer block on local gloo ranks")
    demo.add_argument("--world-size", type=int, default=2)
    bench = sub.add_parser("bench", help="hca next to DTensor eager/Inductor, hand-written TP and DDP")
    bench.add_argument("--world-size", type=int, default=2)
    bench.add_argument("--steps", type=int, default=5)
    bench.add_argument("--models", default="mlp,block,dp")
    bench.add_argument("--contestants", default="hca,dtensor_eager,dtensor_inductor,expert,ddp")
    bench.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        split = lambda s: [v.strip() for v in s.split(",") if v.strip()]
        return bench_main(args.world_size, args.steps, split(args.models), split(args.contestants), args.json)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.world_size)
    return 2


if __name__ == "__main__":
    sys.exit(main())
