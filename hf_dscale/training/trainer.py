"""Drafter training on cached self-distillation data, built on `accelerate`.

Single process on a CPU here; `accelerate launch` runs the same code with DDP on many GPUs (each
process sees its own slice of the sample order). Parameters stay fp32 (the master weights); with
`mixed_precision="bf16"` the forward runs under bf16 autocast. AdamW, cosine schedule with warmup,
gradient clipping at 1.0.

Checkpoints are `save_pretrained` folders (`checkpoint-<step>/`) with `trainer_state.pt` beside the
weights. A run restarts from its newest checkpoint; Ctrl-C writes one before it exits, so an
interruption loses nothing.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from ..models import DScaleDrafter
from ..models.dscale.assistant import TapRecorder
from .data import Sample, frequent_tokens, load_meta, padded_taps, read_shard, shard_names, top_up
from .losses import block_attention_mask, build_blocks, sample_anchors, sample_prefix_lengths, weighted_cross_entropy


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    grad_accum: int = 4  # drafter forwards per optimizer step (per process)
    batch_size: int = 1  # sequences per drafter forward (a GPU wants many; padding costs a CPU)
    num_anchors: int = 64  # blocks per sequence (the references use up to 512)
    max_seq_len: int = 1024
    save_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0
    mixed_precision: str = "no"  # "bf16" on GPUs
    vp_beta: float | None = None  # set (e.g. 0.9) to train a variable-prefix drafter
    draft_vocab: int = 8192  # the drafter proposes from the data's most frequent tokens (0 = the whole vocabulary)
    full_vocab_loss: bool = False  # score the whole vocabulary even with a draft vocab (see `sequence_loss`)


class SampleStream:
    """An endless, seeded, resumable order over the samples of a data folder.

    Epoch e visits the shards in a permutation seeded by (seed, e) and the samples of each shard in a
    permutation too; sample number i of the whole run is therefore fixed, and `skip(i)` resumes.
    """

    def __init__(self, folder: str, tap_index: list[int] | None, seed: int, rank: int = 0, world: int = 1):
        self.folder, self.tap_index, self.seed, self.rank, self.world = folder, tap_index, seed, rank, world
        self.shards = shard_names(folder)
        if not self.shards:
            raise FileNotFoundError(f"No finished shards in {folder}: generate data first.")
        self.consumed = 0

    def _epoch(self, epoch: int) -> Iterator[Sample]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        for shard in torch.randperm(len(self.shards), generator=g).tolist():
            samples = read_shard(self.folder, self.shards[shard])
            for j in torch.randperm(len(samples), generator=g).tolist():
                s = samples[j]
                yield Sample(s.input_ids, s.loss_mask, None if self.tap_index is None else s.taps[:, self.tap_index])

    def __iter__(self) -> Iterator[tuple[int, Sample]]:
        """(global sample number, sample); the number also seeds that sample's anchors."""
        epoch, index = 0, 0
        while True:
            for sample in self._epoch(epoch):
                if index >= self.consumed and index % self.world == self.rank:
                    self.consumed = index + 1
                    yield index, sample
                index += 1
            epoch += 1


class TargetTaps:
    """Taps computed by the target for each batch, for data folders without cached taps (`padded_taps`)."""

    def __init__(self, target, layer_ids: list[int]):
        self.target, self.recorder = target, TapRecorder(target, layer_ids)

    def __call__(self, sequences: list[torch.Tensor], width: int) -> torch.Tensor:
        """[B, width, T, H] on the target's device, in its dtype."""
        return padded_taps(self.target, self.recorder, sequences, width)

    def remove(self) -> None:
        self.recorder.remove()


