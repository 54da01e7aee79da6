"""Command line: `python -m torch_hca demo`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_hca", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tensor-parallel transformer block on local gloo ranks")
    demo.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.world_size)
    return 2


if __name__ == "__main__":
    sys.exit(main())
