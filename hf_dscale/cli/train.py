"""`hf-dscale train`: self-distillation data from the target (resumable), then drafter training (resumable)."""

from __future__ import annotations

import json
import os

from .common import pick_device, pick_dtype, training_progress, warn_if_slow_bf16


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="distil a DScale/DFlash drafter from a target")
    p.add_argument("--target", default="smollm2", help='target folder / hub id, or "smollm2"')
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--prompts", nargs="*", default=[], help="JSON lines prompt files for self-distillation")
    p.add_argument("--limit-per-file", type=int, default=None)
    p.add_argument("--data-dir", required=True, help="cache of target answers and taps (created / resumed)")
    p.add_argument("--data-layer-ids", default=None,
                   help="comma-separated taps to cache (default: the drafter's); cache a superset to train several")
    p.add_argument("--cache-taps", choices=["auto", "yes", "no"], default="auto",
                   help="store the target's taps with the answers (~10 KB per token for 9 taps of SmolLM2) or only the "
                        "answers, the target then computing the taps of every training batch; auto = what an existing "
                        "--data-dir holds, else yes on a CPU and no on a GPU (where that forward is cheap)")
    p.add_argument("--out", required=True, help="output folder (checkpoints inside; final weights at the top)")
    p.add_argument("--fusion", choices=["layerwise", "shared"], default="layerwise",
                   help="layerwise = DScale, shared = DFlash")
    p.add_argument("--num-taps", type=int, default=None, help="default 9 (DScale) or 5 (DFlash)")
    p.add_argument("--draft-layers", type=int, default=2,
                   help="the drafter's decoder layers (2: the shipped SmolLM2 drafter); at equal budget, layer-wise "
                        "fusion's edge over the shared input was larger at 4 than at 2 (the SmolLM2 drafter's card)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="token that fills masked positions (default: the tokenizer's mask token; 16 for SmolLM2)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length of the target's answers")
    p.add_argument("--gen-batch-size", type=int, default=16)
    p.add_argument("--gen-sort-window", type=int, default=8,
                   help="answer prompts in batches of about one length, sorted within runs of this many batches "
                        "(less padding); 1 = the prompt files' order")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--grad-accum", type=int, default=4, help="drafter forwards per optimizer step")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per drafter forward (raise it on a GPU)")
    p.add_argument("--num-anchors", type=int, default=64)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--keep-checkpoints", type=int, default=2, help="how many of the newest checkpoints to keep")
    p.add_argument("--vp-beta", type=float, default=None, help="train a variable-prefix drafter with this prior")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="the drafter proposes from this many of the data's most frequent tokens plus each sequence's "
                        "own (a faster draft; verification is unchanged), then, with --init-from, the starting "
                        "drafter's; 0 = the whole vocabulary")
    p.add_argument("--full-vocab-loss", action="store_true",
                   help="score the whole vocabulary in the loss (default: the draft vocabulary plus each sequence's "
                        "own tokens, what decoding proposes from; about 3x cheaper on a CPU)")
    p.add_argument("--init-from", default=None,
                   help="start from this drafter's weights (its config wins over the shape flags above)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the target's dtype; auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--mixed-precision", default="auto", help="auto = bf16 on CUDA, no on CPU")
    p.set_defaults(func=main)


def _mask_token(args, tokenizer) -> int:
    if args.mask_token_id is not None:
        return args.mask_token_id
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    if args.target == "smollm2":
        return tokenizer.convert_tokens_to_ids("<empty_output>")  # an unused special token (id 16)
    raise ValueError("The tokenizer has no mask token: pass --mask-token-id (an unused special token id).")


def main(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from ..models import DScaleConfig, DScaleDrafter
    from ..models.targets import load_target
    from ..training.data import generate_data, load_meta
    from ..training.trainer import TrainConfig, train_drafter

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    mixed = args.mixed_precision if args.mixed_precision != "auto" else ("bf16" if device.startswith("cuda") else "no")
    warn_if_slow_bf16(device, *([f"--dtype {args.dtype}"] if dtype == torch.bfloat16 else []),
                      *([f"--mixed-precision {mixed}"] if mixed == "bf16" else []))
    target, tokenizer = load_target(args.target, args.gguf_file, dtype=dtype, device=device)
    if args.init_from:
        config = DScaleConfig.from_pretrained(args.init_from)
    else:
        config = DScaleConfig.from_target(target.config, num_hidden_layers=args.draft_layers, num_taps=args.num_taps,
                                          fusion=args.fusion, mask_token_id=_mask_token(args, tokenizer),
                                          block_size=args.block_size)
    cache_taps = args.cache_taps == "yes"
    if args.cache_taps == "auto":  # an existing folder keeps its choice; a new one caches on a CPU only
        existing = os.path.join(args.data_dir, "meta.json")
        cache_taps = load_meta(args.data_dir)["layer_ids"] is not None if os.path.exists(existing) else device == "cpu"
    if not cache_taps and args.data_layer_ids:
        raise ValueError("--data-layer-ids names taps to cache; it goes with --cache-taps yes.")
    if not cache_taps:
        layer_ids = None
    elif args.data_layer_ids:
        layer_ids = [int(x) for x in args.data_layer_ids.split(",")]
    else:
        layer_ids = list(config.target_layer_ids)
    if args.prompts:
        n = generate_data(target, tokenizer, args.prompts, args.data_dir, layer_ids, args.max_new_tokens,
                          args.gen_batch_size, args.limit_per_file, progress=True,
                          sort_window=args.gen_sort_window)
        print(f"self-distillation: {n} new samples in {args.data_dir}")
    cfg = TrainConfig(steps=args.steps, lr=args.lr, grad_accum=args.grad_accum, batch_size=args.batch_size,
                      num_anchors=args.num_anchors, save_every=args.save_every,
                      keep_checkpoints=args.keep_checkpoints, seed=args.seed, mixed_precision=mixed, vp_beta=args.vp_beta,
                      draft_vocab=args.draft_vocab, full_vocab_loss=args.full_vocab_loss)
    torch.manual_seed(args.seed)
    drafter = (DScaleDrafter.from_pretrained(args.init_from) if args.init_from else DScaleDrafter(config)).to(device)
    os.makedirs(args.out, exist_ok=True)
    recorded = vars(args) | {"func": None}
    if args.init_from:  # the shape comes from the starting drafter, not from the flags' defaults
        recorded |= {"fusion": config.fusion, "num_taps": len(config.target_layer_ids),
                     "draft_layers": config.num_hidden_layers, "block_size": config.block_size,
                     "mask_token_id": config.mask_token_id}
    with open(os.path.join(args.out, "train_args.json"), "w") as f:
        json.dump(recorded, f, indent=2, default=str)
    bar = tqdm(total=args.steps, desc=f"train {config.fusion}", unit="step")
    on_step = training_progress(bar, args.out)

    train_drafter(drafter, target, args.data_dir, args.out, cfg, on_step=on_step)
    bar.close()
    print(f"drafter saved to {args.out}")
    return 0
