"""Keep the prompts of a JSON lines file that match a pattern, for a targeted self-distillation run.

    python examples/select_prompts.py examples/data/train_sharegpt_prompts.jsonl --pattern "python|def " \
        --out sharegpt_python.jsonl

The pattern is a regular expression searched in each prompt, case-insensitively; rows keep their order, `id` and
`prompt`. `hf-dscale train --prompts sharegpt_python.jsonl ...` then answers them (resumable by id). Only
`train_*` files are read: the `eval_*` sets measure acceptance on prompts never trained on.
"""

import argparse
import os
import re

from hf_dscale.training.data import read_prompts, write_prompts


def select(rows: list[dict], pattern: str) -> list[dict]:
    match = re.compile(pattern, re.IGNORECASE)
    return [row for row in rows if match.search(row["prompt"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="a train_*.jsonl prompt file")
    parser.add_argument("--pattern", required=True, help="regular expression, searched case-insensitively")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not os.path.basename(args.prompts).startswith("train_"):
        parser.error(f"{args.prompts} is not a train_* file; drafters are trained on training prompts only.")
    rows = select(read_prompts(args.prompts), args.pattern)
    write_prompts(args.out, rows)
    print(f"{len(rows)} prompts matching {args.pattern!r} written to {args.out}")


if __name__ == "__main__":
    main()
