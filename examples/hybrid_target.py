"""A random Qwen3.5-shaped hybrid target of SmolLM2's size, and a random drafter for it, to measure the engine on
a target with Gated DeltaNet layers (three linear-attention layers to one full-attention layer) where no trained
hybrid fits this machine:

    python examples/hybrid_target.py runs/qwen35-random
    hf-dscale bench --target runs/qwen35-random --drafter runs/qwen35-random/drafter \
        --prompts examples/data/eval_humaneval.jsonl --limit 3 --max-new-tokens 128 --peers

The target takes SmolLM2's tokenizer and chat template, so the project's prompt files apply. Its weights are random
and small (`--init-range`, 0.012), so its greedy output soon repeats one token: there the prompt lookup's proposals are
right and the random drafter's are not, so the figure is what a hybrid verify costs against the plain steps it saves,
and tau says how much the lookup found.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from hf_dscale import DScaleConfig, DScaleDrafter
from hf_dscale.models.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the target (its drafter goes in OUT/drafter)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers, every fourth full attention")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-range", type=float, default=0.012,
                        help="standard deviation of the random weights (larger: less repetitive output)")
    args = parser.parse_args()
    _, tokenizer = load_target("smollm2")  # SmolLM2's tokenizer and chat template
    torch.manual_seed(args.seed)
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
        initializer_range=args.init_range, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    target = AutoModelForCausalLM.from_config(config).eval()
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    drafter_config = DScaleConfig.from_target(target.config, num_hidden_layers=2, block_size=16,
                                              mask_token_id=tokenizer.pad_token_id or 0)
    DScaleDrafter(drafter_config).save_pretrained(os.path.join(args.out, "drafter"))
    params = sum(p.numel() for p in target.parameters()) / 1e6
    print(f"wrote {args.out}: {type(target).__name__}, {params:.0f}M parameters, layer types "
          f"{sorted(set(config.layer_types))}; a random drafter in {args.out}/drafter")


if __name__ == "__main__":
    main()
