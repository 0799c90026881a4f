"""The two decoders: Fast-dLLM (`fast_dllm_generate`) and BlockBatch (`blockbatch_generate`, its branches in
`_Branches`, their merge and sync). See the package's docstring for the rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..models.dllm import DiffusionModel
from .host import (
    BLOCK_SIZES,
    REFRESH_ROWS,
    REFRESH_TOKENS,
    SYNC_THRESHOLD,
    DLLMResult,
    Windows,
    _beliefs,
    _book,
    _commit,
    answer_end,
    check_block_sizes,
    check_threshold,
    confidences,
    host_kernel,
    windows_at,
)

if TYPE_CHECKING:
    from .plan import BlockBatchPlan

def _start(model: DiffusionModel, prompt: torch.Tensor, gen_length: int) -> torch.Tensor:
    if prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError("dLLM decoding takes one prompt at a time: input_ids of shape [1, P].")
    if model.shift and prompt.shape[1] == 0:
        raise ValueError("A Dream-style (shifted) model needs a non-empty prompt.")
    masks = prompt.new_full((1, gen_length), model.mask_token_id)
    return torch.cat((prompt, masks), dim=1)


@torch.no_grad()
def fast_dllm_generate(model: DiffusionModel, prompt: torch.Tensor, gen_length: int = 256, block_size: int = 32,
                       threshold: float = 0.9, commit_first: bool | None = None, host: str = "auto") -> DLLMResult:
    """Fast-dLLM with the dual cache (see the module docstring); prompt [1, P].

    `commit_first`: the full forward that opens a block commits the block's first position (its most likely
    token) and nothing else, and the threshold rule starts with the first block forward, as Fast-dLLM's decoder
    for Dream does; otherwise the threshold rule applies to the full forward's logits too, as its decoder for
    LLaDA does. None: by the model's style (Dream-style, shifted logits: True). `host`: who does the bookkeeping
    between model calls (`host_kernel`).
    """
    commit_first = bool(model.shift) if commit_first is None else commit_first
    check_block_sizes((block_size,), gen_length)
    check_threshold(threshold)
    x = _start(model, prompt, gen_length)
    kernel = host_kernel(host, x.device)
    p, mask_id, eos = prompt.shape[1], model.mask_token_id, model.eos_token_id
    result = DLLMResult(sequence=x[0], block_size=block_size)
    cache = model.new_cache()
    end = None
    for s in range(p, p + gen_length, block_size):
        w = windows_at([0], torch.arange(s, s + block_size, device=x.device)[None])
        logits = model.full(x, cache)
        result.nfe_full += 1
        _book(result, model, cache, "full", 1, x.shape[1])
        if commit_first:  # the most likely token at the block's first position, whatever its confidence
            [(first, end, _)] = _commit(kernel, x, windows_at([0], w.targets[:, :1]), logits[:, s : s + 1], mask_id,
                                        eos, 2.0, p)
        else:
            [(first, end, _)] = _commit(kernel, x, w, logits[:, s : s + block_size], mask_id, eos, threshold, p)
        while end is None and first is not None and p + first < s + block_size:  # the block still holds a mask
            logits = model.block(x, w.targets, w.valid, cache)
            result.nfe_block += 1
            _book(result, model, cache, "block", 1, x.shape[1], (block_size,))
            [(first, end, _)] = _commit(kernel, x, w, logits, mask_id, eos, threshold, p)
        if end is not None:
            break
    result.nfe = result.nfe_full + result.nfe_block
    result.sequence = x[0, : end if end is not None else x.shape[1]]
    return result


class _Branches:
    """BlockBatch state: rows x [N, L], one cache row and one probability map per branch.

    The probability map keeps, per position, the most likely token and its probability (`best`, `prob`) and the
    EOS probability (`eos`). That decides the merge exactly for a gate of 0.5 or more (a token above 0.5 is the most
    likely one) at a vocabulary-independent size, and gives the winner's EOS probability. The paper's map holds only
    probabilities above `floor`: the merge and the winner's choice read it so (`believed`). Window starts, refresh
    counters and done flags live on the host, updated from one read per stage.
    """

    def __init__(self, model: DiffusionModel, x: torch.Tensor, prompt_len: int, sizes: list[int],
                 floor: float = 0.0, kernel=None):
        self.model, self.x, self.p, self.sizes, self.floor = model, x, prompt_len, sizes, floor
        self.kernel = kernel  # `host_kernel`'s choice
        n, length = x.shape
        self.start = [prompt_len] * n  # window start per branch
        self.since_refresh = [0] * n
        self.done = [False] * n
        self.beliefs = torch.zeros(2, n, length, device=x.device)  # (prob, eos): written together
        self.prob, self.eos = self.beliefs
        self.best = torch.zeros(n, length, dtype=torch.long, device=x.device)
        self.cache = model.new_cache()
        self._windows = None  # (key, Windows, cover or None) of the last `windows` call
        self._grids: dict = {}  # `_grid` per set of rows
        self._offset_lists: dict = {}  # `_offsets` per set of rows
        self._after: dict = {}  # the merge's [dst, src] "src ranks after dst", per order of the live branches

    def believed(self, p: float) -> float:
        """A stored probability as the paper's map holds it: 0 at or below the floor."""
        return p if p > self.floor else 0.0

    def after(self, live: list[int], order: list[int]) -> torch.Tensor:
        """[dst, src] over `live`: src comes after dst in `order` (the merge's sources of each destination)."""
        key = tuple(live), tuple(order)
        if key not in self._after:
            rank = {i: k for k, i in enumerate(order)}
            self._after[key] = torch.tensor([[rank[s] > rank[d] for s in live] for d in live], device=self.x.device)
        return self._after[key]

    def live(self) -> list[int]:
        return [i for i in range(len(self.sizes)) if not self.done[i]]

    def windows(self, rows: list[int]) -> Windows:
        """The windows of `rows`, kept until one moves."""
        key = tuple(self.start[i] for i in rows), tuple(rows)
        if self._windows is None or self._windows[0] != key:
            live, offsets, valid, real, at_rows, _ = self._grid(key[1])
            targets = torch.tensor([[s + o for o in offsets] for s, offsets in zip(key[0], self._offsets(key[1]))],
                                   device=self.x.device)
            # the (row, position) pairs are for the torch bookkeeping; the C library reads the windows as they are
            at = None if self.kernel is not None else (at_rows, targets.flatten()[real])
            self._windows = key, Windows(live, targets, valid, real, at), None
        return self._windows[1]

    def _offsets(self, rows: tuple[int, ...]) -> list[list[int]]:
        """Each slot's offset in its window, as `_grid` has them, as lists (kept per set of rows)."""
        if rows not in self._offset_lists:
            self._offset_lists[rows] = self._grid(rows)[1].tolist()
        return self._offset_lists[rows]

    def cover(self, rows: list[int]) -> torch.Tensor:
        """The windows of `rows` as a mask over the row [R, L]."""
        w = self.windows(rows)
        if self._windows[2] is None:
            starts, sizes = w.targets[:, :1], self._grid(tuple(rows))[5]
            positions = torch.arange(self.x.shape[1], device=self.x.device)
            self._windows = self._windows[:2] + ((positions >= starts) & (positions < starts + sizes),)
        return self._windows[2]

    def rows_of(self, rows: list[int]) -> torch.Tensor:
        """`rows` as a tensor [R] (kept)."""
        return self._grid(tuple(rows))[0]

    def _grid(self, rows: tuple[int, ...]) -> tuple:
        """What the windows of `rows` share whatever their starts (kept per set of rows): rows [R], each slot's offset
        in its window [R, Q] (Q the widest; padding repeats a window's last position), valid [R, Q], the real slots
        (indices into R * Q) [T] and their rows [T], and the sizes [R, 1]."""
        if rows not in self._grids:
            device = self.x.device
            live = torch.tensor(rows, device=device)
            sizes = torch.tensor([self.sizes[i] for i in rows], device=device)[:, None]
            offsets = torch.arange(max(self.sizes[i] for i in rows), device=device)
            valid = offsets < sizes
            real = valid.flatten().nonzero().squeeze(1)
            self._grids[rows] = (live, torch.minimum(offsets, sizes - 1), valid, real,
                                 live[:, None].expand_as(valid).flatten()[real], sizes)
        return self._grids[rows]

    def remember(self, rows: torch.Tensor, beliefs: tuple[torch.Tensor, torch.Tensor], at=None) -> None:
        """Store `_beliefs`' ((prob, eos), best) as those of branches `rows` [R]: [2, T] and [T] at the (row, position)
        pairs `at` ([T] twice), or, without them, [2, R or 1, L] and [R or 1, L] for every position."""
        both, best = beliefs
        if at is None:
            self.beliefs[:, rows], self.best[rows] = both, best
        else:
            self.beliefs[:, at[0], at[1]], self.best[at] = both, best

    def believe(self, logits: torch.Tensor, rows: torch.Tensor, of_row: torch.Tensor) -> None:
        """Branches `rows` [R] take the beliefs of a full forward's logits [U, L, V] of U distinct rows at every
        position: row rows[j] those of distinct row of_row[j]."""
        mask_id, eos = self.model.mask_token_id, self.model.eos_token_id
        if self.kernel is not None:
            self.kernel.beliefs(logits, rows, of_row, mask_id, eos, self.prob, self.eos, self.best)
            return
        # float32 over whole sequences: float64 probabilities of every position would be large for a hub vocabulary
        both, best = _beliefs(*confidences(logits, mask_id, torch.float32), eos)  # [2, U, L], [U, L]
        self.remember(rows, (both[:, of_row], best[of_row]))

    def progress(self, rows: list[int]) -> tuple[list[int | None], list[int]]:
        """(first mask offset, None when none is left; tokens decoded) in the generation region of each of `rows`."""
        return _progress(self.x[rows, self.p :], self.model.mask_token_id)

    def decoded(self, rows: list[int]) -> list[int]:
        """Tokens decoded (not masks) in the generation region of each of `rows`."""
        return self.progress(rows)[1]

    def place(self, rows: list[int], first: list[int | None]) -> None:
        """Window = the block of the branch's own grid holding its first mask offset `first`; done when None."""
        for i, f in zip(rows, first):
            if f is None:
                self.done[i] = True
                continue
            new = self.p + (f // self.sizes[i]) * self.sizes[i]
            self.since_refresh[i] += max(0, new - self.start[i])
            self.start[i] = new

    def snap(self, *rows: int) -> None:
        """`place` from the rows as they are."""
        self.place(list(rows), self.progress(list(rows))[0])

    def copy(self, dst: int, src: int, first: int | None) -> None:
        """Branch dst takes src's row, beliefs and cache row; `first`: src's first mask offset. Its cache row is
        then as stale as src's: it takes src's progress since the last refresh too (as the reference's Dream decoder
        copies the refresh counter), not the jump to src's row as progress of its own."""
        self.x[dst] = self.x[src]
        self.beliefs[:, dst], self.best[dst] = self.beliefs[:, src], self.best[src]
        if self.cache is not None:
            self.cache.copy_row(dst, src)
        self.place([dst], [first])
        self.since_refresh[dst] = self.since_refresh[src]


def _progress(region: torch.Tensor, mask_id: int) -> tuple[list, list]:
    """(first mask offset or None, tokens decoded) of each row of region [R, G], with one read."""
    masked = (region == mask_id).int()
    first, left = torch.stack((masked.argmax(-1), masked.sum(-1))).tolist()
    return [f if n else None for f, n in zip(first, left)], [region.shape[1] - n for n in left]


def merge(state: _Branches, gate: float) -> int:
    """Confidence-gated merge; returns the number of tokens adopted."""
    live = state.live()
    return _merge(state, gate, dict(zip(live, state.decoded(live))))[0]


def _branch_commit(state: _Branches, live: list[int], w: Windows, logits: torch.Tensor, threshold: float,
                   beliefs: bool, gate: float | None) -> tuple[list[tuple], tuple | None]:
    """A BlockBatch step's commit in the windows `w` of branches `live` (`beliefs`: every window slot's beliefs go
    to the maps) and its scan; with the C library and a merge `gate`, the merge that follows runs in the same call.
    Returns (the scan, that merge's result for `_merge`, or None: `_merge` does the merge)."""
    model = state.model
    if state.kernel is None or gate is None:
        return _commit(state.kernel, state.x, w, logits, model.mask_token_id, model.eos_token_id, threshold, state.p,
                       state if beliefs else None), None
    return state.kernel.commit_merge(state.x, w.rows, w.targets, w.valid, logits, model.mask_token_id,
                                     model.eos_token_id, threshold,
                                     (state.prob, state.eos, state.best) if beliefs else None, state.p,
                                     [state.sizes[i] for i in live], state.prob, state.best, max(gate, state.floor))


def _merge(state: _Branches, gate: float, counts: dict[int, int], merged: tuple | None = None
           ) -> tuple[int, dict[int, int]]:
    """Every live branch (dst) adopts, at each of its masked positions where its own probability for its most likely
    token is > gate, that token if a source offers it: a branch whose window ends earlier (or as early and comes
    later), which agrees with dst wherever both are decoded, and holds the token in its window. Every branch reads
    the rows as they were before the merge, so all adopt in one pass. `counts`: the live branches' decoded tokens
    before it; `merged`: the merge as `_branch_commit` already made it in C (tokens adopted and the scan after it, per
    live branch), or None. Returns (tokens adopted, decoded count per live branch after the merge)."""
    live, mask_id = state.live(), state.model.mask_token_id
    if len(live) < 2:
        return 0, counts
    if merged is None:
        order = sorted(live, key=lambda i: state.start[i] + state.sizes[i], reverse=True)  # the paper's: stable
        after = state.after(live, order)  # [dst, src]
        gate = max(gate, state.floor)
        if state.kernel is not None:
            merged = state.kernel.merge(state.x, live, after, [state.start[i] for i in live],
                                        [state.sizes[i] for i in live], state.prob, state.best, gate, mask_id, state.p)
        else:
            adopted, first, after_merge = _merge_in_torch(state, live, after, gate)
    if merged is not None:
        adopted, scanned = merged
        first, after_merge = [f for f, _, _ in scanned], [n for _, _, n in scanned]
    if not any(adopted):  # most steps: nothing moves
        return 0, counts
    state.place(live, first)
    return sum(adopted), dict(zip(live, after_merge))


def _merge_in_torch(state: _Branches, live: list[int], after: torch.Tensor, gate: float) -> tuple[list, list, list]:
    """`_merge`'s adoption in torch operations (`gate`: the floor applied): (tokens adopted per live branch, then each
    one's first mask offset and decoded count after the merge; both None when nothing was adopted)."""
    mask_id = state.model.mask_token_id
    rows, cover = state.rows_of(live), state.cover(live)
    everyone = len(live) == len(state.sizes)  # the usual case: the state's own tensors, no gathering
    x, best, prob = (state.x, state.best, state.prob) if everyone else (state.x[rows], state.best[rows],
                                                                        state.prob[rows])  # [R, L]
    decoded = x != mask_id
    clash = ((x[:, None] != x[None]) & decoded[:, None] & decoded[None]).any(-1)  # [dst, src]
    # a source offers dst's most likely token in its window (best is never the mask: a match is a decoded token)
    offered = ((after & ~clash)[:, :, None] & cover[None] & (x[None] == best[:, None])).any(1)  # [dst, L]
    take = offered & ~decoded & (prob > gate)
    adopted = take.sum(-1).tolist()
    if not any(adopted):  # nothing to write back or read again
        return adopted, None, None
    merged = torch.where(take, best, x)
    if everyone:
        state.x.copy_(merged)
    else:
        state.x[rows] = merged
    return (adopted, *_progress(merged[:, state.p :], mask_id))

def leader_of(live: list[int], counts: dict[int, int]) -> int:
    """The leading branch among `live`: the most tokens decoded (`counts`), ties to the first (the smallest block)."""
    return max(live, key=lambda i: (counts[i], -i))


def sync(state: _Branches, threshold: int, counts: dict[int, int] | None = None) -> int:
    """Branches more than `threshold` tokens behind the leader copy it; returns how many did. `counts`: the live
    branches' decoded tokens when the caller has them (`_merge`'s)."""
    live = state.live()
    if not live:
        return 0
    if counts is None:
        counts = dict(zip(live, state.decoded(live)))
    leader = leader_of(live, counts)
    behind = [i for i in live if i != leader and counts[leader] - counts[i] > threshold]
    if behind:
        first = state.progress([leader])[0][0]
        for i in behind:
            state.copy(i, leader, first)
    return len(behind)


@torch.no_grad()
def blockbatch_generate(model: DiffusionModel, prompt: torch.Tensor, gen_length: int = 256,
                        block_sizes: Sequence[int] | None = None, threshold: float = 0.9, merge_gate: float = 0.5,
                        prob_floor: float = 0.1, sync_threshold: int | str = "plan",
                        refresh_tokens: int | None | str = "plan",
                        exchange: bool = True, stop_early: bool = True,
                        plan: BlockBatchPlan | None = None, refresh_rows: str = "plan", host: str = "auto"
                        ) -> DLLMResult:
    """BlockBatch (see the module docstring); prompt [1, P].

    Branches: `block_sizes` when given, else `plan.block_sizes` (`plan_blockbatch`), else the paper's set.
    `refresh_tokens`: the periodic refresh's interval (None: never); "plan": the plan's, else the paper's 32.
    `refresh_rows`: what a refresh runs. "all": every live branch's row (each distinct row once), the paper's;
    "leader": the leader's row alone, which every live branch then takes (as at the start), so a refresh costs one
    row's full forward; "plan": the plan's, else "all". `sync_threshold`: a branch more than this many tokens behind
    the leader copies its row; "plan": the plan's, else the paper's 8.
    `exchange=False` turns off merge and sync (each branch then decodes exactly as it would alone, if
    `refresh_tokens` is None too); `stop_early=False` runs until every branch is complete. `host`: who does the
    bookkeeping between model calls (`host_kernel`).
    """
    if plan is not None and plan.gen_length != gen_length and (block_sizes is None or refresh_tokens == "plan"):
        raise ValueError(f"The plan was made for gen_length {plan.gen_length}, not {gen_length}: make one for "
                         "this length (plan_blockbatch) or pass block_sizes and refresh_tokens.")
    if merge_gate < 0.5:
        raise ValueError(f"merge_gate must be at least 0.5 (the paper's), got {merge_gate}: the map kept per branch "
                         "holds each position's most likely token, which decides a gate of 0.5 or more.")
    if refresh_tokens == "plan":
        refresh_tokens = plan.refresh_tokens if plan is not None else REFRESH_TOKENS
    if refresh_rows == "plan":
        refresh_rows = plan.refresh_rows if plan is not None else "all"
    if sync_threshold == "plan":
        sync_threshold = plan.sync_threshold if plan is not None else SYNC_THRESHOLD
    if isinstance(sync_threshold, bool) or not isinstance(sync_threshold, int) or sync_threshold < 0:
        raise ValueError(f"sync_threshold must be a number of tokens (0 or more) or 'plan', got {sync_threshold!r}.")
    if refresh_rows not in REFRESH_ROWS:
        raise ValueError(f"refresh_rows must be one of {REFRESH_ROWS} or 'plan', got {refresh_rows!r}.")
    if block_sizes is None and plan is not None:
        block_sizes = plan.block_sizes
    sizes = list(check_block_sizes(BLOCK_SIZES if block_sizes is None else block_sizes, gen_length))
    check_threshold(threshold)
    if not 0 <= prob_floor < 1:
        raise ValueError(f"prob_floor must be a probability in [0, 1), got {prob_floor!r}.")
    if refresh_tokens is not None and (isinstance(refresh_tokens, bool) or not isinstance(refresh_tokens, int)
                                       or refresh_tokens < 1):
        raise ValueError(f"refresh_tokens must be a number of tokens (1 or more), None (never) or 'plan', got "
                         f"{refresh_tokens!r}.")
    x1 = _start(model, prompt, gen_length)
    p, mask_id, eos, n, length = prompt.shape[1], model.mask_token_id, model.eos_token_id, len(sizes), x1.shape[1]
    state = _Branches(model, x1.expand(n, -1).clone(), p, sizes, prob_floor, host_kernel(host, x1.device))
    kernel = state.kernel
    result = DLLMResult(sequence=x1[0])

    # init: one full forward of the prompt row, shared by every branch (1 NFE)
    logits = model.full(x1, state.cache)
    result.nfe_full += 1
    _book(result, model, state.cache, "full", 1, length)
    if state.cache is not None:
        state.cache.expand(n)
    every = state.windows(list(range(n)))
    state.believe(logits, every.rows, torch.zeros_like(every.rows))  # 1 row
    _commit(kernel, state.x, every, logits[0, every.targets], mask_id, eos, threshold, p)  # logits [n, Q, V]
    state.snap(*range(n))
    if exchange:
        result.events["synced"] += sync(state, -1)  # hard sync: everyone starts from the leader
    winner = None
    force_block = False
    while winner is None and not all(state.done):
        live = state.live()
        flagged = refresh_tokens is not None and any(state.since_refresh[i] >= refresh_tokens for i in live)
        w = state.windows(live)
        if flagged and not force_block:
            if refresh_rows == "leader" and len(live) > 1:
                leader = leader_of(live, dict(zip(live, state.decoded(live))))
                state.x[live] = state.x[leader].clone()  # every branch refreshes from the leader's row: one row
                state.snap(*live)  # each on its own grid
                w = state.windows(live)
                distinct, of_row = state.x[leader][None], torch.zeros_like(w.rows)
            else:  # NOTE: one forward of the distinct rows: a row's logits and cache row depend on that row alone
                distinct, of_row = torch.unique(state.x[w.rows], dim=0, return_inverse=True)  # [U, L], [R]
            fresh = model.new_cache()
            logits = model.full(distinct, fresh)  # [U, L, V]
            if state.cache is not None:
                _write_distinct(state.cache, w.rows, fresh, of_row)
            result.nfe_full += 1
            _book(result, model, fresh, "full", distinct.shape[0], length)
            result.events["refreshes"] += 1
            state.believe(logits, w.rows, of_row)
            for i in live:
                state.since_refresh[i] = 0
            scanned, merged = _branch_commit(state, live, w, logits[of_row[:, None], w.targets], threshold, False,
                                             merge_gate if exchange else None)
        else:
            if len(live) == n:
                logits = model.block(state.x, w.targets, w.valid, state.cache)  # [n, Q, V]; padding is not run
            else:  # done branches' rows run nothing
                write = torch.zeros(n, w.targets.shape[1], dtype=torch.bool, device=x1.device)
                write[w.rows] = w.valid
                every_row = torch.full((n, w.targets.shape[1]), p, dtype=torch.long, device=x1.device)
                every_row[w.rows] = w.targets
                logits = model.block(state.x, every_row, write, state.cache)[w.rows]  # [R, Q, V]
            result.nfe_block += 1
            _book(result, model, state.cache, "block", n, length, tuple(state.sizes[i] for i in live))
            scanned, merged = _branch_commit(state, live, w, logits, threshold, True, merge_gate if exchange else None)
        force_block = False
        first, ends, decoded = zip(*scanned)
        if stop_early and any(e is not None for e in ends):
            ready = [(i, e) for i, e in zip(live, ends) if e is not None]
            eos_p = [state.believed(e) for e in state.eos[[i for i, _ in ready], [e - 1 for _, e in ready]].tolist()]
            winner = ready[max(range(len(ready)), key=lambda k: eos_p[k])][0]
            break
        state.place(live, first)
        if exchange:
            adopted, counts = _merge(state, merge_gate, dict(zip(live, decoded)), merged)
            result.events["merged"] += adopted
            synced = sync(state, sync_threshold, counts)
            result.events["synced"] += synced
            force_block = synced > 0
    if winner is None:
        counts = state.decoded(list(range(n)))
        winner = max(range(n), key=lambda i: (counts[i], -i))
    end = answer_end(state.x[winner], p, mask_id, eos)
    result.sequence = state.x[winner, : end if end is not None else length]
    result.block_size, result.branch_rows = sizes[winner], state.x
    result.nfe = result.nfe_full + result.nfe_block
    return result


def _write_distinct(cache, rows: torch.Tensor, fresh, of_row: torch.Tensor) -> None:
    """Cache rows `rows` [R] take the rows of `fresh` (U distinct rows) they share: row rows[j] takes of_row[j]."""
    every = len(rows) == cache.batch_size  # the usual case: every branch is live
    if every and fresh.batch_size == 1:  # and one distinct row (a refresh of the leader's row, or after a sync)
        cache.fill(fresh)
        return
    for mine, theirs in ((cache.keys, fresh.keys), (cache.values, fresh.values)):
        for t, u in zip(mine, theirs):
            u = u if u.shape[0] == 1 else u[of_row]  # one distinct row (the usual case after a sync): broadcast
            if every:
                t.copy_(u.expand_as(t))
            else:
                t[rows] = u
