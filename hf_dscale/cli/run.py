"""`hf-dscale run`: speculative generation on one prompt, with tau and the speedup over plain generate()."""

from __future__ import annotations

import argparse

from .common import DEFAULT_DRAFTER, add_cut_arg, add_model_args, describe_plan, load_models

DEFAULT_PROMPT = (
    "A baker makes 14 loaves of bread in the morning and twice as many in the afternoon. "
    "She sells all but 9 of them. How many loaves does she sell?"
)


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate with the drafter and report tau and speedup (default: SmolLM2 + shipped drafter)")
    add_model_args(p, drafter_default=DEFAULT_DRAFTER)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain", action="store_true",
                   help="verify the drafter's block as a chain (bench's --method dscale); default: the method the "
                        "engine's plan chooses for the device (bench's --method auto)")
    p.add_argument("--tree", action="store_true",
                   help="verify the drafter's block plus its own runner-up alternatives as one token tree "
                        "(bench's --method dscale-tree)")
    p.add_argument("--num-branches", type=int, default=4, help="--tree: branches per cycle (K)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="--tree: add a prompt lookup's proposal to each tree (bench's --prompt-lookup)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the verify forward compiled, or not (default: the plan's, compiled on a GPU, eager on a "
                        "CPU; tens of seconds to compile once; see bench's --compile)")
    p.add_argument("--cpu-linear", action=argparse.BooleanOptionalAction, default=None,
                   help="on a CPU, verify with hf_dscale's kernel for the matrix products, or torch's "
                        "(custom_generate(cpu_linear=...); default: whichever the plan measures cheaper per width)")
    p.add_argument("--direct-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="verify by running the target's weights without its modules (Llama-family float32 targets), "
                        "or through its own forward (custom_generate(direct_forward=...); default: whichever the "
                        "plan measures cheaper per width)")
    add_cut_arg(p)
    p.set_defaults(func=main)


def main(args) -> int:
    import torch

    from ..engine.plan import compile_by_default
    from ..evaluation import bench_speculative
    from ..training.data import render_prompt

    if args.prompt_lookup and args.chain:
        raise ValueError("--prompt-lookup adds a branch to a token tree: leave out --chain.")
    if args.chain and args.tree:
        raise ValueError("--chain and --tree choose opposite methods: pass one (or neither, for the plan's choice).")
    print(f"loading target {args.target} and drafter {args.drafter} ...", flush=True)
    target, tokenizer, drafter = load_models(args)
    ids = torch.tensor([render_prompt(tokenizer, args.prompt)], device=target.device)
    method, extra = "auto", {}
    if args.chain:
        method = "dscale"
    elif args.tree or args.prompt_lookup:
        method, extra = "dscale-tree", dict(num_branches=args.num_branches, prompt_lookup=args.prompt_lookup)
    if args.compile is not None:
        extra["compile"] = args.compile
    if args.cpu_linear is not None:
        extra["cpu_linear"] = args.cpu_linear
    if args.direct_forward is not None:
        extra["direct_forward"] = args.direct_forward
    if args.compile or (args.compile is None and compile_by_default(target.device)[0]):
        print("compiling the verify forward (once; tens of seconds on a CPU) ...", flush=True)
    result = bench_speculative(target, drafter, [("prompt", ids)], args.max_new_tokens, method,
                               draft_confidence=args.draft_confidence, **extra)
    report = result.to_json()
    cut = describe_plan(result.stats.plan)
    print(tokenizer.decode(result.outputs[0][0, ids.shape[1]:], skip_special_tokens=True))
    print(f"\nacceptance length tau = {report['tau']:.2f} tokens per target forward "
          f"({report['verify_tokens']:.1f} tokens verified per forward, {cut})")
    print(f"speculative {report['tokens_per_s']:.1f} tokens/s vs plain generate() {report['baseline_tokens_per_s']:.1f} "
          f"tokens/s: speedup {report['speedup']:.2f}x; identical to plain greedy: {report['identical']}")
    if report["compile_s"]:
        print(f"compiling took {report['compile_s']:.1f} s, once, not counted in the tokens/s")
    return 0 if report["identical"] else 1
