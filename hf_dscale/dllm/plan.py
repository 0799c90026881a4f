"""BlockBatch's plan: which branch set, refresh interval and sync threshold decode a model's prompts in the least
expected time, measured (`plan_blockbatch` -> `BlockBatchPlan`)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models.dllm import DiffusionModel
from ..timing import median_seconds
from .decode import _start, blockbatch_generate, fast_dllm_generate
from .host import (
    BLOCK_SIZES,
    REFRESH_CANDIDATES,
    REFRESH_ROWS,
    REFRESH_TOKENS,
    SYNC_CANDIDATES,
    SYNC_THRESHOLD,
    DLLMResult,
    check_block_sizes,
)


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
            return (f"agrees with the reference on {100 * c.agreement:.0f}% of the prompts "
                    f"(< {100 * min_agreement:.0f}%)")
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
