"""Batched, exact speculative decoding with `custom_generate` (rows advance at their own pace).

    python examples/batched_custom_generate.py
"""

import torch

from hf_dscale import DScaleDrafter
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.models.targets import load_target

target, tokenizer = load_target()
drafter = DScaleDrafter.from_pretrained("model_cards/SmolLM2-135M-Instruct-DScale")
tokenizer.padding_side = "left"
questions = ["What is 12 + 30?", "Name three prime numbers.", "Write a haiku about the sea."]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
         for q in questions]
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

stats = DecodeStats()
out = target.generate(**batch, max_new_tokens=96, do_sample=False, custom_generate=custom_generate,
                      drafter=drafter, dscale_stats=stats)
plain = target.generate(**batch, max_new_tokens=96, do_sample=False)
print("identical to plain generate():", torch.equal(out, plain), f"| tau = {stats.tau:.2f}")
for row in out:
    print("-", tokenizer.decode(row[batch["input_ids"].shape[1]:], skip_special_tokens=True)[:120])