def batch_loss(drafter, embed, lm_head, samples: list[Sample], cfg: TrainConfig, generators: list[torch.Generator],
               vocab: torch.Tensor | None = None, target_taps: TargetTaps | None = None):
    """Loss and accuracy of a batch of sequences in one drafter forward; None when none has a response token.

    Every sequence gets its own random anchors (from its own generator) and blocks, as in `build_blocks`.
    The batch is padded to the longest context and the most blocks: padded blocks carry weight 0 and see
    only themselves, and padded context positions are never visible (each block sees its own sequence's
    context before its anchor). The loss weighs every predicted position of the batch alike.

    With `vocab` (the drafter's draft vocabulary) the softmax runs over what decoding can propose for
    these sequences: `vocab` plus their own tokens (a superset of every label). That is the distribution
    the drafter drafts from, and on a CPU the LM head over the whole vocabulary was most of a step
    (SmolLM2, 48 blocks: 0.45 s per sequence with it, 0.16 s over 8,192 + the sequence's tokens).

    Taps come from the samples (a cache) or, for samples without them, from `target_taps`.
    """
    core = getattr(drafter, "module", drafter)  # unwrapped under DDP, for attributes only
    device = core.norm.weight.device
    c = core.config
    items = []
    for sample, generator in zip(samples, generators):
        s = min(sample.input_ids.shape[0], cfg.max_seq_len)
        ids, mask = sample.input_ids[:s], sample.loss_mask[:s]
        anchors = sample_anchors(mask, cfg.num_anchors, generator)
        if anchors.numel() == 0:
            continue
        prefix = None if cfg.vp_beta is None else sample_prefix_lengths(anchors.numel(), c.block_size, cfg.vp_beta,
                                                                        generator)
        items.append((sample, ids, build_blocks(ids, mask, anchors, c.block_size, c.mask_token_id,
                                                c.loss_decay_gamma, prefix)))
    if not items:
        return None
    g = c.block_size
    width = max(ids.shape[0] for _, ids, _ in items)
    n = max(blocks.input_ids.shape[0] for _, _, blocks in items)
    b = len(items)
    block_ids = torch.full((b, n, g), c.mask_token_id, dtype=torch.long)
    labels = torch.zeros(b, n, g, dtype=torch.long)
    weights = torch.zeros(b, n, g)
    positions = torch.arange(g).repeat(b, n, 1)
    for i, (_, _, blocks) in enumerate(items):
        m = blocks.input_ids.shape[0]
        block_ids[i, :m], labels[i, :m], weights[i, :m] = blocks.input_ids, blocks.labels, blocks.weights
        positions[i, :m] = blocks.position_ids
    attention_mask = block_attention_mask([blocks.anchors for _, _, blocks in items], width, g, device)[:, None]

    if all(sample.taps is not None for sample, _, _ in items):
        taps = torch.zeros(b, width, *items[0][0].taps.shape[1:], dtype=items[0][0].taps.dtype)
        for i, (sample, ids, _) in enumerate(items):
            taps[i, : ids.shape[0]] = sample.taps[: ids.shape[0]]
        taps = taps.to(device)
    elif target_taps is not None:
        taps = target_taps([ids for _, ids, _ in items], width)
    else:
        raise ValueError("These samples have no cached taps: pass `target_taps` to compute them with the target.")

    with torch.no_grad():
        block_embeds = embed(block_ids.reshape(b, -1).to(device))
    hidden = drafter(
        block_embeds,
        taps,
        positions.reshape(b, -1).to(device),
        torch.arange(width, device=device).expand(b, -1),
        None,
        attention_mask,
    )
    keep = (weights.reshape(b, -1) > 0).to(device)
    if not bool(keep.any()):
        return None
    rows = hidden[keep].to(lm_head.weight.dtype)
    labels = labels.reshape(b, -1).to(device)[keep]
    if vocab is None:
        logits = lm_head(rows)
    else:
        seen = torch.cat([ids for _, ids, _ in items])
        candidates = torch.cat((vocab.to(device), seen.to(device))).unique()  # sorted; labels are tokens of ids
        bias = None if lm_head.bias is None else lm_head.bias[candidates]
        logits = torch.nn.functional.linear(rows, lm_head.weight[candidates], bias)
        labels = torch.searchsorted(candidates, labels)
    return weighted_cross_entropy(logits, labels, weights.reshape(b, -1).to(device)[keep])


def sequence_loss(drafter, embed, lm_head, sample: Sample, cfg: TrainConfig, generator: torch.Generator,
                  vocab: torch.Tensor | None = None, target_taps: TargetTaps | None = None):
    """`batch_loss` of a single sequence."""
    return batch_loss(drafter, embed, lm_head, [sample], cfg, [generator], vocab, target_taps)


def _checkpoints(out_dir: str) -> list[str]:
    if not os.path.isdir(out_dir):
        return []
    found = [n for n in os.listdir(out_dir) if n.startswith("checkpoint-") and n[11:].isdigit()]
    found = [n for n in found if os.path.isfile(os.path.join(out_dir, n, "trainer_state.pt"))]
    return [os.path.join(out_dir, n) for n in sorted(found, key=lambda n: int(n[11:]))]


