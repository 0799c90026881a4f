"""Hub-style `custom_generate`: speculative decoding with a DScale/DFlash drafter (batch size >= 1).

    target.generate(**inputs, custom_generate="<this repo or folder>", trust_remote_code=True,
                    drafter=drafter, max_new_tokens=256)

`drafter` is a drafter model or its folder / Hub id. With no other option the method is the one hf_dscale's plan
finds fastest for the device; add `vp_drafter=` for D²SD, or `draft_tree=` and `prompt_lookup=` to choose; every
option of `hf_dscale.generation.custom_generate` passes through.

transformers calls `generate(model=target, **all generate() arguments)`; this runs `generate()` again with
hf_dscale's decode loop plugged in, so that logits processors and stopping criteria are prepared as usual.
"""

from hf_dscale.generation.custom_generate import generate as speculative_generate


def generate(model, drafter=None, assistant_model=None, streamer=None, **kwargs):
    drafter = drafter if drafter is not None else assistant_model  # either name selects the drafter
    return model.generate(custom_generate=speculative_generate, drafter=drafter, streamer_=streamer, **kwargs)
