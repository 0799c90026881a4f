"""`hf-dscale bench`: plain greedy generate() vs speculative decoding, side by side in one process."""

from __future__ import annotations

import argparse

from ..evaluation import BENCH_METHODS
from ..engine.plan import BRANCH_POLICIES
from .common import add_cut_arg, add_model_args, describe_machine, emit_report, load_drafter, load_models


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="tau, speedup and exactness of a drafter on a prompt file")
    add_model_args(p)
    p.add_argument("--vp-drafter", default=None, help="variable-prefix drafter (method d2sd)")
    p.add_argument("--method", choices=BENCH_METHODS, default="auto",
                   help="auto: what custom_generate does with no method options (the engine's plan chooses for the "
                        "device); dscale: the drafter's block, verified as a chain; dscale-tree: that block plus the K best "
                        "alternatives from the drafter's own distributions, verified as one token tree; d2sd: plus "
                        "a variable-prefix drafter's re-drafted branches (--vp-drafter)")
    p.add_argument("--num-branches", type=int, default=4, help="d2sd, dscale-tree: branches per cycle (K)")
    p.add_argument("--branch-policy", choices=BRANCH_POLICIES, default="ranked",
                   help="d2sd: ranked = the K best (boundary, token) branch starts, several per boundary allowed; "
                        "distinct = one per boundary, the VP drafter's best token unlike the first draft's; "
                        "vp = the VP drafter's argmax everywhere (the paper's rule)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="dscale-tree, d2sd: add a prompt lookup's proposal (the tokens that followed the latest earlier "
                        "occurrence of the last few tokens) to each tree")
    p.add_argument("--peers", action="store_true",
                   help="compare every way to decode, interleaved per prompt in one process: plain generate() "
                        "(eager, and with a static cache), transformers' prompt lookup, transformers' DFlash "
                        "(speculation_type='dflash', where it taps the right layers), assistant_model=, and "
                        "hf_dscale's dscale, dscale-tree, dscale-tree-lookup and, with --vp-drafter, d2sd "
                        "(replaces --method and --prompt-lookup)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="decode the prompts in left-padded batches of this size and report the method's tokens/s "
                        "against the same method one prompt at a time and plain batched generate() (with --method)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the verify forward compiled, or not (custom_generate(compile=...); default: the plan's, "
                        "compiled on a GPU, eager on a CPU; tens of seconds to compile once, reported as compile_s "
                        "apart from decode time); with --peers, --compile adds plain generate() compiled by "
                        "transformers with a static cache, and the plan's method compiled")
    p.add_argument("--cpu-linear", action=argparse.BooleanOptionalAction, default=None,
                   help="on a CPU, verify with hf_dscale's kernel for the matrix products, or torch's "
                        "(custom_generate(cpu_linear=...); default: whichever the plan measures cheaper per width)")
    p.add_argument("--direct-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="verify by running the target's weights without its modules (Llama-family float32 targets), "
                        "or through its own forward (custom_generate(direct_forward=...); default: whichever the "
                        "plan measures cheaper per width)")
    add_cut_arg(p, tree=True)
    p.add_argument("--prompts", required=True, help="JSON lines with a `prompt` field (chat template applied)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="PNG histogram of tokens committed per target forward (with "
                                                 "--peers: tokens/s of every peer)")
    p.set_defaults(func=main)


def _pyplot():
    """matplotlib's pyplot on a file-only backend; checked before a bench starts, not after it has run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError('--plot needs matplotlib: pip install matplotlib (or hf_dscale[plot]), or leave out --plot') \
            from error
    return plt


def _plot(histogram: dict, path: str, title: str) -> None:
    plt = _pyplot()
    keys = sorted(int(k) for k in histogram)
    plt.figure(figsize=(6, 3.5))
    plt.bar(keys, [histogram[str(k)] for k in keys])
    plt.xlabel("tokens committed per target forward")
    plt.ylabel("cycles")
    plt.title(title)
    plt.tight_layout()
    plt.savefig(path, dpi=120)


def _prompt_ids(args, tokenizer, device) -> list:
    """(id, input ids [1, P]) for the first --limit prompts of --prompts, chat template applied."""
    import torch

    from ..training.data import read_prompts, render_prompt

    return [(row["id"], torch.tensor([render_prompt(tokenizer, row["prompt"])], device=device))
            for row in read_prompts(args.prompts, args.limit)]


def _method_options(args, target) -> dict:
    """The keyword arguments of `bench_speculative` / `bench_batched` that --method and its options ask for."""
    options = {"draft_confidence": args.draft_confidence}
    if args.method == "d2sd":
        options |= dict(vp_drafter=load_drafter(args.vp_drafter, target), num_branches=args.num_branches,
                        branch_policy=args.branch_policy)
    elif args.method == "dscale-tree":
        options |= dict(num_branches=args.num_branches)
    if args.prompt_lookup:
        options |= dict(prompt_lookup=True)
    if args.compile is not None:
        options |= dict(compile=args.compile)
    if args.cpu_linear is not None:
        options |= dict(cpu_linear=args.cpu_linear)
    if args.direct_forward is not None:
        options |= dict(direct_forward=args.direct_forward)
    return options


def main(args) -> int:
    from tqdm.auto import tqdm

    from ..evaluation import bench_speculative

    if args.peers:
        return _peers(args)
    if (args.method == "d2sd") != (args.vp_drafter is not None):
        raise ValueError("--method d2sd needs --vp-drafter PATH (a variable-prefix drafter); dscale and "
                         "dscale-tree take none.")
    if args.prompt_lookup and args.method in ("auto", "dscale"):
        raise ValueError("--prompt-lookup adds a branch to a token tree: use --method dscale-tree (or d2sd).")
    if args.batch_size > 1:
        return _batched(args)
    if args.plot:
        _pyplot()
    target, tokenizer, drafter = load_models(args)
    extra = _method_options(args, target)
    prompts = _prompt_ids(args, tokenizer, target.device)
    bar = tqdm(total=len(prompts), desc=f"bench {args.method}", unit="prompt")
    result = bench_speculative(target, drafter, prompts, args.max_new_tokens, args.method,
                               on_prompt=lambda i: bar.update(1), **extra)
    bar.close()
    report = result.to_json()
    plan = result.stats.plan  # measured once before the run (at its warm-up), not again
    report.update(command=args.command_line, target=args.target, drafter=args.drafter, vp_drafter=args.vp_drafter,
                  prompts=args.prompts, max_new_tokens=args.max_new_tokens, prompt_lookup=plan.prompt_lookup,
                  draft_confidence=plan.draft_confidence, min_drafts=plan.min_drafts,
                  verify_costs_ms=None if plan.verify_costs is None else {
                      str(w): round(1000 * s, 2) for w, s in plan.verify_costs.items()},
                  verify_forward=plan.verify_path,
                  compile_widths=None if plan.compile_widths is None else list(plan.compile_widths),
                  verify_head_transposed=list(plan.transposed or ()),
                  draft_vocab_size=drafter.config.draft_vocab_size,
                  device=str(target.device),
                  dtype=str(target.dtype),
                  machine=describe_machine(target.device))
    emit_report(report, args.json)
    if args.plot:
        _plot(report["acceptance_histogram"], args.plot, f"{args.method}: tau = {report['tau']:.2f}")
    return 0 if report["identical"] else 1


def _peers(args) -> int:
    from tqdm.auto import tqdm

    from ..evaluation import bench_peers, peers_for

    if args.method != "auto" or args.prompt_lookup:
        raise ValueError("--peers runs every method (d2sd too, with --vp-drafter): leave out --method and "
                         "--prompt-lookup.")
    if args.plot:
        _pyplot()
    target, tokenizer, drafter = load_models(args)
    vp_drafter = load_drafter(args.vp_drafter, target) if args.vp_drafter else None
    confidence = args.draft_confidence
    peers = peers_for(target, drafter, vp_drafter, num_branches=args.num_branches, draft_confidence=confidence,
                      compile=bool(args.compile))
    prompts = _prompt_ids(args, tokenizer, target.device)
    bar = tqdm(total=len(prompts), desc=f"bench {len(peers)} peers", unit="prompt")
    result = bench_peers(target, peers, prompts, args.max_new_tokens, on_prompt=lambda i: bar.update(1))
    bar.close()
    report = {"command": args.command_line, "target": args.target, "drafter": args.drafter,
              "vp_drafter": args.vp_drafter, "prompts": args.prompts, "n_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "draft_confidence": confidence,
              "num_branches": args.num_branches, **result, "device": str(target.device), "dtype": str(target.dtype),
              "machine": describe_machine(target.device)}
    emit_report(report, args.json)
    if args.plot:
        plt = _pyplot()
        names = list(result["peers"])
        plt.figure(figsize=(7, 3.5))
        plt.barh(names[::-1], [result["peers"][n]["tokens_per_s"] for n in names[::-1]])
        plt.xlabel("tokens/s (greedy, batch 1)")
        plt.title(f"{len(prompts)} prompts of {args.prompts}")
        plt.tight_layout()
        plt.savefig(args.plot, dpi=120)
    return 0 if all(peer["identical"] for peer in result["peers"].values()) else 1


def _batched(args) -> int:
    from tqdm.auto import tqdm

    from ..evaluation import bench_batched

    target, tokenizer, drafter = load_models(args)
    options = _method_options(args, target)
    prompts = _prompt_ids(args, tokenizer, target.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = tqdm(total=len(prompts) // args.batch_size, desc=f"bench {args.method} at batch {args.batch_size}",
               unit="batch")
    result = bench_batched(target, drafter, prompts, args.batch_size, args.max_new_tokens, args.method,
                           pad_token_id=pad, on_batch=lambda g: bar.update(1), **options)
    bar.close()
    report = {"command": args.command_line, "method": args.method, "target": args.target, "drafter": args.drafter,
              "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, **result, "device": str(target.device),
              "dtype": str(target.dtype), "machine": describe_machine(target.device)}
    emit_report(report, args.json)
    return 0 if result["identical"] else 1
