"""Decoding masked-diffusion LMs: Fast-dLLM (threshold rule + dual cache) and BlockBatch.

Both fill a generation region of G masks after the prompt, greedily, and count NFE = model forwards
(one batched forward = 1 NFE). They share one stopping rule, so NFE compares fairly: stop as soon as
the region holds an EOS with no mask before it (or has no mask left); the answer ends at that EOS.

* **Fast-dLLM**: blocks of 32 left to right; per block one full forward (refreshes the dual cache),
  then block-only forwards over the cached prefix and stale suffix until the block is filled. Each
  step commits every masked position of the window whose confidence is >= 0.9, and at least the most
  confident one (`threshold_commit`); for a Dream-style model the full forward commits only the block's
  first token, as Fast-dLLM's Dream decoder does (`commit_first`).
* **BlockBatch**: one branch per block size (rows of one batch, one cache row each), all advanced by
  one batched block forward per step. Between steps: a confidence-gated merge (a branch adopts a token
  another compatible branch already holds when its own stored probability for it is > 0.5), a leader
  sync (a branch more than 8 tokens behind copies the leader's row and cache row, keeping its own
  block grid) and a periodic full refresh (one batched full forward once any branch advanced 32
  tokens since the last refresh). This is the paper's periodic ("original_bulk") variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.dllm import DiffusionModel

TOPK = 4  # token probabilities kept per position for the merge gate
BLOCK_SIZES = (4, 8, 16, 32, 64, 128)  # BlockBatch's branches: the paper's default set


@dataclass
class DLLMResult:
    sequence: torch.Tensor  # [P + n]: prompt, then the answer up to and including its EOS
    nfe: int = 0
    nfe_full: int = 0
    nfe_block: int = 0
    block_size: int | None = None  # the winning branch's
    branch_rows: torch.Tensor | None = None  # BlockBatch: every branch's final row [N, L]
    query_tokens: int = 0  # tokens run through the model, all forwards together (compute, unlike NFE)
    events: dict = field(default_factory=lambda: {"merged": 0, "synced": 0, "refreshes": 0})


def threshold_commit(row: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor, mask_id: int,
                     threshold: float) -> int:
    """Commit in place the masked `positions` of `row` [L] whose confidence is >= threshold, and at
    least the most confident one. logits [Q, V] are aligned to `positions` [Q]. Returns the count.

    Example: confidences [0.95, 0.3, 0.6] at masked positions -> commits the first only; [0.3, 0.6]
    -> commits the second (the most confident).

    The mask token itself is never a candidate (its logit is dropped before the softmax): committing it would
    leave the position masked and the decoding loop would never end.
    """
    masked = row[positions] == mask_id
    if not bool(masked.any()):
        return 0
    logits = logits.double().index_fill(-1, torch.tensor([mask_id], device=logits.device), float("-inf"))
    conf, tokens = torch.softmax(logits, dim=-1).max(-1)
    conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
    chosen = masked & (conf >= threshold)
    chosen[conf.argmax()] = True
    row[positions[chosen]] = tokens[chosen]
    return int(chosen.sum())


def answer_end(row: torch.Tensor, prompt_len: int, mask_id: int, eos_id: int | None) -> int | None:
    """The shared stopping rule: the end (exclusive) of the answer if it is decided, else None."""
    region = row[prompt_len:]
    masked = (region == mask_id).nonzero()
    first_mask = int(masked[0]) if masked.numel() else region.numel()
    if eos_id is not None:
        eos = (region[:first_mask] == eos_id).nonzero()
        if eos.numel():
            return prompt_len + int(eos[0]) + 1
    return row.numel() if first_mask == region.numel() else None


def _block_query_tokens(model: DiffusionModel, x: torch.Tensor, targets: torch.Tensor, cache) -> int:
    """The tokens a `model.block` call runs through the model: its targets with the dual cache, every position of
    every row without it (hub classes without an in-place block cache run a full forward)."""
    return targets.numel() if cache is not None and model.dual_cache else x.numel()


def _start(model: DiffusionModel, prompt: torch.Tensor, gen_length: int) -> torch.Tensor:
    if prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError("dLLM decoding takes one prompt at a time: input_ids of shape [1, P].")
    if model.shift and prompt.shape[1] == 0:
        raise ValueError("A Dream-style (shifted) model needs a non-empty prompt.")
    masks = prompt.new_full((1, gen_length), model.mask_token_id)
    return torch.cat((prompt, masks), dim=1)


@torch.no_grad()
def fast_dllm_generate(model: DiffusionModel, prompt: torch.Tensor, gen_length: int = 256, block_size: int = 32,
                       threshold: float = 0.9, commit_first: bool | None = None) -> DLLMResult:
    """Fast-dLLM with the dual cache (see the module docstring); prompt [1, P].

    `commit_first`: the full forward that opens a block commits the block's first position (its most likely
    token) and nothing else, and the threshold rule starts with the first block forward, as Fast-dLLM's decoder
    for Dream does; otherwise the threshold rule applies to the full forward's logits too, as its decoder for
    LLaDA does. None: by the model's style (Dream-style, shifted logits: True).
    """
    commit_first = bool(model.shift) if commit_first is None else commit_first
    if gen_length % block_size:
        raise ValueError(f"gen_length {gen_length} must be a multiple of block_size {block_size}.")
    x = _start(model, prompt, gen_length)
    p, mask_id, eos = prompt.shape[1], model.mask_token_id, model.eos_token_id
    result = DLLMResult(sequence=x[0], block_size=block_size)
    cache = model.new_cache()
    end = None
    for s in range(p, p + gen_length, block_size):
        window = torch.arange(s, s + block_size, device=x.device)
        logits = model.full(x, cache)
        result.nfe_full += 1
        result.query_tokens += x.shape[1]
        if commit_first:  # the most likely token at the block's first position, whatever its confidence
            threshold_commit(x[0], logits[0, s : s + 1], window[:1], mask_id, threshold=2.0)
        else:
            threshold_commit(x[0], logits[0, s : s + block_size], window, mask_id, threshold)
        end = answer_end(x[0], p, mask_id, eos)
        while end is None and bool((x[0, s : s + block_size] == mask_id).any()):
            logits = model.block(x, window[None], torch.ones_like(window[None], dtype=torch.bool), cache)
            result.nfe_block += 1
            result.query_tokens += _block_query_tokens(model, x, window[None], cache)
            threshold_commit(x[0], logits[0], window, mask_id, threshold)
            end = answer_end(x[0], p, mask_id, eos)
        if end is not None:
            break
    result.nfe = result.nfe_full + result.nfe_block
    result.sequence = x[0, : end if end is not None else x.shape[1]]
    return result


class _Branches:
    """BlockBatch state: rows x [N, L], one cache row and one probability map per branch."""

    def __init__(self, model: DiffusionModel, x: torch.Tensor, prompt_len: int, sizes: list[int]):
        self.model, self.x, self.p, self.sizes = model, x, prompt_len, sizes
        n, length = x.shape
        self.start = [prompt_len] * n  # window start per branch
        self.since_refresh = [0] * n
        self.done = [False] * n
        self.probs = torch.zeros(n, length, TOPK, device=x.device)
        self.ids = torch.zeros(n, length, TOPK, dtype=torch.long, device=x.device)
        self.cache = model.new_cache()

    def window(self, i: int) -> torch.Tensor:
        return torch.arange(self.start[i], self.start[i] + self.sizes[i], device=self.x.device)

    def decoded(self, i: int) -> int:
        return int((self.x[i, self.p :] != self.model.mask_token_id).sum())

    def remember(self, i: int, logits: torch.Tensor, positions: torch.Tensor, floor: float) -> None:
        probs, ids = torch.softmax(logits.float(), -1).topk(TOPK, dim=-1)
        self.probs[i, positions] = torch.where(probs > floor, probs, torch.zeros_like(probs))
        self.ids[i, positions] = ids

    def snap(self, i: int) -> None:
        """Window = the block of this branch's own grid holding its first mask; done if none is left."""
        masked = (self.x[i, self.p :] == self.model.mask_token_id).nonzero()
        if not masked.numel():
            self.done[i] = True
            return
        b = self.sizes[i]
        new = self.p + (int(masked[0]) // b) * b
        self.since_refresh[i] += max(0, new - self.start[i])
        self.start[i] = new

    def copy(self, dst: int, src: int) -> None:
        self.x[dst] = self.x[src]
        self.probs[dst], self.ids[dst] = self.probs[src], self.ids[src]
        if self.cache is not None:
            self.cache.copy_row(dst, src)
        self.snap(dst)


def merge(state: _Branches, gate: float) -> int:
    """Confidence-gated merge; returns the number of tokens adopted."""
    mask_id, x, adopted = state.model.mask_token_id, state.x, 0
    live = [i for i in range(len(state.sizes)) if not state.done[i]]
    order = sorted(live, key=lambda i: state.start[i] + state.sizes[i], reverse=True)
    for rank, dst in enumerate(order):
        sources = []
        for src in order[rank + 1 :]:
            both = (x[dst] != mask_id) & (x[src] != mask_id)
            if bool((x[dst][both] == x[src][both]).all()):
                sources.append(src)
        if not sources:
            continue
        best_p = torch.zeros(x.shape[1], device=x.device)
        best_t = torch.full_like(x[dst], mask_id)
        for src in sources:
            span = state.window(src)
            cand = x[src, span]
            ok = (x[dst, span] == mask_id) & (cand != mask_id)
            p = ((state.ids[dst, span] == cand[:, None]) * state.probs[dst, span]).amax(-1)
            better = ok & (p > best_p[span])
            best_p[span] = torch.where(better, p, best_p[span])
            best_t[span] = torch.where(better, cand, best_t[span])
        take = best_p > gate
        if bool(take.any()):
            x[dst, take] = best_t[take]
            adopted += int(take.sum())
            state.snap(dst)
    return adopted


def sync(state: _Branches, threshold: int) -> int:
    """Branches more than `threshold` tokens behind the leader copy it; returns how many did."""
    live = [i for i in range(len(state.sizes)) if not state.done[i]]
    if not live:
        return 0
    counts = {i: state.decoded(i) for i in live}
    leader = max(live, key=lambda i: (counts[i], -i))
    synced = 0
    for i in live:
        if i != leader and counts[leader] - counts[i] > threshold:
            state.copy(i, leader)
            synced += 1
    return synced


@torch.no_grad()
def blockbatch_generate(model: DiffusionModel, prompt: torch.Tensor, gen_length: int = 256,
                        block_sizes=BLOCK_SIZES, threshold: float = 0.9, merge_gate: float = 0.5,
                        prob_floor: float = 0.1, sync_threshold: int = 8, refresh_tokens: int | None = 32,
                        exchange: bool = True, stop_early: bool = True) -> DLLMResult:
    """BlockBatch (see the module docstring); prompt [1, P].

    `exchange=False` turns off merge and sync (each branch then decodes exactly as it would alone, if
    `refresh_tokens` is None too); `stop_early=False` runs until every branch is complete.
    """
    sizes = sorted(block_sizes)
    bad = [b for b in sizes if gen_length % b]
    if bad:
        raise ValueError(f"gen_length {gen_length} must be a multiple of every block size; not of {bad}.")
    x1 = _start(model, prompt, gen_length)
    p, mask_id, eos, n = prompt.shape[1], model.mask_token_id, model.eos_token_id, len(sizes)
    state = _Branches(model, x1.expand(n, -1).clone(), p, sizes)
    result = DLLMResult(sequence=x1[0])
    every = torch.arange(x1.shape[1], device=x1.device)

    # init: one full forward of the prompt row, shared by every branch (1 NFE)
    logits = model.full(x1, state.cache)
    result.nfe_full += 1
    result.query_tokens += x1.shape[1]
    if state.cache is not None:
        state.cache.expand(n)
    for i in range(n):
        state.remember(i, logits[0], every, prob_floor)
        threshold_commit(state.x[i], logits[0, state.window(i)], state.window(i), mask_id, threshold)
        state.snap(i)
    if exchange:
        result.events["synced"] += sync(state, -1)  # hard sync: everyone starts from the leader
    winner = None
    force_block = False
    while winner is None and not all(state.done):
        live = [i for i in range(n) if not state.done[i]]
        flagged = refresh_tokens is not None and any(state.since_refresh[i] >= refresh_tokens for i in live)
        if flagged and not force_block:
            rows = torch.tensor(live, device=x1.device)
            fresh = model.new_cache()
            logits = model.full(state.x[rows], fresh)
            if state.cache is not None:
                state.cache.write_rows(rows, fresh)
            result.nfe_full += 1
            result.query_tokens += len(live) * x1.shape[1]
            result.events["refreshes"] += 1
            for j, i in enumerate(live):
                state.since_refresh[i] = 0
                state.remember(i, logits[j], every, prob_floor)
                threshold_commit(state.x[i], logits[j, state.window(i)], state.window(i), mask_id, threshold)
        else:
            q = max(state.sizes[i] for i in live)
            targets = torch.full((n, q), p, dtype=torch.long, device=x1.device)
            write = torch.zeros(n, q, dtype=torch.bool, device=x1.device)
            for i in live:
                w = state.window(i)
                targets[i, : w.numel()], targets[i, w.numel() :] = w, w[-1]
                write[i, : w.numel()] = True
            logits = model.block(state.x, targets, write, state.cache)
            result.nfe_block += 1
            result.query_tokens += _block_query_tokens(model, state.x, targets, state.cache)
            for i in live:
                w = state.window(i)
                state.remember(i, logits[i, : w.numel()], w, prob_floor)
                threshold_commit(state.x[i], logits[i, : w.numel()], w, mask_id, threshold)
        force_block = False
        if stop_early:
            ends = {i: answer_end(state.x[i], p, mask_id, eos) for i in live}
            ready = [i for i in live if ends[i] is not None]
            if ready:
                winner = max(ready, key=lambda i: float(_eos_prob(state, i, ends[i] - 1, eos)))
                break
        for i in live:
            state.snap(i)
        if exchange:
            result.events["merged"] += merge(state, merge_gate)
            synced = sync(state, sync_threshold)
            result.events["synced"] += synced
            force_block = synced > 0
    if winner is None:
        winner = max(range(n), key=lambda i: (state.decoded(i), -i))
    end = answer_end(state.x[winner], p, mask_id, eos)
    result.sequence = state.x[winner, : end if end is not None else x1.shape[1]]
    result.block_size, result.branch_rows = sizes[winner], state.x
    result.nfe = result.nfe_full + result.nfe_block
    return result


def _eos_prob(state: _Branches, i: int, position: int, eos: int | None) -> torch.Tensor:
    if eos is None:
        return torch.zeros(())
    return ((state.ids[i, position] == eos) * state.probs[i, position]).amax()
