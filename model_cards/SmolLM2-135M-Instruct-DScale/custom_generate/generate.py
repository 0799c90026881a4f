"""Hub-style `custom_generate`: speculative decoding with a DScale/DFlash drafter (batch size >= 1).

    target.generate(**inputs, custom_generate="<this repo or folder>", trust_remote_code=True,
                    drafter=drafter, max_new_tokens=256)

Add `vp_drafter=<variable-prefix drafter>` for D²SD, or `draft_tree=True` for a token tree of the drafter's
own alternatives (token-tree verification; `num_branches`, `branch_policy`, `tree_kernel`, `draft_confidence` and
`prompt_lookup`, a prompt lookup's proposal as one more path of each tree, pass through as well).

transformers calls `generate(model=target, **all generate() arguments)`; we run `generate()` again with
hf_dscale's decode loop plugged in, so that logits processors and stopping criteria are prepared as usual.
"""

from hf_dscale.generation.custom_generate import generate as speculative_generate


def generate(model, drafter=None, assistant_model=None, streamer=None, **kwargs):
    drafter = drafter if drafter is not None else assistant_model  # either name selects the drafter
    return model.generate(custom_generate=speculative_generate, drafter=drafter, streamer_=streamer, **kwargs)
