"""The drafter's side of `target.generate(**inputs, assistant_model=drafter)`.

transformers' `AssistedCandidateGenerator` calls `drafter.generate(input_ids, ...)` with token ids only,
and verifies the returned candidates itself (greedy prefix match, or the speculative-sampling rule with
the drafter's `scores`). A block-diffusion drafter also needs the target's hidden states. We get them
without touching transformers' internals:

1. **Which target?** On the first call of a `generate()` the drafter walks up the Python call stack to
   the frame of the target's `generate` whose public argument `assistant_model` is this drafter.
   `drafter.bind_target(target)` sets it explicitly instead.
2. **Hidden states.** Forward hooks on the tapped decoder layers (public `torch.nn.Module` API) keep
   the outputs of the target's latest forward: the verification pass over `[last token | candidates]`.
   The drafter knows which sequence positions that pass covered (it wrote the candidates), so it
   takes the ones that were accepted.
3. **First call.** The target has not run yet, so there are no features: the drafter proposes one
   token with a one-hot distribution. The target's prefill then covers the prompt (and that token),
   and from the second call on the drafter proposes full blocks.
4. **How much of a block.** On a CPU a wide verify costs more than a narrow one, so by default there the
   drafter proposes the head of each block that gives the most tokens expected per second, from its own
   confidences and the target's verify costs measured once (`DraftCut`, `throughput_length` below);
   `drafter.draft_confidence` set to a number cuts at that cumulative confidence instead
   (`draft_length`). Elsewhere the whole block.

A new `generate()` is recognised by its own copy of the generation config, which transformers' assisted
generator owns; when that copy is freed (the `generate()` has returned), the tap hooks are removed. This file is
shipped with
the model as remote code, so it imports only torch, transformers' public API and its siblings.
"""

from __future__ import annotations

import inspect
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from .modeling_dscale import DraftContextCache, tap_layers


class TapRecorder:
    """Forward hooks that keep the outputs of the tapped target layers from the latest forward."""

    def __init__(self, target: nn.Module, layer_ids: list[int]):
        layers = tap_layers(target)
        self.outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._handles = [layers[i].register_forward_hook(self._hook(j)) for j, i in enumerate(layer_ids)]

    def _hook(self, slot: int):
        def hook(module, args, output):
            self.outputs[slot] = output[0] if isinstance(output, tuple) else output

        return hook

    def taps(self) -> torch.Tensor:
        """[B, q, T, H] for the q positions of the latest target forward."""
        if any(o is None for o in self.outputs):
            raise RuntimeError("The target has not run since the tap hooks were installed.")
        return torch.stack(self.outputs, dim=2)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass
class DraftGenerateOutput:
    """What `AssistedCandidateGenerator` reads back from `assistant.generate` (by attribute).

    The drafter keeps its own context cache, so it hands transformers no cache, under either of the
    names transformers has read it by (`past_key_values` before 5.24, `cache` since). A plain dataclass,
    not a `ModelOutput`, so that the old name raises no deprecation warning.
    """

    sequences: torch.LongTensor | None = None
    scores: tuple[torch.FloatTensor, ...] | None = None
    cache: None = None
    past_key_values: None = None


# How many drafts a confidence cut keeps at least where it is not measured (off the CPU, where a cut is rarely used
# since a wide verify costs about one step, and in `draft_length` when the caller gives none). On a CPU the cheapest
# verify width above one token depends on the BLAS: on one 2-core machine 2 and 3 new tokens cost more than 5
# (SmolLM2 with a 300-token cache, medians of 12: 42 / 65 / 80 / 62 / 58 ms for 1-5 new tokens), on another 2 and 3
# are the cheap ones (42 / 47 / 53 / 69 / 71 ms), so there it is measured (`min_drafts_for`).
FALLBACK_MIN_DRAFTS = 4


def min_drafts_for(target: nn.Module, forward=None) -> int:
    """The fewest drafts a confidence cut verifies with `target`: measured on a CPU, else `FALLBACK_MIN_DRAFTS`.

    The measurement (~2 s for SmolLM2-135M on 2 cores) times forwards of 2-8 new tokens through `forward` (the
    verifies' own, default the target's) and keeps one less (the anchor is verified too) than the widest that costs
    at most 10% more than the cheapest. Callers keep the answer (the engine's `Plan`, the assistant's session cut).
    """
    if next(target.parameters()).device.type != "cpu":
        return FALLBACK_MIN_DRAFTS
    return cheap_verify_width(target, forward=forward) - 1


