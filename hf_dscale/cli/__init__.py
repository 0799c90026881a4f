"""`hf-dscale`: the command line (the only place that prints)."""

from __future__ import annotations

import argparse
import sys

from . import bench, run, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-dscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (run, bench, train):
        module.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        print(f"hf-dscale {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
