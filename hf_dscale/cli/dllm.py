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
                   help="continue from a trained DiffusionLM folder (its size and tokenizer; a fresh schedule)")
    t.add_argument("--device", default="auto")
    t.set_defaults(func=train_main)

    b = sub.add_parser("bench-dllm", help="NFE, accuracy and speed of Fast-dLLM or BlockBatch on held-out problems")
    b.add_argument("--model", required=True, help="a DiffusionLM folder (or LLaDA/Dream with its tokenizer)")
    b.add_argument("--method", required=True, choices=["fast-dllm", "blockbatch"])
    b.add_argument("--task", default=None, help="default: the task the model was trained on")
    b.add_argument("--seed", type=int, default=1, help="problems are drawn fresh from the held-out split")
    b.add_argument("--limit", type=int, default=100)
    b.add_argument("--gen-length", type=int, default=None, help="default: the model's training gen_length")
    b.add_argument("--block-size", type=int, default=32, help="Fast-dLLM block")
    b.add_argument("--block-sizes", default=None, help="BlockBatch branches, comma-separated (default: the paper's "
                   "set, 4,8,16,32,64,128)")
    b.add_argument("--threshold", type=float, default=0.9)
    b.add_argument("--device", default="auto")
    b.add_argument("--json", default=None)
    b.set_defaults(func=bench_main)


def train_main(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from ..models.dllm import DiffusionLM, DiffusionLMConfig
    from ..training.dllm_tasks import build_tokenizer
    from ..training.dllm_trainer import DLLMTrainConfig, train_dllm
    from .common import pick_device, training_progress

    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    if args.init_from:
        from transformers import AutoTokenizer

        model = DiffusionLM.from_pretrained(args.init_from)
        if model.config.task != args.task:
            raise ValueError(f"--init-from {args.init_from} was trained on task {model.config.task!r}, not "
                             f"{args.task!r}; pass --task {model.config.task}.")
        tokenizer = AutoTokenizer.from_pretrained(args.init_from)
        args.gen_length = model.config.gen_length
    else:
        tokenizer = build_tokenizer()
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
    from tqdm.auto import tqdm
    from transformers import AutoModel, AutoTokenizer

    from ..evaluation import bench_dllm
    from ..models.dllm import DiffusionModel
    from ..training.dllm_tasks import make_problems
    from .common import describe_machine, emit_report, pick_device

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise FileNotFoundError(f"No model at {args.model} (a folder with config.json, weights and a tokenizer).")
    device = pick_device(args.device)
    model = AutoModel.from_pretrained(args.model, trust_remote_code=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dlm = DiffusionModel(model)
    task = args.task or getattr(model.config, "task", None)
    if task is None:
        raise ValueError("The model's config names no task: pass --task.")
    gen_length = args.gen_length or getattr(model.config, "gen_length", None) or 256
    problems = make_problems(task, args.limit, seed=args.seed, heldout=True)
    block_sizes = [int(x) for x in args.block_sizes.split(",")] if args.block_sizes else None  # None: the default
    bar = tqdm(total=len(problems), desc=f"bench-dllm {args.method}", unit="problem")
    report = bench_dllm(dlm, tokenizer, problems, args.method, gen_length, block_size=args.block_size,
                        block_sizes=block_sizes, threshold=args.threshold,
                        on_problem=lambda i: bar.update(1))
    bar.close()
    report.update(command=args.command_line, model=args.model, task=task, seed=args.seed, gen_length=gen_length,
                  device=str(device), machine=describe_machine(device))
    emit_report(report, args.json)
    return 0
