"""The speculative decode loop for a block-diffusion drafter, batch size >= 1.

Rows advance at different speeds, so the target cache is a rectangle of *columns* with holes: every
cycle each row verifies one block of γ columns `[anchor | γ-1 drafts]`; the cache is cropped to the
longest accepted run, and the columns a row rejected are masked out of its attention from then on.
Position ids count only a row's valid tokens, so every row sees exactly the sequence that plain
`generate()` would feed it. The drafter's context cache mirrors the same columns and mask.

Logits processors and stopping criteria see each row's sequence as plain `generate()` lays it out
(left-padded prompt + generated tokens), one row and one position at a time.

Where a wide verify costs more than a narrow one (a CPU: 16 tokens ~2x one), only the head of each block
is verified (by default on a CPU): the one with the most tokens expected per second of the cycle
(`draft_confidence="auto"`, `throughput_length`), or the drafts above a cumulative confidence (a number;
`draft_length`). There, too, a verify applies the target's LM head itself in the faster matrix layout where a
probe allows it (`TargetForward`, target_forward.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.dscale.assistant import (  # noqa: F401  (the cut's rule lives with the drafter's remote code)
    AUTO,
    CPU_DRAFT_CONFIDENCE,
    DraftCut,
    TapRecorder,
    choose_tokens,
    cut_minimum,
    draft_length,
    min_drafts_for,
    resolve_draft_confidence,
    throughput_length,
)
from ..models.dscale.modeling_dscale import DraftContextCache
from ..models.dscale import compat
from .acceptance import greedy_accept, speculative_accept
from .masks import TargetAttention, column_positions
from .target_forward import TargetForward
from .types import DecodeStats


def lay_out(input_ids: torch.Tensor, generated, pad_token_id: int) -> torch.Tensor:
    """Sequences as plain `generate()` returns them: each (left-padded) prompt row, its generated tokens
    (a list or tensor per row), then `pad_token_id` up to the longest row."""
    b, p = input_ids.shape
    out = input_ids.new_full((b, p + max(len(g) for g in generated)), pad_token_id)
    out[:, :p] = input_ids
    for i, g in enumerate(generated):
        out[i, p : p + len(g)] = torch.as_tensor(g, dtype=input_ids.dtype, device=input_ids.device)
    return out


class _ForRow:
    """`generate()`'s logits processors applied to row `row` of a batch of `batch` rows.

    Some processors keep per-row state (repetition penalty ignores each row's left padding through a
    [batch] tensor), so they are called on `batch` copies of the row and row `row` is read back.
    Iterable as a one-element list, as `choose_tokens` expects.
    """

    def __init__(self, processors, row: int, batch: int):
        self.processors, self.row, self.batch = processors, row, batch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.batch == 1:
            return self.processors(input_ids, scores)
        out = self.processors(input_ids.expand(self.batch, -1), scores.expand(self.batch, -1).clone())
        return out[self.row : self.row + 1]

    def __iter__(self):
        yield self


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

    def processors_for(self, processors, b: int) -> _ForRow | None:
        return _ForRow(processors, b, self.prompt.shape[0]) if processors else None


def _process(logits: torch.Tensor, rows: _Rows, block: torch.Tensor | None, processors, row_ids=None) -> torch.Tensor:
    """Apply logits processors to target logits [B, Q, V] (logits row i belongs to row row_ids[i]).

    Position k predicts the token after block[:, k]; the anchor block[:, 0] is already committed, so the
    processors see the row + block[:, 1:k+1].
    """
    if not processors:
        return logits
    out = logits.clone()
    for i in range(logits.shape[0]):
        b = i if row_ids is None else row_ids[i]
        apply = rows.processors_for(processors, b)
        for k in range(logits.shape[1]):
            extra = None if block is None else block[i, 1 : k + 1]
            out[i, k] = apply(rows.sequence(b, extra), logits[i, k][None])[0]
    return out


def _draft(drafter, rows, anchors, taps, anchor_pos, ctx_pos, dcache, valid, processors, do_sample, vocab=None):
    """Draft ids [B, K] and the drafter's processed logits [B, K, V] (the q they were drawn from).

    Greedy without logits processors, a drafter with a draft vocabulary gives its logits over that vocabulary
    only ([B, K, len(vocab.ids)]): greedy acceptance reads only the ids, and the cut only the top probabilities,
    which are the same as over the whole vocabulary (-inf elsewhere), at a fraction of the cost.
    """
    greedy = not processors and not do_sample
    logits = drafter.draft_logits(anchors[:, None], taps, anchor_pos, ctx_pos, dcache, valid, vocab, compact=greedy)
    if greedy:
        tokens, logits = choose_tokens(logits, anchors[:, None])
        return (tokens if vocab is None else vocab.ids[tokens]), logits
    picked = [
        choose_tokens(logits[b : b + 1], rows.sequence(b), rows.processors_for(processors, b), do_sample)
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


class _Decoder:
    """The loop's fixed parts (models, caches, processors) and its moving state (columns, anchors)."""

    def __init__(self, target, drafter, rows, cache, processors, criteria, do_sample, streamer, layer_ids=None,
                 draft_confidence: float | str = 0.0, batch_size: int | None = None):
        self.target, self.drafter, self.rows = target, drafter, rows
        batch, block_size = batch_size or rows.prompt.shape[0], drafter.config.block_size  # rows per verify
        self.verify = TargetForward.for_target(target, block_size, batch)  # measured before the hooks, as is the cut
        self.cut = DraftCut.for_target(target, draft_confidence, block_size, batch, self.verify)
        self.attention = TargetAttention.of(target)
        if self.attention.sliding:  # crops and tree paths need every position; the masks apply the window
            cache = compat.new_cache(target, full=True)
        elif cache is None:
            cache = compat.new_cache(target)
        self.cache, self.processors, self.criteria = cache, processors, criteria
        self.do_sample, self.streamer = do_sample, streamer
        self.dcache = DraftContextCache(drafter.config.num_hidden_layers)
        self.recorder = TapRecorder(target, layer_ids or drafter.config.target_layer_ids)
        self.stats = DecodeStats()
        self.overhead_s = 0.0  # drafting and bookkeeping of the cycles so far: what the throughput cut adds to a verify
        self.vocab = None  # the drafter's proposal set (`DraftVocab`), built at prefill
        self.row_ids = list(range(rows.prompt.shape[0]))  # the rows this decoder advances, in batch order
        # Moving state: valid [B, C] over cache columns; each row's anchor (last committed token, not yet
        # run through the target) and its position; the taps [B, S, T, H] the drafter has not ingested yet
        # and their positions [B, S].
        self.valid = self.anchors = self.anchor_pos = self.taps = self.ctx_pos = None

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """The prompt through the target; the first token; the drafter's context = the prompt's taps."""
        t0 = time.perf_counter()
        positions = column_positions(valid)
        mask = valid.long()
        if self.attention.sliding:
            causal = torch.ones(valid.shape[1], valid.shape[1], dtype=torch.bool, device=valid.device).tril()
            mask = self.attention.masks(valid[:, None, :] & causal, positions, positions, self.target.dtype)
        out = self.target(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                          use_cache=True, logits_to_keep=1, **compat.cache_kwargs(self.target, self.cache))
        logits = _process(out.logits[:, -1:].float(), self.rows, None, self.processors, self.row_ids)[:, 0]
        first = torch.multinomial(logits.softmax(-1), 1)[:, 0] if self.do_sample else logits.argmax(-1)
        for i, b in enumerate(self.row_ids):
            _commit(self.rows, b, [int(first[i])], logits[i : i + 1], self.criteria)
        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
            self.streamer.put(first.cpu())
        self.vocab = self.drafter.draft_vocab_for(torch.cat((input_ids, first[:, None]), dim=1))
        self.valid, self.anchors, self.anchor_pos = valid, first, valid.sum(-1)
        self.taps, self.ctx_pos = self.recorder.taps(), positions
        self.stats.other_s += time.perf_counter() - t0

    def cycle(self) -> None:
        """Draft a block per row, verify all rows in one target forward, commit, crop."""
        b = self.anchors.shape[0]
        t0 = time.perf_counter()
        draft_ids, q_logits = _draft(self.drafter, self.rows, self.anchors, self.taps, self.anchor_pos,
                                     self.ctx_pos, self.dcache, self.valid, self.processors, self.do_sample,
                                     self.vocab)
        overhead = self.overhead_s / self.stats.cycles if self.stats.cycles else 0.0
        n = self.cut.length(q_logits, [not f for f in self.rows.finished], overhead)
        draft_ids, q_logits = draft_ids[:, :n], q_logits[:, :n]
        gamma = n + 1  # the verified block: anchor + n drafts
        t1 = time.perf_counter()
        block = torch.cat((self.anchors[:, None], draft_ids), dim=1)  # [B, γ]
        block_pos = self.anchor_pos[:, None] + torch.arange(gamma, device=block.device)
        mask = torch.cat((self.valid, self.valid.new_ones(b, gamma)), dim=1).long()
        if self.attention.sliding:
            causal = torch.ones(gamma, gamma, dtype=torch.bool, device=block.device).tril()
            mask = self.attention.after_cache(self.valid, block_pos, causal, self.target.dtype)
        logits = self.verify(self.cache, input_ids=block, attention_mask=mask, position_ids=block_pos,
                             use_cache=True)
        t2 = time.perf_counter()
        p_logits = _process(logits.float(), self.rows, block, self.processors)
        if self.do_sample:
            num_accepted, output_ids = speculative_accept(draft_ids, q_logits.softmax(-1), p_logits.softmax(-1))
        else:
            num_accepted, output_ids = greedy_accept(draft_ids, p_logits)

        width = 1  # columns of this block that stay in the cache: the longest accepted run
        new_valid = self.valid.new_zeros(b, gamma)
        for i in range(b):
            if self.rows.finished[i]:
                continue
            n = int(num_accepted[i]) + 1
            committed = _commit(self.rows, i, output_ids[i, :n].tolist(), p_logits[i], self.criteria)
            self.stats.committed.append(committed)
            if self.streamer is not None:
                self.streamer.put(output_ids[i, :committed].cpu())
            if self.vocab is not None:
                self.vocab.add(output_ids[i, :committed])
            new_valid[i, :n] = True  # the anchor and the accepted drafts; the rest become holes
            width = max(width, n)

        compat.crop_to(self.cache, self.valid.shape[1] + width)
        self.valid = torch.cat((self.valid, new_valid[:, :width]), dim=1)
        self.taps, self.ctx_pos = self.recorder.taps()[:, :width], block_pos[:, :width]
        self.anchors = output_ids.gather(1, num_accepted[:, None])[:, 0]
        self.anchor_pos = self.anchor_pos + num_accepted + 1
        self.stats.cycles += 1
        self.stats.verified.append(gamma)
        t3 = time.perf_counter()
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        self.stats.other_s += t3 - t2
        self.overhead_s += (t1 - t0) + (t3 - t2)


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
    draft_confidence: float | str | None = None,
) -> tuple[torch.LongTensor, DecodeStats]:
    """Decode until every row meets a stopping criterion; returns sequences [B, P + N] and stats.

    Rows that stop early are padded with `pad_token_id`, as plain `generate()` does. `draft_confidence`
    "auto" verifies the head of each block with the most tokens expected per second (`throughput_length`),
    a number in (0, 1) the confident head (`draft_length`), 0 all of it; None: "auto" on a CPU, 0 elsewhere.
    """
    draft_confidence = resolve_draft_confidence(draft_confidence, input_ids.device)
    if drafter.target is not target:
        drafter.bind_target(target)
    b = input_ids.shape[0]
    valid = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).bool()
    rows = _Rows(input_ids, [[] for _ in range(b)], [False] * b)
    decoder = _Decoder(target, drafter, rows, cache, logits_processor, stopping_criteria, do_sample, streamer,
                       draft_confidence=draft_confidence)
    try:
        decoder.prefill(input_ids, valid)
        while not all(rows.finished):
            decoder.cycle()
    finally:
        decoder.recorder.remove()
        if streamer is not None:
            streamer.end()

    return lay_out(input_ids, rows.generated, pad_token_id), decoder.stats
