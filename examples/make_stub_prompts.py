"""Write a prompt mix with code-shaped answers: GSM8K and MATH train questions posed as Python function stubs.

    python examples/make_stub_prompts.py --data examples/data --out stubs.jsonl

The ShareGPT turns that mention code run out after about 1,900 rows, and a drafter trained on GSM8K answers
alone drafts code poorly. Posing a word problem as the docstring of a function stub makes the target answer
in Python, so its self-distilled answers are code. Rows alternate: a GSM8K question as a stub, a GSM8K
question as it is (from `--plain-from` on, ids the earlier mixes did not reach), a MATH problem as a stub, a
GSM8K question as it is, ... Deterministic, so a data folder built from it resumes by prompt id. Only
`train_*` files are read; stub rows get ids prefixed with `stub-`.

When the plain questions run out, `--stubs-after` appends stubs alone (a GSM8K question, then a MATH problem)
from that row index of each file on (never before the first row the interleave left unposed), for a mix with
more code than the interleave allows.
"""

import argparse
import os
import textwrap

from hf_dscale.training.data import read_prompts, write_prompts

# (signature, doctest line) pairs, rotated so that not every stub looks the same.
STUBS = [
    ("def solve() -> int:", ""),
    ("def answer() -> float:", ">>> answer()"),
    ("def compute_result():", ""),
]


def as_stub(question: str, i: int) -> str:
    signature, doctest = STUBS[i % len(STUBS)]
    body = textwrap.fill(" ".join(question.split()), width=96, initial_indent='    """ ', subsequent_indent="    ")
    lines = [signature, body] + (["    " + doctest] if doctest else []) + ['    """', ""]
    return "\n".join(lines)


parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True, help="folder with train_gsm8k_prompts.jsonl and train_math_prompts.jsonl")
parser.add_argument("--out", required=True)
parser.add_argument("--plain-from", type=int, default=3567, help="first GSM8K row index used as a plain prompt")
parser.add_argument("--plain-skip", default="4411:7035", help="GSM8K row range (start:stop) not to use as plain prompts")
parser.add_argument("--stubs-after", type=int, default=None,
                    help="after the interleave, append GSM8K and MATH stubs alone from this row index on")
args = parser.parse_args()

gsm8k = read_prompts(os.path.join(args.data, "train_gsm8k_prompts.jsonl"))
math = read_prompts(os.path.join(args.data, "train_math_prompts.jsonl"))
skip = range(*map(int, args.plain_skip.split(":")))
plain = [row for i, row in enumerate(gsm8k) if i >= args.plain_from and i not in skip]
rows = []
for i in range(min(len(plain) // 2, len(math), args.plain_from)):
    rows.append({"id": "stub-" + gsm8k[i]["id"], "prompt": as_stub(gsm8k[i]["prompt"], i)})
    rows.append(plain[2 * i])
    rows.append({"id": "stub-" + math[i]["id"], "prompt": as_stub(math[i]["prompt"], i)})
    rows.append(plain[2 * i + 1])
if args.stubs_after is not None:
    for i in range(max(args.stubs_after, len(rows) // 4), min(len(gsm8k), len(math))):
        rows.append({"id": "stub-" + gsm8k[i]["id"], "prompt": as_stub(gsm8k[i]["prompt"], i)})
        rows.append({"id": "stub-" + math[i]["id"], "prompt": as_stub(math[i]["prompt"], i)})
write_prompts(args.out, rows)
print(f"{len(rows)} prompts -> {args.out}")
