"""Write the training prompt mix for a SmolLM2 drafter: GSM8K questions interleaved with code-related ShareGPT turns.

    python examples/make_prompt_mix.py --data examples/data --out mix.jsonl

Two GSM8K train questions, then one ShareGPT first turn that mentions code (a keyword match, below), repeated
until the shorter source runs out; the GSM8K remainder follows. Deterministic: the same files give the same
mix, so a data folder built from it can be regenerated and resumed (`hf-dscale train --prompts mix.jsonl`
answers the prompts in this order and skips the ids it already holds). Only `train_*` files are read.
"""

import argparse
import os
import re

from hf_dscale.training.data import read_prompts, write_prompts

# A ShareGPT turn counts as code-related when it names a language, a tool or a programming word.
CODE = re.compile(
    r"\b(python|java|javascript|typescript|c\+\+|c#|rust|golang|sql|html|css|react|node\.?js|bash|shell script|"
    r"regex|json|api|function|code|coding|program|script|class|compile|debug|bug|algorithm|implement)\b",
    re.IGNORECASE,
)


def mix(gsm8k: list[dict], sharegpt: list[dict], per_code: int = 2) -> list[dict]:
    """`per_code` GSM8K rows, then one code-related ShareGPT row, ...; then the rest of GSM8K."""
    code = [row for row in sharegpt if CODE.search(row["prompt"])]
    out = []
    for i, row in enumerate(code):
        out += gsm8k[i * per_code : (i + 1) * per_code]
        if len(gsm8k) < (i + 1) * per_code:
            break
        out.append(row)
    return out + gsm8k[len(code) * per_code :]


parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True, help="folder with train_gsm8k_prompts.jsonl and train_sharegpt_prompts.jsonl")
parser.add_argument("--out", required=True)
parser.add_argument("--per-code", type=int, default=2, help="GSM8K questions per code-related ShareGPT turn")
args = parser.parse_args()

rows = mix(read_prompts(os.path.join(args.data, "train_gsm8k_prompts.jsonl")),
           read_prompts(os.path.join(args.data, "train_sharegpt_prompts.jsonl")), args.per_code)
write_prompts(args.out, rows)
print(f"{len(rows)} prompts -> {args.out}")