def cut_minimum(target: nn.Module, draft_confidence: float | str, forward=None) -> int | None:
    """`min_drafts_for(target, forward)` when a confidence cut is in force (`draft_confidence > 0`), else None."""
    return min_drafts_for(target, forward) if draft_confidence != AUTO and draft_confidence > 0 else None


def median_seconds(jobs: dict, repeats: int = 3, clock=time.perf_counter, sync=lambda: None) -> dict:
    """{key: median seconds of `jobs[key]()`} over `repeats` rounds that run every job in turn, so a slow spell
    of the machine hits all of them alike and a single outlier is outvoted."""
    seconds: dict = {key: [] for key in jobs}
    for _ in range(repeats):
        for key, job in jobs.items():
            sync()
            start = clock()
            job()
            sync()
            seconds[key].append(clock() - start)
    return {key: sorted(s)[len(s) // 2] for key, s in seconds.items()}


@torch.no_grad()
def verify_costs(target: nn.Module, widths, repeats: int = 3, batch_size: int = 1,
                 clock=time.perf_counter, forward=None) -> dict[int, float]:
    """Seconds of a target forward of each of `widths` new tokens (per row of `batch_size` rows).

    Forwards without a cache: their matrix products, which decide how cost grows with width on a CPU, are
    those of a verify. Widths are interleaved and each cost is the median of `repeats` (`median_seconds`).
    `forward(**kwargs)` runs the forward the verifies will run (default: `target(**kwargs)`).
    """
    forward = forward or target
    device = next(target.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.zeros(batch_size, max(widths), dtype=torch.long, device=device)
    forward(input_ids=ids[:, :1], use_cache=False)  # warm-up
    jobs = {w: (lambda w=w: forward(input_ids=ids[:, :w], use_cache=False)) for w in widths}
    return median_seconds(jobs, repeats, clock, sync)


CHEAP_WIDTHS = range(2, 9)  # the verify widths (anchor included) a confidence cut's minimum is chosen among


def cheap_verify_width(target: nn.Module, widths: range = CHEAP_WIDTHS, repeats: int = 3, tolerance: float = 1.1,
                       clock=time.perf_counter, forward=None) -> int:
    """The widest of `widths` new tokens whose forward (through `forward`, as in `verify_costs`) costs at most
    `tolerance` x the cheapest of them."""
    return widest_cheap(verify_costs(target, widths, repeats, clock=clock, forward=forward), widths, tolerance)


def widest_cheap(costs: dict[int, float], widths, tolerance: float = 1.1) -> int:
    """The widest of `widths` whose cost in `costs` is at most `tolerance` x the cheapest of them."""
    cheapest = min(costs[w] for w in widths)
    return max(w for w in widths if costs[w] <= tolerance * cheapest)


def min_drafts_from(costs: dict[int, float]) -> int | None:
    """`min_drafts_for`'s rule over costs already measured (a compiled verify's): one less than the widest cheap width
    of `CHEAP_WIDTHS` that `costs` covers; None if it covers none."""
    widths = [w for w in CHEAP_WIDTHS if w in costs]
    return widest_cheap(costs, widths) - 1 if widths else None


def verify_costs_for(target: nn.Module, max_width: int, batch_size: int = 1, forward=None) -> dict[int, float]:
    """`verify_costs` over widths 1..max_width at `batch_size` (~3 s for SmolLM2-135M and 16 widths on 2 CPU
    cores); callers keep the answer."""
    return verify_costs(target, range(1, max_width + 1), batch_size=batch_size, forward=forward)


# The cut used when none is given on a CPU: `AUTO`, the throughput cut below. There a 4-token verify of
# SmolLM2 on 2 cores costs ~1.5x a one-token step and a 16-token one ~2x, and the costs jump where the BLAS
# changes kernels (3 -> 4 tokens on one machine), so the cut reads measured costs. On a GPU the whole block
# costs about one step, so all of it is verified. `CPU_DRAFT_CONFIDENCE` is the confidence cut that D²SD's
# token trees use for `AUTO` (a tree's width is not a chain's).
AUTO = "auto"
CPU_DRAFT_CONFIDENCE = 0.1


def resolve_draft_confidence(threshold: float | str | None, device) -> float | str:
    """The cut to use: `threshold` if given (`"auto"`, or a number checked to be in [0, 1)), else the
    default for `device` (`"auto"` on a CPU, 0 = whole blocks elsewhere)."""
    if threshold is None:
        return AUTO if torch.device(device).type == "cpu" else 0.0
    if isinstance(threshold, str) and threshold.lower() == AUTO:
        return AUTO
    if isinstance(threshold, str) or not 0.0 <= threshold < 1.0:
        raise ValueError(f"draft_confidence must be 'auto' or a number in [0, 1) (0 = verify the whole block), "
                         f"got {threshold!r}.")
    return float(threshold)


def draft_length(q_logits: torch.Tensor, threshold: float, active: list[bool] | None = None,
                 minimum: int | None = None) -> int:
    """How many drafts of a block to verify: the longest run whose cumulative drafter confidence stays >= threshold.

    The confidence of draft k is the top probability of its distribution q_k, a property of q_k and not of
    the token drawn from it, so the cut is decided before each draft is seen and speculative sampling
    stays lossless. The product c_1..c_k estimates the chance that drafts 1..k are all accepted. At least
    `minimum` drafts are kept (`min_drafts_for(target, forward)`; if None, `FALLBACK_MIN_DRAFTS`);
    rows share the block width, so the widest active row decides.

    Example: confidences [0.9, 0.8, 0.6, 0.9, 0.9], threshold 0.5 -> cumulative [0.9, 0.72, 0.43, ...]
    -> 2 drafts, raised to `minimum`.
    """
    k = q_logits.shape[1]
    if threshold <= 0:
        return k
    return confidence_cut(chances_of(q_logits, active), k, threshold, minimum)


def confidence_cut(chances: list[list[float]], k: int, threshold: float, minimum: int | None = None) -> int:
    """`draft_length` from each active row's chances c_1, c_1 c_2, ... (host lists, as `chances_of` reads them)."""
    if threshold <= 0:
        return k
    longest = max((next((i for i, c in enumerate(row) if c < threshold), len(row)) for row in chances), default=k)
    if minimum is None:
        minimum = FALLBACK_MIN_DRAFTS
    return min(k, max(minimum, 1, longest))


def throughput_length(q_logits: torch.Tensor, costs: dict[int, float], overhead: float = 0.0,
                      active: list[bool] | None = None) -> int:
    """How many drafts of a block to verify: the n with the most tokens expected per second of the cycle.

    With n drafts a row commits 1 + c_1 + c_1 c_2 + ... + c_1...c_n tokens in expectation (c_k: the top
    probability of q_k, as in `draft_length`, so sampling stays lossless), and the cycle takes `overhead`
    (drafting and bookkeeping) plus `costs[n + 1]`, the verify forward of the anchor and n drafts. Rows
    share the block width, so their expectations add up.

    Example: confidences [0.9, 0.8, 0.5], costs {2: 40, 3: 42, 4: 54} (ms), overhead 10 -> 1.9/50, 2.62/52,
    2.98/64 -> 2 drafts (the third would add 0.36 tokens for 12 more ms).
    """
    return throughput_cut(chances_of(q_logits, active), q_logits.shape[1], costs, overhead)


def throughput_cut(chances: list[list[float]], k: int, costs: dict[int, float], overhead: float = 0.0) -> int:
    """`throughput_length` from each active row's chances c_1, c_1 c_2, ... (host lists, as `chances_of` reads
    them); k drafts at most."""
    if not chances:
        return k
    expected = [float(len(chances))]  # tokens expected with 0 drafts: one per row
    for n in range(k):
        expected.append(expected[-1] + sum(row[n] for row in chances))
    return max(range(1, k + 1), key=lambda n: (expected[n] / (overhead + costs[n + 1]), -n))


def chances_of(q_logits: torch.Tensor, active: list[bool] | None = None) -> list[list[float]]:
    """c_1, c_1 c_2, ... (c_k: the top probability of q_k) of each active row of q_logits [B, K, V], read back in
    one transfer."""
    rows = q_logits.float().softmax(-1).amax(-1).cumprod(-1).tolist()
    return rows if active is None else [row for row, on in zip(rows, active) if on]


@dataclass
class DraftCut:
    """How many drafts of each block to verify, decided from the drafter's confidences only.

    `costs` set: `throughput_length` over those measured verify costs; else `threshold` > 0: `draft_length`
    (a confidence cut, at least `minimum` drafts); else the whole block.
    """

    threshold: float = 0.0
    minimum: int | None = None
    costs: dict[int, float] | None = None

    @classmethod
    def for_target(cls, target: nn.Module, draft_confidence: float | str, block_size: int,
                   batch_size: int = 1, forward=None) -> "DraftCut":
        """The cut for a resolved `draft_confidence` (`resolve_draft_confidence`), measuring what it needs (verifies
        run `forward`, default the target's own); call it before tap hooks are installed."""
        if draft_confidence == AUTO:
            return cls(costs=verify_costs_for(target, block_size, batch_size, forward))
        return cls(draft_confidence, cut_minimum(target, draft_confidence, forward))

    def length(self, q_logits: torch.Tensor, active: list[bool] | None = None, overhead: float = 0.0) -> int:
        if self.costs is None and self.threshold <= 0:
            return q_logits.shape[1]  # the whole block: nothing to read
        return self.length_of(chances_of(q_logits, active), q_logits.shape[1], overhead)

    def length_of(self, chances: list[list[float]], k: int, overhead: float = 0.0) -> int:
        """`length` from the active rows' chances on the host (`chances_of`, or a draft's `on_host` read); k: the
        drafts of a block."""
        if self.costs is not None:
            return throughput_cut(chances, k, self.costs, overhead)
        return confidence_cut(chances, k, self.threshold, self.minimum)


class DScaleCandidateGenerator(CandidateGenerator):
    """transformers' `CandidateGenerator` contract for a DScale/DFlash drafter (batch size 1).

    `get_candidates(input_ids)` returns `[input_ids | block of drafts]` and the processed draft logits.
    The target's hidden states of the accepted tokens come from forward hooks on the tapped layers
    (`TapRecorder`), so the generator needs nothing from the verify loop but the ids.
    """

    def __init__(self, drafter, cut: DraftCut, generation_config=None, logits_processor=None):
        self.drafter, self.cut = drafter, cut
        # Held weakly: the copy belongs to transformers' assisted generator and is freed when its generate() ends.
        self._generation_config = None if generation_config is None else weakref.ref(generation_config)
        self.do_sample = bool(getattr(generation_config, "do_sample", False))
        # [E] or None, on the drafter's device: a block is proposed up to its first EOS, included
        self.eos = eos_ids(generation_config, drafter.norm.weight.device)
        self.logits_processor = logits_processor
        self.draft_seconds, self.blocks = 0.0, 0  # drafting time per block: the throughput cut's overhead
        self.recorder = TapRecorder(drafter.target, drafter.config.target_layer_ids)
        self.cache = DraftContextCache(drafter.config.num_hidden_layers)
        self.context_len = 0  # sequence positions whose features the drafter has ingested
        self.covered_end: int | None = None  # sequence length at the end of the target's latest forward
        self.vocab = None  # the drafter's proposal set (`DraftVocab`), built at the first block

    @property
    def generation_config(self):
        """The generation config of the `generate()` this generator serves (None once that has returned)."""
        return None if self._generation_config is None else self._generation_config()

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, max_new_tokens: int | None = None, **unused):
        start = time.perf_counter()
        drafter, length = self.drafter, input_ids.shape[1]
        gamma = drafter.config.block_size
        budget = gamma - 1 if max_new_tokens is None else min(max_new_tokens, gamma - 1)
        if self.covered_end is None:
            # No target features yet: one token with a one-hot distribution (a valid q for any rule).
            tokens = input_ids[:, -1:]
            scores = torch.full((1, 1, drafter.config.vocab_size), float("-inf"), device=input_ids.device)
            scores[0, 0, tokens[0, 0]] = 0.0
        else:
            taps = self.recorder.taps()
            first = self.covered_end - taps.shape[1]  # sequence position of taps[:, 0]
            if self.context_len < first or length - 1 > self.covered_end:
                raise RuntimeError("The target's hidden states for the accepted tokens were not captured.")
            new = taps[:, self.context_len - first : length - 1 - first]
            device = drafter.norm.weight.device
            if self.vocab is None:  # stays None for a drafter without a draft vocab (then this is free)
                self.vocab = drafter.draft_vocab_for(input_ids.to(device))
            else:
                self.vocab.add(input_ids[:, self.context_len :].to(device))
            do_sample = self.do_sample
            # Greedy without processors, the proposal and its cut need only the draft vocabulary's columns; the
            # kept drafts' scores are spread over the whole vocabulary afterwards (transformers reads that shape).
            compact = self.vocab is not None and not self.logits_processor and not do_sample
            logits = drafter.draft_logits(
                input_ids[:, -1:].to(device),
                new.to(device),
                torch.tensor([length - 1], device=device),
                torch.arange(self.context_len, length - 1, device=device)[None],
                self.cache,
                vocab=self.vocab,
                compact=compact,
            )
            self.context_len = length - 1
            tokens, scores = choose_tokens(logits[:, :budget], input_ids, self.logits_processor, do_sample)
            overhead = self.draft_seconds / self.blocks if self.blocks else 0.0
            n = self.cut.length(scores, overhead=overhead)
            tokens, scores = tokens[:, :n], scores[:, :n]
            if compact:
                tokens, scores = self.vocab.ids[tokens], self.vocab.spread(scores)
            if self.eos is not None:  # nothing after an EOS: some transformers keep every accepted token
                ends = torch.isin(tokens[0], self.eos).nonzero()
                if ends.numel():
                    n = int(ends[0, 0]) + 1
                    tokens, scores = tokens[:, :n], scores[:, :n]
            tokens, scores = tokens.to(input_ids.device), scores.to(input_ids.device)
            self.blocks += 1
            self.draft_seconds += time.perf_counter() - start
        self.covered_end = length + tokens.shape[1]
        return torch.cat((input_ids, tokens), dim=1), scores

    def update_candidate_strategy(self, input_ids, scores, num_matches) -> None:
        """Block size is fixed by training; nothing to adapt."""

    def close(self) -> None:
        self.recorder.remove()


def eos_ids(generation_config, device=None) -> torch.Tensor | None:
    """The generation config's EOS ids as a tensor [E] on `device`, or None when it has none."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        return None
    eos = torch.as_tensor(eos, dtype=torch.long, device=device).flatten()
    return eos if eos.numel() else None


# Criteria whose stop transformers' assisted loop finds itself (a length, a time, an EOS ended a block on).
BLOCK_SAFE_CRITERIA = (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria)


@dataclass
class CallingGenerate:
    """What the running `target.generate(..., assistant_model=drafter)` was given, read from its public arguments."""

    target: nn.Module | None = None
    stop_strings: list | None = None  # `stop_strings=` or the generation config's
    own_criteria: list | None = None  # the user's `stopping_criteria=` that the assisted loop cannot apply exactly


def find_calling_generate(drafter: nn.Module) -> CallingGenerate:
    """The `generate` running with `drafter` as its assistant, found on the call stack: the frame of a module's
    method whose argument `assistant_model` is `drafter` (`generate`'s public argument), and its public arguments
    `stopping_criteria`, `generation_config` and `stop_strings=`.

    The walk starts at the caller's frame and keeps no frame or locals snapshot afterwards, so no reference cycle
    holds the running `generate()`'s objects (and the tap hooks) alive after it returns."""
    frame = inspect.currentframe().f_back
    try:
        while frame is not None:
            local = frame.f_locals
            owner, assistant = local.get("self"), local.get("assistant_model")
            if assistant is drafter and isinstance(owner, nn.Module) and owner is not drafter:
                kwargs = local.get("kwargs") if isinstance(local.get("kwargs"), dict) else {}
                strings = kwargs.get("stop_strings") or getattr(local.get("generation_config"), "stop_strings", None)
                own = [c for c in local.get("stopping_criteria") or () if not isinstance(c, BLOCK_SAFE_CRITERIA)]
                return CallingGenerate(owner, strings or None, own or None)
            frame = frame.f_back
        return CallingGenerate()
    finally:
        del frame


def refuse_unchecked_stops(call: CallingGenerate) -> None:
    """transformers' assisted loop asks the stopping criteria once per accepted block, about its last token, so a
    stop string or a criterion of the user's own that fires inside a block would let the output run past it."""
    if call.stop_strings or call.own_criteria:
        found = f"stop strings {call.stop_strings}" if call.stop_strings else \
            f"stopping criteria {[type(c).__name__ for c in call.own_criteria]}"
        raise ValueError(
            f"generate(assistant_model=drafter) was given {found}. transformers' assisted loop checks those only "
            "at the end of each accepted block, so the output could run past them. Pass them to hf_dscale's "
            "engine instead, which checks every token: generate(..., custom_generate=hf_dscale.custom_generate, "
            "drafter=drafter, stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, strings)])), "
            "or with custom_generate=\"<a folder or Hub id holding hf_dscale's custom_generate>\" and "
            "trust_remote_code=True."
        )


def choose_tokens(
    logits: torch.Tensor,  # [B, K, V] raw draft logits
    prefix_ids: torch.Tensor,  # [B, L] committed sequence before the block
    logits_processor=None,
    do_sample: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick draft tokens position by position under the target's logits processors.

    Position k is processed with the prefix extended by the tokens chosen at 0..k-1, so the returned
    processed logits q_k [B, K, V] are exactly the distributions the tokens [B, K] were drawn from
    (argmax when greedy), as speculative sampling requires.
    """
    logits = logits.float()
    if not logits_processor and not do_sample:
        return logits.argmax(-1), logits
    tokens, processed = [], []
    ids = prefix_ids
    for k in range(logits.shape[1]):
        scores = logits[:, k]
        for processor in logits_processor or ():  # transformers passes a plain list here
            scores = processor(ids, scores)
        if do_sample:
            probs = torch.softmax(scores, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            token = scores.argmax(-1)
        tokens.append(token)
        processed.append(scores)
        ids = torch.cat((ids, token[:, None]), dim=1)
    return torch.stack(tokens, 1), torch.stack(processed, 1)


def _session(drafter, generation_config, logits_processor) -> DScaleCandidateGenerator:
    """The generator of the running `generate()`, recognised by its own copy of the generation config."""
    session = drafter._assist
    if session is not None and generation_config is not None and session.generation_config is generation_config:
        return session
    if session is not None:
        _end_session(drafter, session)
    call = find_calling_generate(drafter)
    refuse_unchecked_stops(call)
    caller = call.target
    if caller is not None and caller is not drafter.target:
        drafter.bind_target(caller)
    if drafter.target is None:
        raise RuntimeError(
            "DScaleDrafter.generate is the assistant side of `target.generate(..., assistant_model=drafter)` and "
            "could not find the calling target. Call it through the target, or bind one with "
            "`drafter.bind_target(target)`."
        )
    session = DScaleCandidateGenerator(drafter, session_cut(drafter), generation_config, logits_processor)
    drafter._assist = session
    if generation_config is not None:  # freed when the target's generate() returns: remove the hooks then
        weakref.finalize(generation_config, _end_session, drafter, session)
    return session


def session_cut(drafter) -> DraftCut:
    """How much of each block the assistant proposes: `drafter.plan.cut()` when a plan is set (hf_dscale's
    `hf_dscale.engine.calibrate`), else the cut for `drafter.draft_confidence` on the bound target, measured once per
    target and kept on the drafter (before the tap hooks are installed)."""
    plan = getattr(drafter, "plan", None)
    if plan is not None:
        return plan.cut()
    confidence = resolve_draft_confidence(drafter.draft_confidence, drafter.norm.weight.device)
    known = drafter.__dict__.setdefault("_assist_cuts", weakref.WeakKeyDictionary()).setdefault(drafter.target, {})
    if confidence not in known:
        known[confidence] = DraftCut.for_target(drafter.target, confidence, drafter.config.block_size)
    return known[confidence]


def _end_session(drafter, session: "DScaleCandidateGenerator") -> None:
    """Remove `session`'s tap hooks and forget it (idempotent)."""
    session.close()
    if drafter._assist is session:
        drafter._assist = None


def assistant_generate(
    drafter,
    input_ids: torch.LongTensor,  # [1, L]
    generation_config=None,
    logits_processor=None,
    max_new_tokens: int | None = None,
    **unused,
) -> DraftGenerateOutput:
    if input_ids.shape[0] != 1:
        raise ValueError("transformers' assisted generation runs batch size 1; use hf_dscale's custom_generate.")
    generator = _session(drafter, generation_config, logits_processor)
    sequences, scores = generator.get_candidates(input_ids, max_new_tokens=max_new_tokens)
    return DraftGenerateOutput(sequences=sequences, scores=tuple(scores.unbind(1)))
