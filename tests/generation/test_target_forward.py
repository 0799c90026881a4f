"""The verify's forward: the LM head applied by the decoder (split head) equals the target's own logits, is used
only where a bitwise probe allows it, and its layout per width is chosen by timing."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM

from hf_dscale.engine import calibrate, plan_for
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.engine import target_forward
from hf_dscale.engine.target_forward import TargetForward, apply_head, splittable
from hf_dscale.models.dscale import compat

from ..conftest import OracleDrafter, oracle_from, tiny_drafter, tiny_target

REAL_FASTER_TRANSPOSED = target_forward.faster_transposed  # the conftest replaces it in every test


def tiny_gemma2(softcap: float | None):
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=softcap)
    return Gemma2ForCausalLM(config).eval()


@pytest.mark.parametrize("bias", [False, True])
def test_transposed_head_is_the_same_product(bias):
    torch.manual_seed(0)
    head = nn.Linear(16, 40, bias=bias)
    hidden = torch.randn(3, 5, 16)  # [B, T, H]
    assert torch.equal(apply_head(head, hidden, False), head(hidden))
    transposed = apply_head(head, hidden, True)
    assert transposed.shape == (3, 5, 40)
    torch.testing.assert_close(transposed, head(hidden))


def test_probe_accepts_a_plain_head_and_refuses_a_softcapped_one(target):
    assert splittable(target)
    assert splittable(tiny_gemma2(None))  # the probe decides, not the model class
    assert not splittable(tiny_gemma2(5.0))  # logits = 5 tanh(head / 5): not the head's product
    assert not splittable(target.model)  # a base model has no LM head


def test_faster_transposed_keeps_the_widths_whose_timing_is_lower(monkeypatch):
    cost = {(1, False): 1.0, (1, True): 1.2, (2, False): 3.0, (2, True): 1.0, (3, False): 2.0, (3, True): 1.5}
    spikes = {(1, True): {1: -1.0}, (3, True): {1: 9.0}}  # one outlier in a (width, layout)'s repeats is outvoted
    now, calls = [0.0], []
    real = target_forward.apply_head

    def timed(head, hidden, transposed):
        key = (hidden.shape[1], transposed)
        calls.append(key)
        repeat = calls[1:].count(key) - 1  # calls[0] is the warm-up
        now[0] += cost[key] + spikes.get(key, {}).get(repeat, 0.0)
        return real(head, hidden, transposed)

    monkeypatch.setattr(target_forward, "apply_head", timed)
    assert REAL_FASTER_TRANSPOSED(nn.Linear(8, 32), range(1, 4), clock=lambda: now[0]) == {2, 3}
    assert sorted(calls[1:]) == sorted(list(cost) * 3)  # three timed repeats of each (width, layout)


def test_calibrate_decides_the_layout_per_batch_size(monkeypatch):
    calls = []

    def fake(head, widths, batch_size=1):
        calls.append((batch_size, list(widths)))
        return {2, 3} if batch_size == 1 else set()

    monkeypatch.setattr(target_forward, "faster_transposed", fake)
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    split = calibrate(target, drafter, tree=False)
    assert split.verify_path == "split-head" and split.transposed == (2, 3)
    assert split.forward(target).kind == "split-head" and split.forward(target).transposed == {2, 3}
    assert calibrate(target, drafter, tree=False, batch_size=2).verify_path == "model"  # no width faster: the model's
    assert calls == [(1, [1, 2, 3, 4]), (2, [1, 2, 3, 4])]
    assert not splittable(tiny_gemma2(5.0)) and len(calls) == 2  # calibrate probes before it times: no timing


@pytest.mark.parametrize("transposed", [frozenset(), frozenset({4})])
def test_split_head_verify_matches_the_target_with_a_cache_and_holes(target, transposed):
    """Prefill, then a 4-token verify over a cache with a masked-out column, as the decoder runs it."""
    split = TargetForward(target, transposed)
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    block = torch.randint(3, 90, (2, 4), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, 10, dtype=torch.long)
    valid[0, 0] = valid[1, 3] = 0  # left padding in row 0, a rejected column in row 1
    positions = (valid.cumsum(-1) - 1).clamp_min(0)
    logits = []
    for forward in (lambda cache, **kw: target(**kw, **compat.cache_kwargs(target, cache)).logits, split):
        cache = compat.position_cache()
        with torch.no_grad():
            forward(cache, input_ids=ids, attention_mask=valid[:, :6], position_ids=positions[:, :6], use_cache=True)
            logits.append(forward(cache, input_ids=block, attention_mask=valid, position_ids=positions[:, 6:],
                                  use_cache=True))
        assert cache.get_seq_length() == 10
    assert logits[1].shape == (2, 4, 96)
    torch.testing.assert_close(logits[1], logits[0])


@pytest.mark.parametrize("split", [False, True])
def test_custom_generate_greedy_identity_on_either_path(split, monkeypatch):
    """The conftest makes every decode test take the split head; here also the target's own forward, and the
    decoder is seen to use the path it was given."""
    if not split:
        monkeypatch.setattr(target_forward, "faster_transposed", lambda head, widths, batch_size=1: set())
    target = tiny_target("qwen3")
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    drafter = tiny_drafter(target, cls=OracleDrafter)
    drafter.oracle, drafter.error_rate = oracle_from(plain, mask), 0.2
    stats = DecodeStats()
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                           custom_generate=custom_generate, drafter=drafter, dscale_stats=stats)
    assert torch.equal(plain, spec)
    assert stats.tau > 1.5
    assert stats.plan.transposed == (tuple(range(1, drafter.config.block_size + 1)) if split else None)


def test_a_planned_target_can_still_be_freed():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    plan_for(target, drafter, batch_size=1)
    assert len(drafter._plans) == 1
    drafter.bind_target(tiny_target("llama", seed=1))  # the drafter lets go of the first target
    del target
    gc.collect()
    assert len(drafter._plans) == 0
