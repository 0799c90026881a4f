"""A greedy-identity fuzz: 1,000 random decoding cases, each identical to plain `generate()` token for token.

Each case draws a target family (Llama, Qwen3, Gemma 3 with a sliding window of 8), a batch of 1-8 rows with uneven
left padding, prompt lengths from 1 to 64 (some up to 600, far past the window), 1-24 new tokens (so a generation
often ends inside a block), an EOS token some rows meet mid-block, a stop string (through transformers'
`StopStringCriteria` and a character tokenizer) or none, a repetition penalty or none, a way to decode (the engine's
default; the chain with a whole block, a confidence cut or the throughput cut; the drafter's own tree, with or
without the prompt lookup; D²SD), the next block drafted before or after the cycle's read, and a drafter: a random
one (rejections everywhere) or an oracle that follows plain decoding's output with a random error rate (long
accepted runs, rejections at every depth). A stop string without an EOS token is the case where plain `generate()`
lets a stopped row run on until every row stops.
120 more cases decode with the verify compiled (`compile=True`), at batch 1 and 3, without D²SD.
"""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
)

from hf_dscale.generation import DecodeStats, custom_generate

from ..conftest import MASK_ID, OracleDrafter, oracle_from, tiny_drafter, tiny_target

CASES, CHUNK, COMPILED = 1000, 100, 120
FAMILIES = ("llama", "qwen3", "gemma3")
WAYS = ("default", "chain-whole", "chain-cut", "chain-auto", "tree", "tree-lookup", "d2sd")


def _case(rng: random.Random) -> dict:
    batch = rng.choice([1, 1, 2, 3, 4, 8])
    longest = rng.choice([1, 5, 12, 30, 64]) if rng.random() < 0.9 else rng.randint(100, 600)
    return dict(family=rng.choice(FAMILIES), batch=batch, longest=longest,
                lengths=[rng.randint(1, longest) for _ in range(batch - 1)] + [longest],
                new=rng.randint(1, 24), eos=rng.choice([None, None, rng.randint(3, MASK_ID - 1)]),
                penalty=rng.choice([None, 1.3]), way=rng.choice(WAYS), stop=rng.random() < 0.25,
                error_rate=rng.choice([None, 0.0, 0.1, 0.3, 0.6]), seed=rng.randint(0, 2**31))


CASE_LIST = [_case(random.Random(1000 + i)) for i in range(CASES)]


@pytest.fixture(scope="module")
def targets():
    return {family: tiny_target(family) for family in FAMILIES}


def _characters() -> PreTrainedTokenizerFast:
    """One character per token id (chr(48 + id)), so that stop strings can be matched in the tiny vocabulary."""
    tokenizer = Tokenizer(models.WordLevel({chr(48 + i): i for i in range(MASK_ID + 1)}, unk_token="0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


CHARACTERS = _characters()


def _prompt(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, MASK_ID, (len(lengths), width), generator=g)
    mask = torch.ones_like(ids)
    for b, length in enumerate(lengths):
        ids[b, : width - length], mask[b, : width - length] = 0, 0
    return ids, mask


def _run(target, case, drafters=None) -> None:
    """One case; `drafters` (family -> an `OracleDrafter`, reused so that its compiled verify is too): decode with
    the verify compiled, the case's drafter being that one with its oracle set (error rate 1: a random drafter)."""
    target.generation_config.eos_token_id = case["eos"]
    ids, mask = _prompt(case["lengths"], case["seed"])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=case["new"], do_sample=False)
    if case["penalty"]:
        kw["logits_processor"] = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(case["penalty"])])
    plain = target.generate(**kw)
    if case["stop"]:  # a one- or two-character piece of a row's plain output; transformers drops `tokenizer=` on the
        # way to a custom generate function, so the criterion is built here, as a user would pass it
        row = CHARACTERS.decode(plain[case["seed"] % len(plain), ids.shape[1] :])
        start = case["seed"] % max(1, len(row) - 1)
        criteria = lambda: StoppingCriteriaList([StopStringCriteria(CHARACTERS, [row[start : start + 2]])])  # noqa: E731
        plain = target.generate(**kw, stopping_criteria=criteria())
        kw["stopping_criteria"] = criteria()
    torch.manual_seed(case["seed"])
    if drafters is not None:
        drafter = drafters[case["family"]]
        drafter.oracle = oracle_from(plain, mask)
        drafter.error_rate = 1.0 if case["error_rate"] is None else case["error_rate"]
    elif case["error_rate"] is None:
        drafter = tiny_drafter(target, seed=case["seed"] % 7)
    else:
        drafter = tiny_drafter(target, cls=OracleDrafter)
        drafter.oracle, drafter.error_rate = oracle_from(plain, mask), case["error_rate"]
    way = case["way"]
    options = {"default": {}, "chain-whole": dict(draft_tree=False, draft_confidence=0.0),
               "chain-cut": dict(draft_tree=False, draft_confidence=0.5),
               "chain-auto": dict(draft_tree=False, draft_confidence="auto"), "tree": dict(draft_tree=True, num_branches=2),
               "tree-lookup": dict(draft_tree=True, prompt_lookup=True),
               "d2sd": dict(vp_drafter=tiny_drafter(target, seed=11), num_branches=2)}[way]
    stats = DecodeStats()
    options["one_read"] = case["seed"] % 2 == 0  # half the cases draft before the cycle's read (a GPU's order)
    spec = target.generate(**kw, custom_generate=custom_generate, drafter=drafter, dscale_stats=stats,
                           **options, **({} if drafters is None else {"compile": True}))
    assert torch.equal(plain, spec), case
    assert (stats.plan.verify_path == "compiled") == (drafters is not None)


@pytest.mark.parametrize("chunk", range(CASES // CHUNK))
def test_greedy_identity_fuzz(targets, chunk):
    for case in CASE_LIST[chunk * CHUNK : (chunk + 1) * CHUNK]:
        _run(targets[case["family"]], case)


def _compiled_case(i: int) -> dict:
    """A case for the compiled verify: one compile per (family, batch size), so two batch sizes, and the drafter's
    taps alone (no D²SD: a second drafter's taps would be another compile)."""
    case, rng = _case(random.Random(5000 + i)), random.Random(9000 + i)
    batch = (1, 3)[i % 2]
    lengths = [rng.randint(1, case["longest"]) for _ in range(batch - 1)] + [case["longest"]]
    return dict(case, batch=batch, lengths=lengths, way="tree" if case["way"] == "d2sd" else case["way"])


COMPILED_CASES = [_compiled_case(i) for i in range(COMPILED)]


def test_greedy_identity_fuzz_compiled(targets):
    drafters = {family: tiny_drafter(target, cls=OracleDrafter) for family, target in targets.items()}
    for case in COMPILED_CASES:
        _run(targets[case["family"]], case, drafters)
