"""D²SD: the DScale drafter's block plus variable-prefix branches, verified as one token tree.

    python examples/d2sd_generate.py
"""

import torch

from hf_dscale import DScaleDrafter
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.models.targets import load_target

target, tokenizer = load_target()
drafter = DScaleDrafter.from_pretrained("model_cards/SmolLM2-135M-Instruct-DScale")
vp_drafter = DScaleDrafter.from_pretrained("model_cards/SmolLM2-135M-Instruct-DScale-VP")
text = tokenizer.apply_chat_template([{"role": "user", "content": "A train travels 60 km in 1.5 hours. What is its "
                                       "average speed?"}], tokenize=False, add_generation_prompt=True)
inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)

stats = DecodeStats()
out = target.generate(**inputs, max_new_tokens=128, do_sample=False, custom_generate=custom_generate,
                      drafter=drafter, vp_drafter=vp_drafter, num_branches=4, dscale_stats=stats)
plain = target.generate(**inputs, max_new_tokens=128, do_sample=False)
print("identical to plain generate():", torch.equal(out, plain))
print(f"tau = {stats.tau:.2f} tokens per target forward, {sum(stats.verified) / len(stats.verified):.0f} tree tokens")
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