def finish_checkpoint(out_dir: str, path: str, state: dict, keep: int) -> None:
    """Write `trainer_state.pt` into the checkpoint folder `path` atomically (its presence marks the
    checkpoint complete), then delete all but the newest `keep` checkpoints of `out_dir`."""
    torch.save(state, os.path.join(path, "trainer_state.pt.tmp"))
    os.replace(os.path.join(path, "trainer_state.pt.tmp"), os.path.join(path, "trainer_state.pt"))
    for old in _checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def train_drafter(
    drafter: DScaleDrafter,
    target,
    data_dir: str,
    out_dir: str,
    cfg: TrainConfig,
    on_step: Callable[[int, dict], None] | None = None,
) -> DScaleDrafter:
    """Train `drafter` (fresh, or resumed from the newest checkpoint in `out_dir`) for cfg.steps steps.

    The final weights are saved to `out_dir` itself (a folder the decoding code loads as is).
    """
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    # The drafter trains where the target lives (a CPU target on a GPU machine stays on the CPU).
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=target.device.type == "cpu")
    if torch.empty(0, device=accelerator.device).device != target.device:  # "cuda" there means cuda:current
        raise ValueError(f"The target is on {target.device} but this process trains on {accelerator.device}: load the "
                         f"target there (under `accelerate launch`, process i uses cuda:i).")
    meta = load_meta(data_dir)
    if meta["layer_ids"] is None:  # no cached taps: the target computes them for every batch
        tap_index, target_taps = None, TargetTaps(target, list(drafter.config.target_layer_ids))
    else:
        missing = [i for i in drafter.config.target_layer_ids if i not in meta["layer_ids"]]
        if missing:
            raise ValueError(f"{data_dir} caches taps of layers {meta['layer_ids']}; the drafter also needs "
                             f"{missing}. Train from a folder that caches them all, or one without cached taps.")
        tap_index, target_taps = [meta["layer_ids"].index(i) for i in drafter.config.target_layer_ids], None

    drafter.bind_target(target)
    drafter.config.prefix_prior = cfg.vp_beta  # marks a variable-prefix (D²SD second) drafter in its config
    # Decoding proposes from the draft vocab; the loss scores it too unless cfg.full_vocab_loss. A drafter that
    # already has one (--init-from) keeps its tokens after the data's own, up to the size.
    if cfg.draft_vocab:
        tokens = frequent_tokens(data_dir, cfg.draft_vocab)
        if drafter.draft_vocab is not None:
            tokens = top_up(tokens, drafter.draft_vocab, cfg.draft_vocab)
        drafter.set_draft_vocab(tokens)
    else:
        drafter.set_draft_vocab(None)
    for p in target.parameters():
        p.requires_grad_(False)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter.train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, math.ceil(cfg.warmup_ratio * cfg.steps)), cfg.steps)
    step = 0
    checkpoints = _checkpoints(out_dir)
    if checkpoints:
        state = torch.load(os.path.join(checkpoints[-1], "trainer_state.pt"), weights_only=False)
        saved = DScaleDrafter.from_pretrained(checkpoints[-1])
        drafter.set_draft_vocab(saved.draft_vocab)  # the run's own, even if the data folder has grown since
        drafter.load_state_dict(saved.state_dict())
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
    plain_head = isinstance(lm_head, torch.nn.Linear)  # as in `draft_vocab_for`: other heads score everything
    loss_vocab = drafter.draft_vocab if plain_head and not cfg.full_vocab_loss else None
    model, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)
    stream = SampleStream(data_dir, tap_index, cfg.seed, accelerator.process_index, accelerator.num_processes)
    per_step = cfg.grad_accum * cfg.batch_size * accelerator.num_processes
    stream.consumed = state.get("consumed", step * per_step) if checkpoints else 0
    finished = stream.consumed  # samples used by the last finished step (an interrupt mid-step redoes that step)
    samples = iter(stream)

    def save(at: int) -> None:  # `at` is always the last finished step
        if not accelerator.is_main_process:
            return
        path = os.path.join(out_dir, f"checkpoint-{at}")
        accelerator.unwrap_model(model).save_pretrained(path)
        finish_checkpoint(out_dir, path, {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                          "step": at, "consumed": finished, "config": asdict(cfg)},
                          cfg.keep_checkpoints)

    try:
        while step < cfg.steps:
            losses, accuracies = [], []
            for _ in range(cfg.grad_accum):
                batch, generators = [], []
                for _ in range(cfg.batch_size):
                    index, sample = next(samples)
                    batch.append(sample)
                    generators.append(torch.Generator().manual_seed(cfg.seed * 1_000_003 + index))
                with accelerator.autocast():
                    result = batch_loss(model, embed, lm_head, batch, cfg, generators, loss_vocab, target_taps)
                if result is None:
                    continue
                loss, accuracy = result
                accelerator.backward(loss / cfg.grad_accum)
                losses.append(float(loss.detach()))
                accuracies.append(float(accuracy))
            norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            finished = stream.consumed
            if on_step is not None and losses:
                on_step(step, {"loss": sum(losses) / len(losses), "accuracy": sum(accuracies) / len(accuracies),
                               "grad_norm": float(norm), "lr": scheduler.get_last_lr()[0]})
            if step % cfg.save_every == 0 or step == cfg.steps:
                save(step)
    except KeyboardInterrupt:
        save(step)
        raise
    finally:
        if target_taps is not None:
            target_taps.remove()
    final = accelerator.unwrap_model(model)
    final.eval()
    if accelerator.is_main_process:
        final.save_pretrained(out_dir)
    return final
