"""The speculative decode loop for a block-diffusion drafter, batch size >= 1.

Rows advance at different speeds, so the target cache is a rectangle of *columns* with holes: every
cycle each row verifies one block of γ columns `[anchor | γ-1 drafts]`; the cache is cropped to the
longest accepted run, and the columns a row rejected are masked out of its attention from then on.
Position ids count only a row's valid tokens, so every row sees exactly the sequence that plain
`generate()` would feed it. The drafter's context cache mirrors the same columns and mask.

Logits processors and stopping criteria see each row's sequence as plain `generate()` lays it out
(left-padded prompt + generated tokens), one row and one position at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.dscale.assistant import TapRecorder, choose_tokens
from ..models.dscale.modeling_dscale import DraftContextCache
from ..models.dscale import compat
from .acceptance import greedy_accept, speculative_accept
from .types import DecodeStats


@dataclass
class _Rows:
    """Per-row state of the loop (B rows)."""

    prompt: torch.Tensor  # [B, P] left-padded prompt, as given
    generated: list[list[int]]  # tokens committed per row
    finished: list[bool]

    def sequence(self, b: int, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Row b as plain generate() sees it: [1, P + generated (+ extra)]."""
        parts = [self.prompt[b], self.prompt.new_tensor(self.generated[b])]
        if extra is not None:
            parts.append(extra)
        return torch.cat(parts)[None]


def _process(logits: torch.Tensor, rows: _Rows, block: torch.Tensor | None, processors) -> torch.Tensor:
    """Apply logits processors to target logits [B, Q, V].

    Position k predicts the token after block[:, k]; the anchor block[:, 0] is already committed, so the
    processors see the row + block[:, 1:k+1].
    """
    if not processors:
        return logits
    out = logits.clone()
    for b in range(logits.shape[0]):
        for k in range(logits.shape[1]):
            extra = None if block is None else block[b, 1 : k + 1]
            out[b, k] = processors(rows.sequence(b, extra), logits[b, k][None])[0]
    return out


def _draft(drafter, rows, anchors, taps, anchor_pos, ctx_pos, dcache, valid, processors, do_sample):
    """Draft ids [B, K] and the drafter's processed logits [B, K, V] (the q they were drawn from)."""
    logits = drafter.draft_logits(anchors[:, None], taps, anchor_pos, ctx_pos, dcache, valid)
    if not processors and not do_sample:
        return choose_tokens(logits, anchors[:, None])
    picked = [
        choose_tokens(logits[b : b + 1], rows.sequence(b), processors, do_sample)
        for b in range(logits.shape[0])
    ]
    return torch.cat([t for t, _ in picked]), torch.cat([s for _, s in picked])


def _commit(rows: _Rows, b: int, tokens: list[int], scores: torch.Tensor, stopping_criteria) -> int:
    """Append tokens to row b one by one until a stopping criterion fires; returns how many."""
    for j, token in enumerate(tokens):
        rows.generated[b].append(token)
        if stopping_criteria is not None and bool(stopping_criteria(rows.sequence(b), scores[j][None])[0]):
            rows.finished[b] = True
            return j + 1
    return len(tokens)


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.LongTensor,  # [B, P], left-padded
    attention_mask: torch.LongTensor | None = None,  # [B, P]
    logits_processor=None,
    stopping_criteria=None,
    do_sample: bool = False,
    pad_token_id: int = 0,
    cache=None,
    streamer=None,
) -> tuple[torch.LongTensor, DecodeStats]:
    """Decode until every row meets a stopping criterion; returns sequences [B, P + N] and stats.

    Rows that stop early are padded with `pad_token_id`, as plain `generate()` does.
    """
    if drafter.target is not target:
        drafter.bind_target(target)
    b, p = input_ids.shape
    device = input_ids.device
    gamma = drafter.config.block_size
    valid = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).bool()
    rows = _Rows(input_ids, [[] for _ in range(b)], [False] * b)
    stats = DecodeStats()
    cache = cache if cache is not None else compat.new_cache(target)
    dcache = DraftContextCache(drafter.config.num_hidden_layers)
    recorder = TapRecorder(target, drafter.config.target_layer_ids)
    try:
        # Prefill: the prompt through the target, first token, drafter context = the prompt's taps.
        t0 = time.perf_counter()
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        out = target(input_ids=input_ids, attention_mask=valid.long(), position_ids=positions,
                     use_cache=True, logits_to_keep=1, **compat.cache_kwargs(target, cache))
        logits = _process(out.logits[:, -1:].float(), rows, None, logits_processor)[:, 0]
        first = torch.multinomial(logits.softmax(-1), 1)[:, 0] if do_sample else logits.argmax(-1)
        for i in range(b):
            _commit(rows, i, [int(first[i])], logits[i : i + 1], stopping_criteria)
        if streamer is not None:
            streamer.put(input_ids.cpu())
            streamer.put(first.cpu())
        anchors, anchor_pos, taps, ctx_pos = first, valid.sum(-1), recorder.taps(), positions
        stats.other_s += time.perf_counter() - t0

        while not all(rows.finished):
            t0 = time.perf_counter()
            draft_ids, q_logits = _draft(drafter, rows, anchors, taps, anchor_pos, ctx_pos, dcache, valid,
                                         logits_processor, do_sample)
            t1 = time.perf_counter()
            block = torch.cat((anchors[:, None], draft_ids), dim=1)  # [B, γ]
            block_pos = anchor_pos[:, None] + torch.arange(gamma, device=device)
            mask = torch.cat((valid, valid.new_ones(b, gamma)), dim=1)
            out = target(input_ids=block, attention_mask=mask.long(), position_ids=block_pos, use_cache=True,
                         **compat.cache_kwargs(target, cache))
            t2 = time.perf_counter()
            p_logits = _process(out.logits.float(), rows, block, logits_processor)
            if do_sample:
                num_accepted, output_ids = speculative_accept(draft_ids, q_logits.softmax(-1), p_logits.softmax(-1))
            else:
                num_accepted, output_ids = greedy_accept(draft_ids, p_logits)

            width = 1  # columns of this block that stay in the cache
            new_valid = valid.new_zeros(b, gamma)
            for i in range(b):
                if rows.finished[i]:
                    continue
                n = int(num_accepted[i]) + 1
                committed = _commit(rows, i, output_ids[i, :n].tolist(), p_logits[i], stopping_criteria)
                stats.committed.append(committed)
                if streamer is not None:
                    streamer.put(output_ids[i, :committed].cpu())
                new_valid[i, :n] = True  # the anchor and the accepted drafts
                width = max(width, n)
            stats.cycles += 1

            compat.crop_to(cache, valid.shape[1] + width)
            valid = torch.cat((valid, new_valid[:, :width]), dim=1)
            taps = recorder.taps()[:, :width]
            ctx_pos = block_pos[:, :width]
            anchors = output_ids.gather(1, num_accepted[:, None])[:, 0]
            anchor_pos = anchor_pos + num_accepted + 1
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.other_s += time.perf_counter() - t2
    finally:
        recorder.remove()
        if streamer is not None:
            streamer.end()

    length = max(len(g) for g in rows.generated)
    out_ids = input_ids.new_full((b, p + length), pad_token_id)
    out_ids[:, :p] = input_ids
    for i, g in enumerate(rows.generated):
        out_ids[i, p : p + len(g)] = input_ids.new_tensor(g)
    return out_ids, stats
