"""The drafter's side of `target.generate(**inputs, assistant_model=drafter)`.

transformers' `AssistedCandidateGenerator` calls `drafter.generate(input_ids, ...)` with token ids only,
and verifies the returned candidates itself (greedy prefix match, or the speculative-sampling rule with
the drafter's `scores`). A block-diffusion drafter also needs the target's hidden states. We get them
without touching transformers' internals:

1. **Which target?** On the first call of a `generate()` the drafter walks up the Python call stack to
   the frame of the target's `generate`/`_assisted_decoding` that holds this drafter as
   `assistant_model` (or its `candidate_generator.assistant_model`). `drafter.bind_target(target)`
   sets it explicitly instead.
2. **Hidden states.** Forward hooks on the tapped decoder layers (public `torch.nn.Module` API) keep
   the outputs of the target's latest forward: the verification pass over `[last token | candidates]`.
   The drafter knows which sequence positions that pass covered (it wrote the candidates), so it
   takes the ones that were accepted.
3. **First call.** The target has not run yet, so there are no features: the drafter proposes one
   token with a one-hot distribution. The target's prefill then covers the prompt (and that token),
   and from the second call on the drafter proposes full blocks.

A new `generate()` is recognised by its own copy of the generation config. This file is shipped with
the model as remote code, so it imports only torch, transformers' public API and its siblings.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation.candidate_generator import CandidateGenerator

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


class DScaleCandidateGenerator(CandidateGenerator):
    """transformers' `CandidateGenerator` contract for a DScale/DFlash drafter (batch size 1).

    `get_candidates(input_ids)` returns `[input_ids | block of drafts]` and the processed draft logits.
    The target's hidden states of the accepted tokens come from forward hooks on the tapped layers
    (`TapRecorder`), so the generator needs nothing from the verify loop but the ids.
    """

    def __init__(self, drafter, generation_config=None, logits_processor=None):
        self.drafter = drafter
        self.generation_config = generation_config
        self.logits_processor = logits_processor
        self.recorder = TapRecorder(drafter.target, drafter.config.target_layer_ids)
        self.cache = DraftContextCache(drafter.config.num_hidden_layers)
        self.context_len = 0  # sequence positions whose features the drafter has ingested
        self.covered_end: int | None = None  # sequence length at the end of the target's latest forward
        self.vocab = None  # the drafter's proposal set (`DraftVocab`), built at the first block

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, max_new_tokens: int | None = None, **unused):
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
            logits = drafter.draft_logits(
                input_ids[:, -1:].to(device),
                new.to(device),
                torch.tensor([length - 1], device=device),
                torch.arange(self.context_len, length - 1, device=device)[None],
                self.cache,
                vocab=self.vocab,
            )
            self.context_len = length - 1
            do_sample = bool(getattr(self.generation_config, "do_sample", False))
            tokens, scores = choose_tokens(logits[:, :budget], input_ids, self.logits_processor, do_sample)
            tokens, scores = tokens.to(input_ids.device), scores.to(input_ids.device)
        self.covered_end = length + tokens.shape[1]
        return torch.cat((input_ids, tokens), dim=1), scores

    def update_candidate_strategy(self, input_ids, scores, num_matches) -> None:
        """Block size is fixed by training; nothing to adapt."""

    def close(self) -> None:
        self.recorder.remove()


def find_calling_target(drafter: nn.Module) -> nn.Module | None:
    """The model whose `generate` is running with `drafter` as its assistant, found on the call stack."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            local = frame.f_locals
            owner = local.get("self")
            if isinstance(owner, nn.Module) and owner is not drafter and hasattr(owner, "generate"):
                generator = local.get("candidate_generator")
                if local.get("assistant_model") is drafter or getattr(generator, "assistant_model", None) is drafter:
                    return owner
            frame = frame.f_back
        return None
    finally:
        del frame


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
    if session is not None and session.generation_config is generation_config:
        return session
    if session is not None:
        session.close()
    caller = find_calling_target(drafter)
    if caller is not None and caller is not drafter.target:
        drafter.bind_target(caller)
    if drafter.target is None:
        raise RuntimeError(
            "DScaleDrafter.generate is the assistant side of `target.generate(..., assistant_model=drafter)` and "
            "could not find the calling target. Call it through the target, or bind one with "
            "`drafter.bind_target(target)`."
        )
    drafter._assist = DScaleCandidateGenerator(drafter, generation_config, logits_processor)
    return drafter._assist


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
