"""`hf-dscale`: the command line (the only place that prints)."""

from __future__ import annotations

import argparse
import sys

from . import bench, card, dllm, export, kernels, run, sweep, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (run, bench, train, card, kernels, dllm, export, sweep):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = "hf-dscale " + " ".join(argv)  # quoted in reports next to the numbers
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        print(f"hf-dscale {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
