"""Training a small masked-diffusion LM on a checkable task (resumable, checkpoints = save_pretrained folders).

Objective (LLaDA-style): per sequence draw t ~ U(0.02, 1), mask each answer token with probability t,
predict the masked tokens from the rest (prompt never masked, attention bidirectional), cross-entropy
weighted by 1/t and averaged over the answer length. Answers are padded with EOS to `gen_length`, so
the model also learns to close its answer.

With `block_fraction` > 0, that fraction of the rows is masked the way block-wise decoders (Fast-dLLM,
BlockBatch) see their input instead: the answer is cut at a random multiple of a block size B (drawn from
4..128), tokens before the cut are kept, the block after it is masked with probability t and everything
beyond the block is masked (weight 1 there, 1/t inside the block).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..dllm import BLOCK_SIZES
from ..models.dllm import DiffusionLM
from .dllm_tasks import make_problems
from .trainer import _checkpoints, finish_checkpoint


@dataclass
class DLLMTrainConfig:
    task: str = "arithmetic"
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_ratio: float = 0.03
    weight_decay: float = 0.01
    gen_length: int = 128
    seed: int = 0
    block_fraction: float = 0.0  # rows masked as block-wise decoders see them (module docstring)
    save_every: int = 250
    keep_checkpoints: int = 2
    bf16: bool = True  # autocast; on CPUs with bf16 matrix units this is several times faster


def encode(tokenizer, problems, gen_length: int, with_answers: bool = True):
    """[BOS] prompt (left-padded with PAD to a common length) then the answer + EOS padding.

    Returns input_ids [B, P + G] and answer_mask [B, P + G] (True on the G answer positions).
    """
    prompts = [[tokenizer.bos_token_id] + tokenizer(p.prompt)["input_ids"] for p in problems]
    width = max(len(p) for p in prompts)
    rows = []
    for p, problem in zip(prompts, problems):
        row = [tokenizer.pad_token_id] * (width - len(p)) + p
        if with_answers:
            answer = tokenizer(problem.solution)["input_ids"] + [tokenizer.eos_token_id]
            if len(answer) > gen_length:
                raise ValueError(f"An answer of {len(answer)} tokens does not fit gen_length {gen_length}.")
            row += answer + [tokenizer.eos_token_id] * (gen_length - len(answer))
        rows.append(row)
    ids = torch.tensor(rows)
    answer_mask = torch.zeros_like(ids, dtype=torch.bool)
    if with_answers:
        answer_mask[:, width:] = True
    return ids, answer_mask


def noise_mask(answer_mask: torch.Tensor, t: torch.Tensor, generator: torch.Generator, block_fraction: float = 0.0):
    """Which tokens to mask, and each masked token's loss weight.

    answer_mask [B, L] (True on the answer, a common right-aligned region), t [B, 1]. Uniform rows mask
    each answer token with probability t (weight 1/t); block rows (see the module docstring) keep a
    prefix, mask the block after it with probability t (weight 1/t) and mask the rest (weight 1).
    """
    b, length = answer_mask.shape
    draw = torch.rand(answer_mask.shape, generator=generator).to(answer_mask.device)
    noise = (draw < t) & answer_mask
    weights = (1.0 / t).expand(b, length).clone()
    if block_fraction <= 0:
        return noise, weights
    g = int(answer_mask[0].sum())
    j = torch.arange(length, device=answer_mask.device) - (length - g)  # index inside the answer
    block_rows = torch.rand(b, generator=generator) < block_fraction
    sizes = [s for s in BLOCK_SIZES if s <= g] or [g]
    for row in block_rows.nonzero().flatten().tolist():
        size = sizes[int(torch.randint(len(sizes), (1,), generator=generator))]
        cut = size * int(torch.randint(g // size, (1,), generator=generator))
        after = j >= cut + size
        noise[row] = (noise[row] & (j >= cut)) | after  # the uniform draws inside the block, all after it
        weights[row, after] = 1.0
    return noise, weights


def diffusion_loss(model: DiffusionLM, ids, answer_mask, generator: torch.Generator, block_fraction: float = 0.0):
    b = ids.shape[0]
    t = (0.02 + 0.98 * torch.rand(b, 1, generator=generator)).to(ids.device)
    noise, weights = noise_mask(answer_mask, t, generator, block_fraction)
    noisy = torch.where(noise, torch.full_like(ids, model.config.mask_token_id), ids)
    logits = model(noisy).logits
    ce = F.cross_entropy(logits[noise].float(), ids[noise], reduction="none")
    loss = (ce * weights[noise]).sum() / answer_mask.sum()
    accuracy = (logits[noise].argmax(-1) == ids[noise]).float().mean()
    return loss, accuracy


def extend_vocabulary(model: DiffusionLM, old_tokenizer, new_tokenizer, task: str) -> None:
    """Continue `model` on another task: grow its embeddings and output layer to `new_tokenizer`.

    Every token of `old_tokenizer` must keep its id in `new_tokenizer` (a task's vocabulary extends the
    arithmetic one, see `build_tokenizer`); the new rows start as a fresh model's would.
    """
    old, new = old_tokenizer.get_vocab(), new_tokenizer.get_vocab()
    moved = sorted(t for t, i in old.items() if new.get(t) != i)
    if moved:
        raise ValueError(f"The {task!r} vocabulary does not extend the model's: {len(moved)} of its tokens have "
                         f"another id or none there (for example {moved[:5]}); train from scratch instead.")
    size, std = len(new), model.config.initializer_range
    for name in ("embed", "lm_head"):
        layer = getattr(model, name)
        weight = torch.empty(size, layer.weight.shape[1]).normal_(0.0, std)
        weight[: layer.weight.shape[0]] = layer.weight.detach()
        layer.weight = torch.nn.Parameter(weight)
        if name == "embed":
            layer.num_embeddings = size
        else:
            layer.out_features = size
    model.config.vocab_size, model.config.task = size, task


def train_dllm(model: DiffusionLM, tokenizer, out_dir: str, cfg: DLLMTrainConfig,
               on_step: Callable[[int, dict], None] | None = None) -> DiffusionLM:
    """Train for cfg.steps (resuming from the newest checkpoint in out_dir); final model saved in out_dir."""
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, math.ceil(cfg.warmup_ratio * cfg.steps)), cfg.steps)
    step = 0
    checkpoints = _checkpoints(out_dir)
    if checkpoints:
        state = torch.load(os.path.join(checkpoints[-1], "trainer_state.pt"), weights_only=False)
        model.load_state_dict(DiffusionLM.from_pretrained(checkpoints[-1]).state_dict())
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]

    def save(at: int) -> None:
        path = os.path.join(out_dir, f"checkpoint-{at}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)  # a checkpoint is a complete folder that bench-dllm loads as is
        finish_checkpoint(out_dir, path, {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                          "step": at, "config": asdict(cfg)}, cfg.keep_checkpoints)

    model.train()
    device = next(model.parameters()).device
    try:
        while step < cfg.steps:
            # batch `step` is a pure function of (seed, step): resuming replays exactly the same data
            problems = make_problems(cfg.task, cfg.batch_size, seed=cfg.seed * 1_000_003 + step, heldout=False)
            ids, answer_mask = encode(tokenizer, problems, cfg.gen_length)
            generator = torch.Generator().manual_seed(cfg.seed * 7_919 + step)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, accuracy = diffusion_loss(model, ids.to(device), answer_mask.to(device), generator,
                                                cfg.block_fraction)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if on_step is not None:
                on_step(step, {"loss": loss.item(), "accuracy": accuracy.item(), "grad_norm": norm.item(),
                               "lr": scheduler.get_last_lr()[0]})
            if step % cfg.save_every == 0 or step == cfg.steps:
                save(step)
    except KeyboardInterrupt:
        save(step)
        raise
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model
