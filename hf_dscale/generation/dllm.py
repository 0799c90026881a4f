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
  tokens since the last refresh; a plan may choose 64). This is the paper's periodic
  ("original_bulk") variant; `refresh_rows="leader"` has a refresh run the leader's row alone, which every branch
  then takes, as at the start (one row's full forward). A batched block forward runs only the branches' real window
  positions, packed (the paper's varlen packing): windows of 16 and 32 cost 48 queries, not 2 x 32.

A batched forward is not free where compute, not launches, bounds a step (a CPU, or a GPU at large batch), so
which branches pay for themselves is measured, not assumed: `plan_blockbatch` prices each forward shape the model
runs (`measure_step_costs`, or a table the caller passes), decodes a few calibration prompts with candidate branch
sets and refresh intervals (each run's forwards priced, plus the host time it spent between them) and returns a
`BlockBatchPlan` naming the one with the lowest expected seconds; `blockbatch_generate(..., plan=...)` decodes with
it. A full refresh runs each distinct row once: rows a sync made identical give identical logits and cache rows, so
one forward of the distinct rows is the same step at a fraction of its cost.

Between model calls both decoders commit, scan the rows for the stopping rule and (BlockBatch) merge. On a CPU a C
library does each in one call (`kernels/dllm_host.c`, built on first use) where torch runs a dozen small operations;
elsewhere, or with `host="torch"`, torch does (`host_kernel`). The decodes are the same either way.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..models.dllm import DiffusionModel
from ..timing import median_seconds

BLOCK_SIZES = (4, 8, 16, 32, 64, 128)  # BlockBatch's branches: the paper's default set
REFRESH_TOKENS = 32  # BlockBatch's periodic refresh: the paper's interval
REFRESH_CANDIDATES = (32, 64)  # the intervals a plan compares (the paper's ablation ran 4 to 64)
REFRESH_ROWS = ("all", "leader")  # what a refresh runs: every branch's row (the paper's), or the leader's alone
SYNC_THRESHOLD = 8  # a branch this many tokens behind the leader copies it: the paper's
SYNC_CANDIDATES = (8, 4)  # the thresholds a plan compares for its chosen set (the paper's ablation ran 4 to 16)
HOSTS = ("auto", "c", "torch")  # who does the bookkeeping between model calls (`host_kernel`)


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
    forwards: list = field(default_factory=list)  # the shape (kind, queries per row) of every model call, in order


def threshold_commit(row: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor, mask_id: int,
                     threshold: float) -> int:
    """Commit in place the masked `positions` of `row` [L] whose confidence is >= threshold, and at
    least the most confident one. logits [Q, V] are aligned to `positions` [Q]. Returns the count.

    Example: confidences [0.95, 0.3, 0.6] at masked positions -> commits the first only; [0.3, 0.6]
    -> commits the second (the most confident).

    The mask token itself is never a candidate (its logit is dropped before the softmax): committing it would
    leave the position masked and the decoding loop would never end.
    """
    w = windows_at([0], positions[None])
    conf, tokens, _ = confidences(logits[None], mask_id)
    return int(commit_windows(row[None], w, conf, tokens, mask_id, threshold).sum())


def confidences(logits: torch.Tensor, mask_id: int,
                dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(conf, tokens, probs) of logits [..., V]: the probabilities of the vocabulary without the mask token [..., V],
    and the most likely token and its probability [...]. The threshold rule reads them in float64, BlockBatch's
    beliefs in float32 (over whole sequences at a refresh, where float64 probabilities of every position would be
    large)."""
    scores = logits.to(dtype, copy=True)
    scores[..., mask_id] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    conf, tokens = probs.max(-1)
    return conf, tokens, probs


class Windows(NamedTuple):
    """The windows of some rows of x: rows [R], targets [R, Q] (Q the widest; a shorter window is padded with its last
    position), valid [R, Q] (False: padding), the real slots as indices into R * Q (`real` [T]) and as (row of x,
    position) pairs (`at`, [T] twice)."""

    rows: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    real: torch.Tensor
    at: tuple[torch.Tensor, torch.Tensor]


def windows_at(rows: Sequence[int], targets: torch.Tensor, valid: torch.Tensor | None = None) -> Windows:
    """`Windows` of x's `rows` at positions targets [R, Q] (valid: all, when None)."""
    valid = torch.ones_like(targets, dtype=torch.bool) if valid is None else valid
    live = torch.tensor(list(rows), device=targets.device)
    real = valid.flatten().nonzero().squeeze(1)
    return Windows(live, targets, valid, real, (live[:, None].expand_as(targets).flatten()[real],
                                                targets.flatten()[real]))


def commit_windows(x: torch.Tensor, w: Windows, conf: torch.Tensor, tokens: torch.Tensor, mask_id: int,
                   threshold: float) -> torch.Tensor:
    """`threshold_commit` for several rows of x [N, L] in one pass: each row of `w` commits in its window from
    `confidences`' conf and tokens [R, Q] there. Returns what was committed [R, Q] (bool)."""
    current = x[w.rows[:, None], w.targets]
    masked = w.valid & (current == mask_id)
    conf = conf.masked_fill(~masked, -1.0)
    chosen = conf >= threshold
    top = conf.argmax(-1, keepdim=True)  # the most confident masked position of each row: committed if any
    chosen.scatter_(-1, top, masked.gather(-1, top))
    x[w.at] = torch.where(chosen, tokens, current).flatten()[w.real]
    return chosen


def answer_end(row: torch.Tensor, prompt_len: int, mask_id: int, eos_id: int | None) -> int | None:
    """The shared stopping rule: the end (exclusive) of the answer if it is decided, else None."""
    return scan(row[None], prompt_len, mask_id, eos_id)[0][1]


def scan(x: torch.Tensor, prompt_len: int, mask_id: int, eos_id: int | None, counts: bool = False) -> list[tuple]:
    """(first masked offset in the generation region, the answer's end) of each row of x [R, L], each None when there
    is none (no mask left; the stopping rule has not decided), with one read; `counts`: and the tokens decoded in the
    region, in the same read."""
    region = x[:, prompt_len:]
    masked = region == mask_id
    stop = masked if eos_id is None else masked | (region == eos_id)
    where = torch.stack((masked.int().argmax(-1), stop.int().argmax(-1)), 1)  # first mask, first mask-or-EOS
    facts = (where, region.gather(1, where)) + ((masked.sum(-1, keepdim=True),) if counts else ())
    out = []
    for first, stop_at, at_first, at_stop, *left in torch.cat(facts, 1).tolist():  # and the tokens there
        first = first if at_first == mask_id else None
        if eos_id is not None and at_stop == eos_id:  # an EOS with no mask before it
            end = prompt_len + stop_at + 1
        else:  # complete without an EOS: the whole region
            end = x.shape[1] if first is None else None
        out.append((first, end, region.shape[1] - left[0]) if counts else (first, end))
    return out


def host_kernel(host: str, device: torch.device | str):
    """Who does a decode's bookkeeping between model calls (the commits, the stopping rule's scan, BlockBatch's merge):
    the C library `kernels.dllm_host` (returned) or torch operations (None). "auto": the library on a CPU where it
    builds, torch elsewhere; "c": the library (an error where it cannot run); "torch": torch. Both do the same work
    with the same result; on a CPU the library takes one call where torch takes a dozen small operations."""
    if host not in HOSTS:
        raise ValueError(f"host must be one of {HOSTS}, got {host!r}.")
    on_cpu = torch.device(device).type == "cpu"
    if host == "torch" or (host == "auto" and not on_cpu):
        return None
    from ..kernels import dllm_host

    why = dllm_host.unavailable() if on_cpu else f"the rows are on {device}, and the library runs on the CPU"
    if why is None:
        return dllm_host
    if host == "c":
        raise ValueError(f"host='c' asks for the C bookkeeping, which cannot run here: {why}. Pass host='torch'.")
    return None


def _commit(kernel, x: torch.Tensor, w: Windows, logits: torch.Tensor, mask_id: int, eos: int | None,
            threshold: float, prompt_len: int, state: _Branches | None = None) -> list[tuple]:
    """The threshold commit in windows `w` of x from their logits [R, Q, V] (`commit_windows`), then the stopping
    rule's `scan` of the windows' rows (first mask, end, decoded: returned), by `host_kernel`'s choice; `state`: and
    every window slot's beliefs go to its map (BlockBatch's block step)."""
    if kernel is not None:
        return kernel.commit(x, w.rows, w.targets, w.valid, logits, mask_id, eos, threshold,
                             None if state is None else (state.prob, state.eos, state.best), prompt_len)
    conf, tokens, probs = confidences(logits, mask_id)
    if state is not None:
        state.remember(w.rows, _beliefs(conf, tokens, probs, eos, w.real), w.at)
    commit_windows(x, w, conf, tokens, mask_id, threshold)
    return scan(x if len(w.rows) == x.shape[0] else x[w.rows], prompt_len, mask_id, eos, True)


def _book(result: DLLMResult, model: DiffusionModel, cache, kind: str, rows: int, seq_len: int,
          windows: tuple[int, ...] = ()) -> None:
    """Record one model call's shape (what a plan prices) and the query tokens it runs. A block call runs the
    `windows` of its live rows (packed: padding is not run) with the dual cache, and is a full forward of all `rows`
    without it (hub classes without an in-place block cache)."""
    if kind == "full" or cache is None or not model.dual_cache:
        kind, windows = "full", (seq_len,) * rows
    result.forwards.append((kind, tuple(sorted(windows, reverse=True))))
    result.query_tokens += sum(windows)


def check_block_sizes(sizes, gen_length: int, what: str = "block size") -> tuple[int, ...]:
    """`sizes` as a sorted tuple of distinct positive ints dividing `gen_length`; a ValueError that names what was
    found otherwise (before any decoding)."""
    sizes = tuple(sizes)
    wrong = [b for b in sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if not sizes or wrong:
        raise ValueError(f"Every {what} must be a whole number of tokens, 1 or more; got {list(sizes)}"
                         + (f" ({wrong} are not)." if wrong else " (none given)."))
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"The {what}s {list(sizes)} repeat one; each branch needs its own size.")
    if not isinstance(gen_length, int) or gen_length < 1:
        raise ValueError(f"gen_length (max_new_tokens) must be 1 or more tokens, got {gen_length!r}.")
    bad = [b for b in sizes if gen_length % b]
    if bad:
        raise ValueError(f"gen_length {gen_length} must be a multiple of every {what}; not of {bad}.")
    return tuple(sorted(sizes))


def check_threshold(threshold, name: str = "threshold") -> None:
    """A confidence threshold is a number of 0 or more: a probability (0: every masked token at once; above 1: one
    token a step, the reference decode)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"{name} must be a probability of 0 or more (0: every token at once; above 1: one token a "
                         f"step), got {threshold!r}.")


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


def _beliefs(conf: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, eos: int | None,
             real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """((prob, eos) [2, ...] float32, best [...]) from `confidences`: the most likely token's probability and the
    EOS probability, and the token's id; `real`: keep only these slots of the flattened [...] (then [2, T] and
    [T])."""
    both = torch.stack((conf, probs[..., eos] if eos is not None else torch.zeros_like(conf))).float()
    if real is not None:
        both, tokens = both.flatten(1)[:, real], tokens.flatten()[real]
    return both, tokens


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


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class CandidateCost:
    """One branch set decoded on the calibration prompts (means per prompt)."""

    block_sizes: tuple[int, ...]
    nfe: float
    expected_seconds: float  # its forwards priced by the step costs, plus its host time: what the plan compares
    measured_seconds: float  # wall-clock of the calibration runs (noisy: each forward timed once; for reading)
    agreement: float  # fraction of prompts whose answer agrees with the reference set's
    correct: float | None = None  # fraction answered right, where the plan was given a `check`
    refresh_tokens: int | None = REFRESH_TOKENS  # the refresh interval it ran with
    host_seconds: float = 0.0  # the time between its model calls (commits, merge, sync), measured in its runs
    refresh_rows: str = "all"  # what its refreshes ran (`blockbatch_generate`)
    sync_threshold: int = SYNC_THRESHOLD  # how far behind the leader a branch copied it
    validated: float | None = None  # fraction answered right on the plan's validation prompts, where it ran them

    @property
    def key(self) -> tuple:
        """What a decode with this set was run with: (block sizes, refresh interval, refresh rows, sync threshold)."""
        return self.block_sizes, self.refresh_tokens, self.refresh_rows, self.sync_threshold

    def to_dict(self) -> dict:
        return {"block_sizes": list(self.block_sizes), "refresh_tokens": self.refresh_tokens,
                "refresh_rows": self.refresh_rows, "sync_threshold": self.sync_threshold, "nfe": round(self.nfe, 3),
                "expected_seconds": round(self.expected_seconds, 6), "host_seconds": round(self.host_seconds, 6),
                "measured_seconds": round(self.measured_seconds, 6), "agreement": round(self.agreement, 4),
                "correct": None if self.correct is None else round(self.correct, 4),
                "validated": None if self.validated is None else round(self.validated, 4)}


Shape = tuple[str, tuple[int, ...]]  # a model call: ("full" | "block", queries of each row), block rows widest first


@dataclass(frozen=True)
class BlockBatchPlan:
    """Which branches BlockBatch runs, and the measurements that chose them (made by `plan_blockbatch`).

    `step_costs` holds (kind, queries per row, seconds) for every forward shape priced: full forwards of 1..K rows
    at `seq_len`, block forwards of each subset of the candidate windows (packed, so {16, 32} runs 48 queries);
    `candidates` every branch set tried, the reference (all candidate sizes) first; `reason` the decision in words;
    `baseline` Fast-dLLM on the same prompts, where the plan was given a `check` (its `correct` is the bar).
    """

    block_sizes: tuple[int, ...]
    gen_length: int
    seq_len: int
    step_costs: tuple[tuple[str, tuple[int, ...], float], ...]
    candidates: tuple[CandidateCost, ...]
    reason: str
    baseline: CandidateCost | None = None
    refresh_tokens: int | None = REFRESH_TOKENS
    refresh_rows: str = "all"
    sync_threshold: int = SYNC_THRESHOLD

    def seconds(self, kind: str, queries: Sequence[int]) -> float:
        """The priced seconds of one call of this shape (block windows in any order)."""
        queries = tuple(sorted(queries, reverse=True))
        for k, q, s in self.step_costs:
            if (k, q) == (kind, queries):
                return s
        raise KeyError(f"The plan priced no {kind} forward of queries {queries}.")

    @property
    def batched_vs_single(self) -> dict:
        """What a forward of several rows costs against one row of its widest: {"full": {"2": x, ...}, "block":
        {"32+16": x, ...}} (keys as strings, as JSON has them)."""
        out: dict = {"full": {}, "block": {}}
        for kind, queries, seconds in self.step_costs:
            if len(queries) > 1:
                ratio = round(seconds / self.seconds(kind, queries[:1]), 3)
                out[kind][str(len(queries)) if kind == "full" else "+".join(map(str, queries))] = ratio
        return out

    @property
    def chosen(self) -> CandidateCost | None:
        """The calibration run of the chosen set (its branches, refresh interval and rows, sync threshold), or None
        where the plan holds no such run (one made by hand)."""
        return next((c for c in self.candidates if c.key == (self.block_sizes, self.refresh_tokens, self.refresh_rows,
                                                              self.sync_threshold)), None)

    @property
    def expected_vs_fast_dllm(self) -> float | None:
        """The chosen set's expected seconds per answer against Fast-dLLM's on the same calibration prompts (above 1:
        BlockBatch is expected to be the slower on this device), or None where the plan had no `check` and so no
        baseline."""
        chosen = self.chosen
        if self.baseline is None or self.baseline.expected_seconds <= 0 or chosen is None:
            return None
        return chosen.expected_seconds / self.baseline.expected_seconds

    def to_dict(self) -> dict:
        ratio = self.expected_vs_fast_dllm
        return {"block_sizes": list(self.block_sizes), "refresh_tokens": self.refresh_tokens,
                "refresh_rows": self.refresh_rows, "sync_threshold": self.sync_threshold,
                "gen_length": self.gen_length, "seq_len": self.seq_len,
                "reason": self.reason,
                "expected_vs_fast_dllm": None if ratio is None else round(ratio, 4),
                "batched_vs_single": self.batched_vs_single,
                "step_costs": [{"kind": k, "rows": len(q), "queries": list(q), "seconds": round(s, 6)}
                               for k, q, s in self.step_costs],
                "candidates": [c.to_dict() for c in self.candidates],
                "baseline": None if self.baseline is None else self.baseline.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> BlockBatchPlan:
        """The inverse of `to_dict` (costs rounded to the microsecond), e.g. to reuse a plan from a bench report."""
        def cost(c: dict) -> CandidateCost:
            return CandidateCost(tuple(c["block_sizes"]), c["nfe"], c["expected_seconds"], c["measured_seconds"],
                                 c["agreement"], c.get("correct"), c.get("refresh_tokens", REFRESH_TOKENS),
                                 c.get("host_seconds", 0.0), c.get("refresh_rows", "all"),
                                 c.get("sync_threshold", SYNC_THRESHOLD), c.get("validated"))

        return cls(block_sizes=tuple(d["block_sizes"]), refresh_tokens=d.get("refresh_tokens", REFRESH_TOKENS),
                   refresh_rows=d.get("refresh_rows", "all"), sync_threshold=d.get("sync_threshold", SYNC_THRESHOLD),
                   gen_length=d["gen_length"], seq_len=d["seq_len"],
                   step_costs=tuple((c["kind"], tuple(c["queries"]), c["seconds"]) for c in d["step_costs"]),
                   candidates=tuple(cost(c) for c in d["candidates"]), reason=d["reason"],
                   baseline=None if d.get("baseline") is None else cost(d["baseline"]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedModel:
    """A DiffusionModel whose calls' time on `clock` adds up per kind of call in `seconds_of` ({"full": s, "block":
    s}) and in all in `seconds`: what a decode spends outside them is its host time (commits, stopping checks,
    BlockBatch's merge and sync)."""

    def __init__(self, model: DiffusionModel, clock: Callable[[], float], device: torch.device):
        self.model, self.clock, self.device = model, clock, device
        self.seconds_of = {"full": 0.0, "block": 0.0}

    @property
    def seconds(self) -> float:
        return sum(self.seconds_of.values())

    def __getattr__(self, name):
        return getattr(self.model, name)

    def full(self, *args, **kwargs):
        return self._timed("full", args, kwargs)

    def block(self, *args, **kwargs):
        return self._timed("block", args, kwargs)

    def _timed(self, kind: str, args, kwargs):
        _sync(self.device)
        start = self.clock()
        out = getattr(self.model, kind)(*args, **kwargs)
        _sync(self.device)
        self.seconds_of[kind] += self.clock() - start
        return out


@torch.no_grad()
def measure_step_costs(model: DiffusionModel, prompt: torch.Tensor, gen_length: int, shapes: Sequence[Shape],
                       repeats: int = 5, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Median seconds of one model call per shape (kind, queries per row) at the real sequence length
    (`median_seconds`); prompt [1, P].

    The repeats are interleaved across shapes, so a change in the machine's speed (another process, clock
    scaling) falls on every shape alike. Inputs are the prompt then masks, one copy per row; a block call of r rows
    (row i running its queries[i] positions, padded to the widest) runs against the first r rows of one cache that
    a full forward filled (its writes land in that throwaway cache).
    """
    x1 = _start(model, prompt, gen_length)
    p, length, device = prompt.shape[1], x1.shape[1], x1.device
    most = max((len(q) for kind, q in shapes if kind == "block"), default=0)
    shared = model.new_cache()  # one cache for every block shape, each using its first rows: memory of `most` rows
    if shared is not None and most:
        model.full(x1.expand(most, -1).contiguous(), shared)
    calls = {}
    for kind, queries in shapes:
        rows = len(queries)
        x = x1.expand(rows, -1).contiguous()
        if kind == "full":
            calls[(kind, queries)] = lambda x=x: model.full(x, model.new_cache())
            continue
        cache = None
        if shared is not None:
            cache = model.new_cache()
            cache.keys, cache.values = [k[:rows] for k in shared.keys], [v[:rows] for v in shared.values]
        widest = max(queries)
        targets = (p + torch.arange(widest, device=device)).clamp_max(length - 1)[None].expand(rows, -1)
        write = torch.arange(widest, device=device)[None] < torch.tensor(queries, device=device)[:, None]
        calls[(kind, queries)] = lambda x=x, t=targets, w=write, c=cache: model.block(x, t, w, c)
    for call in calls.values():  # warm-up: first-call allocations are not a step's cost
        call()
    return median_seconds(calls, repeats, clock, lambda: _sync(device))


def plan_blockbatch(model: DiffusionModel, prompts: Sequence[torch.Tensor], gen_length: int,
                    candidate_block_sizes: Sequence[int] = BLOCK_SIZES, device=None, *, threshold: float = 0.9,
                    min_branches: int = 2, min_gain: float = 0.05, tie: float = 0.02, min_agreement: float = 0.9,
                    step_seconds: Callable[[str, tuple[int, ...]], float] | None = None, repeats: int = 5,
                    clock: Callable[[], float] = time.perf_counter,
                    agree: Callable[[torch.Tensor, torch.Tensor], bool] = torch.equal,
                    check: Callable[[int, torch.Tensor], bool] | None = None,
                    baseline_block_size: int = 32,
                    refresh_candidates: Sequence[int | None] = REFRESH_CANDIDATES,
                    sync_candidates: Sequence[int] = SYNC_CANDIDATES,
                    price_host: bool | None = None, host: str = "auto",
                    validation: Sequence[torch.Tensor] = (), max_validations: int = 4) -> BlockBatchPlan:
    """Choose BlockBatch's branches by expected wall-clock, from measured step costs.

    NFE counts a batched forward once, but where compute bounds a step (a CPU; a GPU at large batch) a forward of r
    rows costs up to r times one row, so a branch pays only if the forwards it saves outweigh the rows it adds. The
    plan decodes the calibration `prompts` (each [1, P]; draw them apart from any evaluation set) with candidate
    branch sets and prices each run's forwards (`DLLMResult.forwards`) by `step_seconds(kind, queries per row)`; by
    default `measure_step_costs` on this model, for every shape a run can take (full forwards of 1..K rows at the
    first prompt's length, a block forward of every subset of the candidate windows, packed). `price_host` adds each
    run's host time (what it spends between model calls: commits, the merge, the sync), measured in the run itself;
    on a CPU a step's bookkeeping is a fair part of its cost and grows with the branches. None: priced when the step
    costs are measured (both then are seconds of `clock`), not with a `step_seconds` table. The search
    (`_choose`): the cheapest single branch; the cheapest pair, every pair tried at each of `refresh_candidates`
    (the refresh interval: a refresh is a full forward of every distinct branch row, the dearest call a run makes)
    and with each of `REFRESH_ROWS` (every branch's row, or the leader's alone); then greedily the branch whose
    addition lowers the expected seconds most, at the pair's interval and rows; then the chosen set at each sync
    threshold of `sync_candidates` after the first (the search's). Each move is taken while fewer than
    `min_branches`, or while it saves at least `min_gain` of the seconds (a margin over the timings' noise) or as
    much of the forwards at a cost within `tie`. Within a step, sets priced within `tie` of the cheapest are a tie,
    which the fewer forwards decide (NFE on the calibration prompts is exact; a difference of a percent or two in
    seconds is not). A set qualifies only if at least `min_agreement` of its answers agree with those of the
    reference set (all candidate sizes: the paper's BlockBatch); when the search ends on one that does not, the plan
    is the reference. `agree(a, b)` says whether
    two answers to one prompt count as the same: token for token by default; where an answer may be worded freely,
    pass one that compares what is checked. Where the calibration prompts have known answers, pass `check(i,
    sequence)` (is the answer to prompt i right?) instead: a set then qualifies when it answers at least as many
    prompts right as Fast-dLLM (block `baseline_block_size`, the method BlockBatch is measured against, decoded on
    the same prompts: the plan's `baseline`); `hf-dscale bench-dllm` does, with the task's answers. A wide block
    commits far-ahead tokens the model is confident of, and on a freely worded task those can be wrong: the check
    keeps such sets out. `device` moves the prompts; `clock` and `repeats` time; `host`: who does the decodes'
    bookkeeping between model calls (`host_kernel`), as the decodes it plans for will.

    Sixteen prompts price sets well and judge their accuracy poorly: a set a few points less accurate than Fast-dLLM
    often answers all sixteen as well. With `validation` prompts (more of them, known answers: `check(i, sequence)`
    takes i = len(prompts) + j for validation prompt j) the chosen set must also answer at least as many of those
    right as Fast-dLLM; where it does not, the next qualifying set by expected seconds is validated, up to
    `max_validations` sets, and where none does, the one that answered the most right. Each validated set's share
    right is its `validated`, Fast-dLLM's the baseline's.

    `min_branches=1` lets the plan fall to one branch, which is Fast-dLLM with that block size, not BlockBatch.

    Returns a `BlockBatchPlan`; pass it as `blockbatch_generate(..., plan=plan)`.
    """
    sizes = check_block_sizes(sorted(set(candidate_block_sizes)), gen_length, "candidate block size")
    if not prompts:
        raise ValueError("plan_blockbatch needs calibration prompts (a few, drawn apart from the evaluation set).")
    if not 1 <= min_branches <= len(sizes):
        raise ValueError(f"min_branches must be between 1 and the {len(sizes)} candidate sizes, got {min_branches}.")
    if validation and check is None:
        raise ValueError("Validation prompts are judged by their answers: pass check= with them.")
    if check is not None and gen_length % baseline_block_size:
        raise ValueError(f"gen_length {gen_length} must be a multiple of baseline_block_size {baseline_block_size}.")
    prompts = [q.to(device) if device is not None else q for q in prompts]
    seq_len = prompts[0].shape[1] + gen_length
    price_host = step_seconds is None if price_host is None else price_host
    # every shape a run of these sizes can take, priced in one interleaved batch so that all compare alike: a full
    # forward of 1..K rows, a block forward of the live branches' windows (any subset of the sizes; packed)
    grid: list[Shape] = [("full", (seq_len,) * r) for r in range(1, len(sizes) + 1)]
    grid += [("block", tuple(sorted(subset, reverse=True)))
             for r in range(1, len(sizes) + 1) for subset in itertools.combinations(sizes, r)]
    if check is not None and ("block", (baseline_block_size,)) not in grid:
        grid.append(("block", (baseline_block_size,)))  # the baseline's forwards
    if step_seconds is None:
        priced = measure_step_costs(model, prompts[0], gen_length, grid, repeats, clock)
    else:
        priced = {shape: float(step_seconds(*shape)) for shape in grid}
    answers: dict = {}  # block sizes -> the answers [P + n] per prompt
    tried: dict = {}  # block sizes -> CandidateCost, in the order tried

    def measure(combo: tuple, refresh, decode: Callable[[DiffusionModel, torch.Tensor], DLLMResult],
                rows: str = "all", synced: int = SYNC_THRESHOLD) -> CandidateCost:
        results, wall = [], 0.0
        timed = TimedModel(model, clock, prompts[0].device) if price_host else None  # only where host time is priced
        for q in prompts:
            _sync(q.device)
            start = clock()
            results.append(decode(model if timed is None else timed, q))
            _sync(q.device)
            wall += clock() - start
        answers[combo, refresh, rows, synced] = mine = [r.sequence for r in results]
        reference = answers.get((sizes, refresh_candidates[0], "all", SYNC_THRESHOLD), mine)
        same = sum(bool(agree(a, b)) for a, b in zip(mine, reference))
        right = None if check is None else sum(bool(check(i, a)) for i, a in enumerate(mine)) / len(prompts)
        seconds = sum(priced[(kind, (seq_len,) * len(queries) if kind == "full" else queries)]  # full: at seq_len
                      for r in results for kind, queries in r.forwards)
        n = len(prompts)
        host = (wall - timed.seconds) / n if price_host else 0.0
        return CandidateCost(combo, sum(r.nfe for r in results) / n, seconds / n + host, wall / n, same / n, right,
                             refresh, host, rows, synced)

    def evaluate(combo: tuple[int, ...], refresh: int | None = refresh_candidates[0], rows: str = "all",
                 synced: int = SYNC_THRESHOLD) -> CandidateCost:
        """Decode the calibration prompts with these branches; price the forwards each run made."""
        key = combo, refresh, rows, synced
        if key not in tried:
            tried[key] = measure(combo, refresh, lambda m, q: blockbatch_generate(
                m, q, gen_length, combo, threshold, refresh_tokens=refresh, refresh_rows=rows, sync_threshold=synced,
                host=host), rows, synced)
        return tried[key]

    reference = evaluate(sizes)  # first: the others' agreement is with its answers
    baseline = None
    if check is None:
        def qualifies(c: CandidateCost) -> bool:
            return c.agreement >= min_agreement

        def shortfall(c: CandidateCost) -> str:
            return f"agrees with the reference on {100 * c.agreement:.0f}% of the prompts (< {100 * min_agreement:.0f}%)"
    else:
        baseline = measure(("fast-dllm",), None, lambda m, q: fast_dllm_generate(
            m, q, gen_length, baseline_block_size, threshold, host=host))

        def qualifies(c: CandidateCost) -> bool:
            return c.correct >= baseline.correct

        def shortfall(c: CandidateCost) -> str:
            return f"answers {100 * c.correct:.0f}% right, Fast-dLLM {100 * baseline.correct:.0f}%"
    chosen, steps = _choose(evaluate, sizes, refresh_candidates, min_branches, min_gain, tie, qualifies, shortfall,
                            sync_candidates)
    if validation and check is not None:
        offset = len(prompts)
        validation = [q.to(device) if device is not None else q for q in validation]

        def right_on_validation(decode: Callable[[torch.Tensor], DLLMResult]) -> float:
            return sum(bool(check(offset + j, decode(q).sequence)) for j, q in enumerate(validation)) / len(validation)

        baseline = dataclasses.replace(baseline, validated=right_on_validation(lambda q: fast_dllm_generate(
            model, q, gen_length, baseline_block_size, threshold, host=host)))
        pool = [c for c in tried.values() if qualifies(c) and len(c.block_sizes) >= min_branches]
        order = [chosen] + sorted((c for c in pool if c.key != chosen.key), key=lambda c: (c.expected_seconds, c.nfe))
        checked = []
        for c in order[:max_validations]:
            c = tried[c.key] = dataclasses.replace(c, validated=right_on_validation(
                lambda q, c=c: blockbatch_generate(model, q, gen_length, c.block_sizes, threshold,
                                                   refresh_tokens=c.refresh_tokens, refresh_rows=c.refresh_rows,
                                                   sync_threshold=c.sync_threshold, host=host)))
            checked.append(c)
            if c.validated >= baseline.validated:
                break
        pick = next((c for c in checked if c.validated >= baseline.validated), None)
        n = len(validation)
        said = ", ".join(f"{_name(c)} {round(c.validated * n)}" for c in checked)
        if pick is None:
            pick = max(checked, key=lambda c: (c.validated, -c.expected_seconds))
        steps.append(f"validated on {n} more prompts (right: {said}; Fast-dLLM {round(baseline.validated * n)}): "
                     + (f"kept {_name(pick)}" if pick.key == chosen.key else f"took {_name(pick)}"))
        chosen = pick
    steps.append(f"chose {_name(chosen)}: {chosen.expected_seconds * 1e3:.2f} ms expected per answer (NFE "
                 f"{chosen.nfe:.2f}) vs {reference.expected_seconds * 1e3:.2f} ms for all of {_name(reference)} "
                 f"(NFE {reference.nfe:.2f})")
    if baseline is not None and baseline.expected_seconds > 0:
        ratio = chosen.expected_seconds / baseline.expected_seconds
        steps.append(f"Fast-dLLM (block {baseline_block_size}) {baseline.expected_seconds * 1e3:.2f} ms (NFE "
                     f"{baseline.nfe:.2f}): {_name(chosen)} is expected at {ratio:.2f}x its time" + (
                         "" if ratio < 1 else ", so on this device its branches are not expected to pay for their "
                         "steps"))
    return BlockBatchPlan(block_sizes=chosen.block_sizes, gen_length=gen_length, seq_len=seq_len,
                          step_costs=tuple((*shape, priced[shape]) for shape in sorted(priced, key=_shape_order)),
                          candidates=tuple(tried.values()), reason="; ".join(steps), baseline=baseline,
                          refresh_tokens=chosen.refresh_tokens, refresh_rows=chosen.refresh_rows,
                          sync_threshold=chosen.sync_threshold)


def _choose(evaluate: Callable[..., CandidateCost], sizes: tuple[int, ...], refreshes: Sequence[int | None],
            min_branches: int, min_gain: float, tie: float, qualifies: Callable[[CandidateCost], bool],
            shortfall: Callable[[CandidateCost], str], syncs: Sequence[int] = (SYNC_THRESHOLD,)
            ) -> tuple[CandidateCost, list[str]]:
    """The decision (see `plan_blockbatch`): the cheapest single branch; the cheapest pair, every pair at every
    refresh interval in `refreshes` and with each of `REFRESH_ROWS`; then greedy forward selection at the pair's
    interval and rows, by expected seconds (within `tie` of the cheapest: by NFE), among the sets that `qualifies`
    (`shortfall` says why one does not); a move is taken where it saves `min_gain` of the seconds, or as much of the
    forwards at a cost within `tie`; at last the chosen set at each sync threshold of `syncs` after the first (the
    search's), by the same rule. `evaluate(block_sizes, refresh, rows, sync)`. Returns the chosen set and the steps
    that led to it, in words."""

    seen: list[CandidateCost] = []

    def best(costs: list[CandidateCost]) -> CandidateCost:  # qualifying first; the cheapest, ties to fewer forwards
        seen.extend(costs)
        pool = [c for c in costs if qualifies(c)] or costs
        cheapest = min(c.expected_seconds for c in pool)
        close = [c for c in pool if c.expected_seconds <= cheapest * (1 + tie)]
        return min(close, key=lambda c: (c.nfe, c.expected_seconds, len(c.block_sizes)))

    current = best([evaluate((b,)) for b in sizes])
    steps = [f"{_name(current)} {current.expected_seconds * 1e3:.2f} ms: the cheapest single branch"]
    while len(current.block_sizes) < len(sizes):
        if len(current.block_sizes) == 1:  # every pair: the best pair need not hold the best single branch
            ext = best([evaluate(pair, r, rows) for r in refreshes for rows in REFRESH_ROWS
                        for pair in itertools.combinations(sizes, 2)])
        else:
            ext = best([evaluate(tuple(sorted(current.block_sizes + (b,))), current.refresh_tokens,
                                 current.refresh_rows) for b in sizes if b not in current.block_sizes])
        gain = 1 - ext.expected_seconds / current.expected_seconds if current.expected_seconds > 0 else 0.0
        fewer = 1 - ext.nfe / current.nfe if current.nfe > 0 else 0.0
        move = f"-> {_name(ext)} {ext.expected_seconds * 1e3:.2f} ms"
        if len(current.block_sizes) < min_branches:
            steps.append(f"{move}: needed for {min_branches} branches")
        elif qualifies(ext) and gain >= min_gain:
            steps.append(f"{move}: saves {100 * gain:.1f}%")
        elif qualifies(ext) and gain >= -tie and fewer >= min_gain:
            steps.append(f"{move}: {100 * fewer:.1f}% fewer forwards at " + (
                f"{100 * -gain:.1f}% more time (within the tie)" if gain < 0 else f"{100 * gain:.1f}% less time"))
        else:
            why = (shortfall(ext) if not qualifies(ext)
                   else f"saves {100 * gain:.1f}% < {100 * min_gain:.0f}%" if gain >= 0
                   else f"costs {-100 * gain:.1f}% more")
            steps.append(f"{move}: {why}; stop")
            break
        current = ext
    if not qualifies(current):
        others = [c for c in seen if qualifies(c) and len(c.block_sizes) >= min_branches]
        if others:
            fallback = min(others, key=lambda c: (c.expected_seconds, len(c.block_sizes)))
            steps.append(f"{_name(current)} {shortfall(current)}: " + (
                "the reference set" if fallback.block_sizes == sizes
                else f"the cheapest set tried that qualifies, {_name(fallback)}"))
            current = fallback
        else:
            steps.append(f"{_name(current)} {shortfall(current)}: the reference set")
            current = evaluate(sizes)
    if len(syncs) > 1 and len(current.block_sizes) > 1:
        variants = [evaluate(current.block_sizes, current.refresh_tokens, current.refresh_rows, t) for t in syncs[1:]]
        pick = best([current, *variants])
        if pick is not current:
            steps.append(f"-> {_name(pick)} {pick.expected_seconds * 1e3:.2f} ms: a sync threshold of "
                         f"{pick.sync_threshold} tokens, NFE {pick.nfe:.2f} against {current.nfe:.2f}")
            current = pick
    return current, steps


def _shape_order(shape: Shape) -> tuple:
    kind, queries = shape
    return kind, len(queries), queries


def _name(c: CandidateCost) -> str:
    """e.g. {16,32}/r64/leader/s4: branches 16 and 32, a refresh of the leader's row every 64 tokens, a sync of a
    branch 4 tokens behind (the sync threshold is left out where it is the paper's 8)."""
    return "{" + ",".join(map(str, c.block_sizes)) + "}" + f"/r{c.refresh_tokens}" + (
        "/leader" if c.refresh_rows == "leader" else "") + (
        f"/s{c.sync_threshold}" if c.sync_threshold != SYNC_THRESHOLD else "")
