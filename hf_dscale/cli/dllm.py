"""`hf-dscale train-dllm` and `hf-dscale bench-dllm`: a small diffusion LM on a checkable task, and
Fast-dLLM vs BlockBatch decoding on fresh held-out problems."""

from __future__ import annotations

import os


def add_parser(sub) -> None:
    t = sub.add_parser("train-dllm", help="train a small masked-diffusion LM on a checkable task (resumable)")
    t.add_argument("--task", default="arithmetic")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--gen-length", type=int, default=128, help="answer region G (a multiple of the block sizes)")
    t.add_argument("--hidden-size", type=int, default=256)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--logits-shift", type=int, default=0, choices=[0, 1], help="0 LLaDA-style, 1 Dream-style")
    t.add_argument("--block-fraction", type=float, default=0.0,
                   help="fraction of rows masked as block-wise decoders see them (kept prefix, masked block, masked rest)")
    t.add_argument("--save-every", type=int, default=250)
    t.add_argument("--seed", type=int, default=0, help="the training problems drawn (use a new one when continuing)")
    t.add_argument("--init-from", default=None,
                   help="continue from a trained DiffusionLM folder (its size and tokenizer; a fresh schedule). "
                   "With another --task, the new task's words are added to its vocabulary")
    t.add_argument("--device", default="auto")
    t.set_defaults(func=train_main)

    b = sub.add_parser("bench-dllm", help="NFE, accuracy and speed of Fast-dLLM or BlockBatch on held-out problems")
    b.add_argument("--model", required=True, help="a DiffusionLM folder (or LLaDA/Dream with its tokenizer)")
    b.add_argument("--method", required=True, choices=["fast-dllm", "blockbatch", "both"],
                   help="both: the two methods side by side, interleaved problem by problem (ratios in the report, "
                        "with what a BlockBatch block step costs against Fast-dLLM's and what it could cost to tie)")
    b.add_argument("--task", default=None, help="default: the task the model was trained on")
    b.add_argument("--seed", type=int, default=1, help="problems are drawn fresh from the held-out split")
    b.add_argument("--limit", type=int, default=100)
    b.add_argument("--gen-length", type=int, default=None, help="default: the model's training gen_length")
    b.add_argument("--block-size", type=int, default=32, help="Fast-dLLM block")
    b.add_argument("--block-sizes", default=None,
                   help="BlockBatch branches: comma-separated sizes, or 'paper' for the paper's set "
                   "(4,8,16,32,64,128); default: planned on this machine from measured step costs (the plan goes "
                   "into the report)")
    b.add_argument("--plan-prompts", type=int, default=16,
                   help="training-split problems the plan decodes to price each branch set (never the held-out ones)")
    b.add_argument("--plan-check-prompts", type=int, default=64,
                   help="more training-split problems the plan's chosen set must answer as well as Fast-dLLM "
                   "(sixteen judge accuracy poorly); 0: none")
    b.add_argument("--min-branches", type=int, default=2,
                   help="the fewest branches the plan keeps (1 lets it fall back to one block size: Fast-dLLM)")
    b.add_argument("--threshold", type=float, default=0.9)
    b.add_argument("--refresh-tokens", type=int, default=32,
                   help="BlockBatch's refresh interval with --block-sizes (a plan chooses its own)")
    b.add_argument("--refresh-rows", choices=("all", "leader"), default="all",
                   help="what BlockBatch's refresh runs with --block-sizes: every branch's row (the paper's, and a "
                   "planned run's) or the leader's alone, which every branch then takes")
    b.add_argument("--sync-threshold", type=int, default=8,
                   help="with --block-sizes: a BlockBatch branch this many tokens behind the leader copies its row "
                   "(the paper's 8; a plan chooses its own)")
    b.add_argument("--device", default="auto")
    b.add_argument("--host", choices=("auto", "c", "torch"), default="auto",
                   help="who does the decoders' bookkeeping between model calls: auto = the C library on a CPU "
                        "(built on first use), torch elsewhere")
    b.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")
    b.add_argument("--json", default=None)
    b.set_defaults(func=bench_main)


