"""Model cards in the Hub's format (YAML front matter + markdown), filled from measured bench reports."""

from __future__ import annotations


def _bench_table(benches: list[dict]) -> str:
    lines = [
        "| drafter | prompts | n | tau | tokens/s | plain tokens/s | speedup | identical | stage ms (draft / verify / other) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in benches:
        r, s = b["report"], b["report"]["stage_ms"]
        lines.append(
            f"| {b['label']} | {r.get('prompts_name', r.get('prompts', ''))} | {r['n_prompts']} | {r['tau']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['baseline_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['identical']} | "
            f"{s['draft']:.0f} / {s['verify']:.0f} / {s['other']:.0f} |"
        )
    return "\n".join(lines)


def _intro(config, target_name: str) -> str:
    borrowed = (f"It has no embedding or LM head of its own: it borrows the target's, so it only works with "
                f"`{target_name}`.")
    if getattr(config, "prefix_prior", None) is not None:
        return (
            f"A **variable-prefix drafter** for `{target_name}` (D²SD's second drafter): given the anchor and the first "
            f"i tokens of a block, it fills the other {config.block_size - 1} - i in one forward pass, conditioned on "
            "the target's hidden states. D²SD asks it to re-draft from the first drafter's most likely rejection "
            "points and the target verifies every candidate in one pass, as a token tree. Output is exactly the "
            f"target's (greedy) or has the target's distribution (sampling). {borrowed}"
        )
    return (
        f"A block-diffusion **drafter** for `{target_name}`: it proposes {config.block_size - 1} tokens in one forward "
        "pass, conditioned on the target's hidden states, and the target verifies them in one pass. Output is exactly "
        f"the target's (greedy) or has the target's distribution (sampling). {borrowed}"
    )


def _draft_vocab_row(config) -> str:
    size = getattr(config, "draft_vocab_size", None)
    if not size:
        return ""
    return (f"| draft vocabulary | {size:,} of the {config.vocab_size:,} target tokens, the most frequent in the training "
            "answers, plus each generation's own tokens (verification uses the whole vocabulary) |\n")


def _usage(config, name: str, target_name: str) -> str:
    if getattr(config, "prefix_prior", None) is not None:
        return f"""```python
from transformers import AutoModel, AutoModelForCausalLM
from hf_dscale.generation import custom_generate
target = AutoModelForCausalLM.from_pretrained(TARGET)  # {target_name}
drafter = AutoModel.from_pretrained(FIRST_DRAFTER, trust_remote_code=True)  # a block drafter for the same target
vp_drafter = AutoModel.from_pretrained("{name}", trust_remote_code=True)
out = target.generate(**inputs, custom_generate=custom_generate, drafter=drafter, vp_drafter=vp_drafter,
                      max_new_tokens=256, do_sample=False)
```"""
    return f"""```python
from transformers import AutoModel, AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained(TARGET)  # {target_name}
drafter = AutoModel.from_pretrained("{name}", trust_remote_code=True)
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256, do_sample=False)
```

With `hf_dscale` installed, batches run through `custom_generate`, the function or the hub-style repo
`hf-dscale-generate` (its folder ships in hf_dscale's `model_cards/`):

```python
from hf_dscale.generation import custom_generate
out = target.generate(**batch, custom_generate=custom_generate, drafter=drafter, max_new_tokens=256)
out = target.generate(**batch, custom_generate="hf-dscale-generate", trust_remote_code=True, drafter=drafter,
                      max_new_tokens=256)
```"""


def render_card(
    name: str,
    config,
    target_name: str,
    base_model: str,
    training: dict,
    benches: list[dict],
    notes: str = "",
) -> str:
    """The README.md of a drafter folder.

    Args:
        config: the drafter's `DScaleConfig`.
        training: free-form facts of the training run (data, budget, command).
        benches: dicts with `label`, `command` and `report` (the JSON written by `hf-dscale bench`).
    """
    method = "DScale (layer-wise fusion)" if config.fusion == "layerwise" else "DFlash (shared fusion)"
    prior = getattr(config, "prefix_prior", None)
    if prior is not None:
        method += f", variable-prefix training (prefix prior β = {prior}): the second drafter of D²SD"
    commands = "\n".join(f"# {b['label']}\n{b['command']}" for b in benches)
    training_lines = "\n".join(f"- **{k}**: {v}" for k, v in training.items())
    return f"""---
library_name: transformers
license: apache-2.0
base_model: {base_model}
pipeline_tag: text-generation
tags:
- speculative-decoding
- block-diffusion
- dscale
- dflash
- hf_dscale
---

# {name}

{_intro(config, target_name)}

| | |
|---|---|
| method | {method} |
| draft layers | {config.num_hidden_layers} (hidden {config.hidden_size}, {config.num_attention_heads} heads / {config.num_key_value_heads} KV heads) |
| target layers tapped | {list(config.target_layer_ids)} (id = output of decoder layer id = `hidden_states[id + 1]`) |
| block size | {config.block_size} (anchor + {config.block_size - 1} drafts) |
| mask token id | {config.mask_token_id} |
{_draft_vocab_row(config)}
## Usage

{_usage(config, name, target_name)}

## Training

{training_lines}

## Measured

Greedy, plain `generate()` and speculative decoding side by side in one process (`tau` = tokens committed per
target forward, bonus included):

{_bench_table(benches)}

```bash
{commands}
```

{notes}
"""


def render_dllm_card(name: str, config, training: dict, benches: list[dict], notes: str = "") -> str:
    """The README.md of a DiffusionLM folder; benches are `hf-dscale bench-dllm` reports."""
    rows = [
        "| method | task | seed | n | NFE (full + block) | accuracy | tokens/s | s/answer | query tokens / NFE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in benches:
        r = b["report"]
        rows.append(f"| {r['method']} | {r.get('task', '')} | {r.get('seed', '')} | {r['n_prompts']} | {r['nfe']:.1f} "
                    f"({r['nfe_full']:.1f} + {r['nfe_block']:.1f}) | {100 * r['accuracy']:.1f}% | "
                    f"{r['tokens_per_s']:.1f} | {r['seconds_per_answer']:.2f} | {r['query_tokens_per_nfe']:.0f} |")
    commands = "\n".join(b["command"] for b in benches)
    training_lines = "\n".join(f"- **{k}**: {v}" for k, v in training.items())
    style = "LLaDA-style (the logit at p predicts p)" if config.logits_shift == 0 else "Dream-style (shifted)"
    return f"""---
library_name: transformers
license: apache-2.0
pipeline_tag: text-generation
tags:
- diffusion-language-model
- masked-diffusion
- fast-dllm
- blockbatch
- hf_dscale
---

# {name}

A small **masked-diffusion language model** (bidirectional attention, {style}) trained from scratch by
`hf-dscale train-dllm` on the `{getattr(config, 'task', '?')}` task, to exercise diffusion-LM decoders: Fast-dLLM
(threshold 0.9, dual KV cache) and BlockBatch (batched branches of several block sizes). It fills an answer
region of {getattr(config, 'gen_length', '?')} masked tokens after the prompt.

| | |
|---|---|
| layers | {config.num_hidden_layers} (hidden {config.hidden_size}, {config.num_attention_heads} heads, MLP {config.intermediate_size}) |
| vocabulary | {config.vocab_size} word-level tokens (digits are single tokens); mask id {config.mask_token_id}, EOS id {config.eos_token_id} |
| dual KV cache | block forwards replace the block's K/V in place and attend to the cached prefix and suffix |

## Usage

```python
from transformers import AutoModel, AutoTokenizer
from hf_dscale.generation import dllm_generate
model = AutoModel.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}")
ids = tokenizer("[BOS] " + question, return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens={getattr(config, 'gen_length', 96)}, do_sample=False, custom_generate=dllm_generate,
                     dllm_method="blockbatch")  # or "fast-dllm"
```

## Training

{training_lines}

## Measured

Fresh held-out problems (a split never trained on), greedy, one problem at a time; NFE = model forwards per
answer (one batched forward = 1); both methods stop by the same rule (an EOS with no mask before it).

{chr(10).join(rows)}

```bash
{commands}
```

{notes}
"""
