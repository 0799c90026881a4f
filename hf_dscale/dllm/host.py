"""What the diffusion-LM decoders do between model calls, and their options: commit the confident masked positions
of each window (`threshold_commit`, `commit_windows`), scan the rows for the stopping rule (`scan`, `answer_end`),
the beliefs a merge reads (`_beliefs`), the NFE and time bookkeeping (`_book`), and the checks of block sizes and
thresholds. On a CPU a C library does a step's commit, scan and merge in one call (`kernels/dllm_host.c`, built on
first use); elsewhere, or with `host="torch"`, torch does (`host_kernel`). The decodes are the same either way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..models.dllm import DiffusionModel

if TYPE_CHECKING:
    from .decode import _Branches

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



def _beliefs(conf: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, eos: int | None,
             real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """((prob, eos) [2, ...] float32, best [...]) from `confidences`: the most likely token's probability and the
    EOS probability, and the token's id; `real`: keep only these slots of the flattened [...] (then [2, T] and
    [T])."""
    both = torch.stack((conf, probs[..., eos] if eos is not None else torch.zeros_like(conf))).float()
    if real is not None:
        both, tokens = both.flatten(1)[:, real], tokens.flatten()[real]
    return both, tokens
