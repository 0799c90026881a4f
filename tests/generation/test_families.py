"""Greedy identity on other decoder-only families, with prompts longer than their sliding windows.

Mistral and Phi-3 slide on every layer, Qwen2 on some, Gemma 2 and Gemma 3 alternate sliding and full layers (Gemma 2
with soft-capped attention and logits, Gemma 3 with scaled embeddings and a local RoPE). Every path of hf_dscale
runs on each, batched with uneven left padding where the path takes batches: the chain and the drafter's own tree
with a prompt lookup and D²SD through `custom_generate`, and `assistant_model=`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, RepetitionPenaltyLogitsProcessor

from hf_dscale.generation import custom_generate
from hf_dscale.engine import structure
from hf_dscale.engine.masks import ALL_LAYERS, TargetAttention

from ..conftest import FAMILIES, SLIDING_FAMILIES, WINDOW, OracleDrafter, oracle_from, tiny_drafter, tiny_target

NEW = 24


def _prompt(lengths: list[int], seed: int):
    """Left-padded prompts of the given lengths (the longest sets the width)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 95, (len(lengths), width), generator=g)
    mask = torch.ones_like(ids)
    for b, length in enumerate(lengths):
        ids[b, : width - length], mask[b, : width - length] = 0, 0
    return ids, mask


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


def _oracle(target, plain, mask, error_rate=0.3, seed=2):
    drafter = tiny_drafter(target, cls=OracleDrafter)
    drafter.oracle, drafter.error_rate = oracle_from(plain, mask), error_rate
    torch.manual_seed(seed)
    return drafter


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_the_prompts_cross_the_window(family):
    """The window changes these outputs: the identities below would catch a decoder that ignores it."""
    ids, mask = _prompt([3 * WINDOW, WINDOW + 3, 5], seed=1)
    sliding, full = tiny_target(family), tiny_target(family, window=None)
    outputs = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
               for m in (sliding, full)]
    assert not torch.equal(*outputs)


@pytest.mark.parametrize("way", ["chain", "own tree + lookup", "d2sd"])
def test_custom_generate_batched_identity(family, way):
    target = tiny_target(family)
    ids, mask = _prompt([3 * WINDOW, WINDOW + 3, 5], seed=1)
    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                            logits_processor=[penalty])
    kwargs = {"chain": {}, "own tree + lookup": dict(draft_tree=True, prompt_lookup=True),
              "d2sd": dict(vp_drafter=tiny_drafter(target, seed=5), num_branches=2)}[way]
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           logits_processor=[penalty], custom_generate=custom_generate,
                           drafter=_oracle(target, plain, mask), draft_confidence=0.0, **kwargs)
    assert torch.equal(plain, spec), f"{family}, {way}"


def test_assistant_model_identity(family):
    target = tiny_target(family)
    ids, _ = _prompt([3 * WINDOW], seed=3)
    plain = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    for drafter in (_oracle(target, plain, None), tiny_drafter(target)):
        spec = target.generate(ids, assistant_model=drafter, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(plain, spec), f"{family}, {type(drafter).__name__}"


def test_windows_by_layer_kind():
    assert TargetAttention.of(tiny_target("llama")).windows == {ALL_LAYERS: None}
    assert TargetAttention.of(tiny_target("mistral")).windows == {ALL_LAYERS: WINDOW}
    assert TargetAttention.of(tiny_target("gemma3")).windows == {"full_attention": None, "sliding_attention": WINDOW}
    assert TargetAttention.of(tiny_target("qwen2", window=None)).windows == {ALL_LAYERS: None}


def test_a_window_only_the_cache_applies():
    """A Llama config may carry a `sliding_window` that Llama's attention ignores, while generate()'s cache keeps only
    that window: the prompt attends to everything, each later token to the window. The engine reads both from what
    the layers do (the attention's arguments, the cache's layers) and decodes as plain generate() does."""
    target = tiny_target("llama")
    target.config.sliding_window = WINDOW
    assert TargetAttention.of(target, prefill=True).windows == {ALL_LAYERS: None}
    assert TargetAttention.of(target).windows == {ALL_LAYERS: WINDOW}
    ids, mask = _prompt([3 * WINDOW, WINDOW + 3], seed=4)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           custom_generate=custom_generate, drafter=_oracle(target, plain, mask), draft_confidence=0.0)
    assert torch.equal(plain, spec)


def test_window_mask_counts_positions_not_columns():
    """A hole (a rejected column) does not count towards the window: keys are seen by their positions."""
    attention = TargetAttention({"full_attention": None, "sliding_attention": 2})
    allowed = torch.tensor([[[True, False, True, True]]])  # column 1 is a hole
    masks = attention.masks(allowed, torch.tensor([[2]]), torch.tensor([[0, 0, 1, 2]]), torch.float32)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert (masks["full_attention"][0, 0, 0] == 0).tolist() == [True, False, True, True]
    assert (masks["sliding_attention"][0, 0, 0] == 0).tolist() == [False, False, True, True]


def test_unsupported_layer_kind_is_refused_by_name():
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    target = LlamaForCausalLM(config)
    target.config.layer_types = ["full_attention", "chunked_attention"]
    target.config.attention_chunk_size = 4
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*chunked_attention"):
        TargetAttention.of(target)


def _sweep_target(kind: str):
    from hf_dscale.sweep import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind)).float().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


@pytest.mark.parametrize("way", ["default", "own tree + lookup", "d2sd"])
def test_attention_of_its_own_takes_2d_masks_and_trees_path_by_path(way):
    """GPT-Neo's attention is its own, outside transformers' interface: it builds its masks from a 2D attention
    mask and takes no tree mask. The engine feeds it 2D masks, and its trees path by path, batched."""
    target = _sweep_target("gpt_neo")
    assert structure.of(target).own_masks and structure.of(target).positions
    ids, mask = _prompt([12, 7, 4], seed=6)
    ids = ids % 120 + 3
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    kwargs = {"default": {}, "own tree + lookup": dict(draft_tree=True, prompt_lookup=True),
              "d2sd": dict(vp_drafter=tiny_drafter(target, seed=5), num_branches=2)}[way]
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                           custom_generate=custom_generate, drafter=_oracle(target, plain, mask),
                           draft_confidence=0.0, **kwargs)
    assert torch.equal(plain, spec), way


def test_attention_of_its_own_is_checked_before_decoding():
    """Bloom counts positions from its mask's columns: one prompt at a time. ProphetNet cannot run a verify's
    forward of several tokens over its cache: refused by name."""
    bloom = _sweep_target("bloom")
    assert structure.of(bloom).own_masks and not structure.of(bloom).positions
    ids, mask = _prompt([6, 4], seed=7)
    with pytest.raises(ValueError, match="one prompt at a time"):
        bloom.generate(input_ids=ids % 120 + 3, attention_mask=mask, max_new_tokens=4,
                       custom_generate=custom_generate, drafter=tiny_drafter(bloom))
    with pytest.raises(ValueError, match=r"ProphetNetForCausalLM: a forward of two tokens over its cache"):
        structure.of(_sweep_target("prophetnet")).check()