def train_main(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from ..models.dllm import DiffusionLM, DiffusionLMConfig
    from ..training.dllm_tasks import build_tokenizer
    from ..training.dllm_trainer import DLLMTrainConfig, extend_vocabulary, train_dllm
    from .common import pick_device, training_progress

    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    if args.init_from:
        from transformers import AutoTokenizer

        model = DiffusionLM.from_pretrained(args.init_from)
        tokenizer = AutoTokenizer.from_pretrained(args.init_from)
        if model.config.task != args.task:  # a new task: its vocabulary must extend the model's
            tokenizer, old = build_tokenizer(args.task), tokenizer
            extend_vocabulary(model, old, tokenizer, args.task)
        args.gen_length = model.config.gen_length
    else:
        tokenizer = build_tokenizer(args.task)
        config = DiffusionLMConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                                   intermediate_size=3 * args.hidden_size, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, mask_token_id=tokenizer.mask_token_id,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                   bos_token_id=tokenizer.bos_token_id, logits_shift=args.logits_shift,
                                   task=args.task, gen_length=args.gen_length)
        model = DiffusionLM(config)
    model = model.to(device)
    os.makedirs(args.out, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    cfg = DLLMTrainConfig(task=args.task, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                          gen_length=args.gen_length, seed=args.seed, block_fraction=args.block_fraction,
                          save_every=args.save_every)
    bar = tqdm(total=args.steps, desc=f"train-dllm {args.task}", unit="step")
    on_step = training_progress(bar, args.out)

    train_dllm(model, tokenizer, args.out, cfg, on_step)
    bar.close()
    print(f"model saved to {args.out}")
    return 0


def bench_main(args) -> int:
    import sys
    import time

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModel, AutoTokenizer

    from ..evaluation import bench_dllm
    from ..dllm import BLOCK_SIZES
    from ..models.dllm import DiffusionModel
    from ..training.dllm_tasks import make_problems
    from .common import describe_machine, emit_report, pick_device, pick_dtype, warn_if_slow_bf16

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise FileNotFoundError(f"No model at {args.model} (a folder with config.json, weights and a tokenizer).")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    warn_if_slow_bf16(device, *([f"--dtype {args.dtype}"] if dtype == torch.bfloat16 else []))
    model = AutoModel.from_pretrained(args.model, trust_remote_code=True, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dlm = DiffusionModel(model)
    task = args.task or getattr(model.config, "task", None)
    if task is None:
        raise ValueError("The model's config names no task: pass --task.")
    gen_length = args.gen_length or getattr(model.config, "gen_length", None) or 256
    problems = make_problems(task, args.limit, seed=args.seed, heldout=True)
    plan, plan_seconds = None, None
    if args.block_sizes == "paper":
        block_sizes = list(BLOCK_SIZES)
    elif args.block_sizes:
        block_sizes = [int(x) for x in args.block_sizes.split(",")]
    elif args.method == "fast-dllm":
        block_sizes = None
    else:
        start = time.perf_counter()
        plan = _plan(dlm, tokenizer, task, gen_length, device, args)
        plan_seconds = time.perf_counter() - start
        block_sizes = list(plan.block_sizes)
        print(_describe_plan(plan, plan_seconds), file=sys.stderr)
    bar = tqdm(total=len(problems), desc=f"bench-dllm {args.method}", unit="problem")
    refresh = plan.refresh_tokens if plan is not None else args.refresh_tokens
    rows = plan.refresh_rows if plan is not None else args.refresh_rows
    synced = plan.sync_threshold if plan is not None else args.sync_threshold
    report = bench_dllm(dlm, tokenizer, problems, args.method, gen_length, block_size=args.block_size,
                        block_sizes=block_sizes, threshold=args.threshold, refresh_tokens=refresh,
                        refresh_rows=rows, sync_threshold=synced, on_problem=lambda i: bar.update(1), host=args.host)
    bar.close()
    if args.method != "fast-dllm":
        report.update(block_sizes=block_sizes, refresh_tokens=refresh, refresh_rows=rows, sync_threshold=synced)
    if plan is not None:
        report["plan"] = dict(plan.to_dict(), plan_seconds=round(plan_seconds, 3), plan_problems="train split",
                              min_branches=args.min_branches)
    report.update(command=args.command_line, model=args.model, task=task, seed=args.seed, gen_length=gen_length,
                  device=str(device), dtype=str(dtype), machine=describe_machine(device))
    if args.method == "both":
        print(_describe_both(report), file=sys.stderr)
    emit_report(report, args.json)
    return 0


def _describe_both(report: dict) -> str:
    """`bench-dllm --method both` in words: the ratios, and whether a BlockBatch step is cheap enough to pay."""
    r, ff, bb = report["blockbatch_vs_fast_dllm"], report["fast-dllm"], report["blockbatch"]
    text = (f"BlockBatch / Fast-dLLM on {report['n_prompts']} problems: NFE {r['nfe']:.3f}x, time per answer "
            f"{r['seconds_per_answer']:.3f}x, accuracy {r['accuracy_points']:+.1f} points "
            f"({100 * bb['accuracy']:.1f}% against {100 * ff['accuracy']:.1f}%)")
    if r["block_step"] is not None:
        text += (f"\n  a BlockBatch block step ({bb['ms_per_block_forward']:.2f} ms) costs {r['block_step']:.2f}x a "
                 f"Fast-dLLM one ({ff['ms_per_block_forward']:.2f} ms); with its full forwards "
                 f"({bb['nfe_full']:.1f} of {bb['ms_per_full_forward']:.2f} ms against {ff['nfe_full']:.1f} of "
                 f"{ff['ms_per_full_forward']:.2f} ms) and host time ({1e3 * bb['host_seconds_per_answer']:.1f} ms "
                 f"against {1e3 * ff['host_seconds_per_answer']:.1f} ms per answer) as measured, it would tie at "
                 f"{r['block_step_to_tie']:.2f}x")
    return text


def _plan(dlm, tokenizer, task: str, gen_length: int, device, args):
    """BlockBatch's branches planned on training-split problems (the held-out ones are what the bench reports)."""
    from ..dllm import BLOCK_SIZES, plan_blockbatch
    from ..training.dllm_tasks import final_answer, make_problems
    from ..training.dllm_trainer import encode

    # never more calibration problems than the bench decodes: the plan should cost less than what it plans; the
    # validation problems follow them in the same draw
    n = min(args.plan_prompts, args.limit)
    calibration = make_problems(task, n + max(0, args.plan_check_prompts), seed=args.seed, heldout=False)
    prompts = [encode(tokenizer, [p], gen_length, with_answers=False)[0] for p in calibration]
    candidates = [b for b in BLOCK_SIZES if gen_length % b == 0]

    def answer(sequence) -> int | None:
        return final_answer(tokenizer.decode(sequence, skip_special_tokens=True))

    def same_answer(a, b) -> bool:  # answers may be worded freely (the stories task): what is checked must agree
        return answer(a) is not None and answer(a) == answer(b)

    def right(i: int, sequence) -> bool:  # calibration problems come with their answers: sets must do as Fast-dLLM
        return answer(sequence) == calibration[i].answer

    return plan_blockbatch(dlm, prompts[:n], gen_length, candidates, device, threshold=args.threshold,
                           min_branches=min(args.min_branches, len(candidates)), agree=same_answer, check=right,
                           baseline_block_size=args.block_size, host=args.host, validation=prompts[n:])


def _describe_plan(plan, seconds: float) -> str:
    full = {len(q): s for k, q, s in plan.step_costs if k == "full"}
    costs = ", ".join(f"{r} rows {1e3 * s:.1f} ms ({s / full[1]:.2f}x)" for r, s in sorted(full.items()))
    single = ", ".join(f"{q}: {1e3 * plan.seconds('block', (q,)):.1f} ms" for q in plan.candidates[0].block_sizes)
    chosen = "+".join(map(str, sorted(plan.block_sizes, reverse=True)))
    host = f"  host time between model calls: {1e3 * plan.chosen.host_seconds:.1f} ms per answer"
    if plan.baseline is not None:
        host += f" (Fast-dLLM {1e3 * plan.baseline.host_seconds:.1f} ms)"
    refresh = "no refresh" if plan.refresh_tokens is None else f"a refresh every {plan.refresh_tokens} tokens" + (
        " of the leader's row alone" if plan.refresh_rows == "leader" else "") + (
        f", a sync of a branch {plan.sync_threshold} tokens behind the leader")
    return (f"BlockBatch plan ({seconds:.1f} s): branches {', '.join(map(str, plan.block_sizes))}, {refresh}\n"
            f"  full forward of length {plan.seq_len}: {costs}\n"
            f"  block forward of one window: {single}; of the branches' windows together ({chosen}, packed): "
            f"{1e3 * plan.seconds('block', plan.block_sizes):.1f} ms\n{host}\n  {plan.reason}")
