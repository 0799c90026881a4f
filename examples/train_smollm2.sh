#!/usr/bin/env bash
# Distil a DScale and a DFlash drafter for SmolLM2-135M-Instruct on the same data and budget, then bench both.
# PROMPTS: folder with train_*.jsonl / eval_*.jsonl prompt files (JSON lines with a `prompt` field).
set -euo pipefail
PROMPTS=${PROMPTS:?set PROMPTS to the folder holding train_gsm8k_prompts.jsonl etc.}
RUNS=${RUNS:-runs}
STEPS=${STEPS:-2000}

# One data cache with the 9 DScale taps; the 5 DFlash taps are a subset for a 30-layer target.
hf-dscale train --target smollm2 --prompts "$PROMPTS/train_gsm8k_prompts.jsonl" "$PROMPTS/train_sharegpt_prompts.jsonl" \
    --data-dir "$RUNS/data" --fusion layerwise --out "$RUNS/dscale" --steps "$STEPS"
hf-dscale train --target smollm2 --data-dir "$RUNS/data" --fusion shared --out "$RUNS/dflash" --steps "$STEPS"

for d in dscale dflash; do
  hf-dscale bench --target smollm2 --drafter "$RUNS/$d" --method dscale --prompts "$PROMPTS/eval_gsm8k.jsonl" \
      --limit 100 --max-new-tokens 256 --json "$RUNS/$d-gsm8k.json" --plot "$RUNS/$d-gsm8k.png"
done
