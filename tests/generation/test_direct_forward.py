"""The direct forward (`hf_dscale.engine.direct_forward`): the target's weights run without its modules. Its
logits and taps against the target's own forward on every family it takes, the targets it refuses and why, the
plan's per-width choice, and greedy decoding through it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_dscale.engine.plan import calibrate
from hf_dscale.generation import custom_generate
from hf_dscale.engine import direct_forward, target_forward
from hf_dscale.engine.masks import TargetAttention, column_positions
from hf_dscale.kernels import cpu_linear
from hf_dscale.models.dscale import compat
from hf_dscale.models.dscale.assistant import TapRecorder
from tests.conftest import SLIDING_FAMILIES, tiny_drafter, tiny_target, unevenly_padded

TAKEN = ("llama", "qwen3", "mistral", "qwen2")  # Qwen3: per-head norms; Mistral, Qwen2: windows; Qwen2: biases
KERNEL = cpu_linear.unavailable() is None


def _cached(target, ids, valid):
    """A position cache holding `ids` [B, C] (left-padded by `valid`) as the engine's prefill leaves it."""
    cache = compat.position_cache(64)
    positions = column_positions(valid)
    attention = TargetAttention.of(target)
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    mask = attention.masks(valid[:, None, :] & causal, positions, positions, target.dtype) if attention.sliding \
        else valid.long()
    target(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
           **compat.cache_kwargs(target, cache))
    return cache


@pytest.mark.parametrize("kind", TAKEN)
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("kernel", [False, True])
def test_logits_and_taps_equal_the_targets_own_forward(kind, tree, kernel):
    """Three rows, unevenly left-padded, a cache, then a chain (2D padding mask, where no window applies) or a
    token tree (4D masks by position, one per layer kind for Qwen2) of 6 new tokens."""
    if kernel and not KERNEL:
        pytest.skip(f"the CPU kernel cannot run here: {cpu_linear.unavailable()}")
    target = tiny_target(kind)
    assert direct_forward.unavailable(target) is None
    torch.manual_seed(3)
    ids, new = torch.randint(1, 90, (3, 14)), torch.randint(1, 90, (3, 6))
    valid = torch.ones(3, 14, dtype=torch.bool)
    valid[1, :3], valid[2, :7] = False, False
    attention = TargetAttention.of(target)
    query_pos = valid.sum(-1, keepdim=True) + torch.tensor([0, 1, 1, 2, 2, 3])  # a tree: 0 -> (1, 2); 1 -> 3 ...
    allowed = torch.eye(6, dtype=torch.bool)
    for child, parent in ((1, 0), (2, 0), (3, 1), (4, 2), (5, 3)):
        allowed[child] |= allowed[parent]
    if tree or attention.sliding:
        if not tree:
            allowed, query_pos = torch.ones(6, 6, dtype=torch.bool).tril(), valid.sum(-1, keepdim=True) + torch.arange(6)
        mask = attention.after_cache(valid, query_pos, allowed, target.dtype)
    else:
        query_pos = valid.sum(-1, keepdim=True) + torch.arange(6)
        mask = torch.cat((valid, torch.ones(3, 6, dtype=torch.bool)), dim=1).long()
    taps = [0, 3, 5]
    own_cache, direct_cache = _cached(target, ids, valid), _cached(target, ids, valid)
    recorder = TapRecorder(target, taps)
    try:
        with torch.no_grad():
            own = target(input_ids=new, attention_mask=mask, position_ids=query_pos, use_cache=True,
                         **compat.cache_kwargs(target, own_cache)).logits
            own_taps = recorder.taps()
            logits, got_taps = direct_forward.DirectForward(target)(new, mask, query_pos, direct_cache, kernel=kernel,
                                                                    tap_ids=taps)
    finally:
        recorder.remove()
    torch.testing.assert_close(logits, own, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_taps, own_taps, rtol=1e-5, atol=1e-5)
    for own_layer, direct_layer in zip(own_cache.layers, direct_cache.layers):  # the same entries written
        torch.testing.assert_close(direct_layer.keys, own_layer.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(direct_layer.values, own_layer.values, rtol=1e-5, atol=1e-5)


def test_without_a_cache_the_tokens_see_each_other_causally():
    target = tiny_target("llama")
    ids = torch.randint(1, 90, (2, 7))
    with torch.no_grad():
        own = target(input_ids=ids, use_cache=False).logits
        logits, taps = direct_forward.DirectForward(target)(ids)
    torch.testing.assert_close(logits, own, rtol=1e-5, atol=1e-5)
    assert taps is None


@pytest.mark.skipif(not KERNEL, reason=f"the CPU kernel cannot run here: {cpu_linear.unavailable()}")
def test_a_weight_laid_out_otherwise_gets_torchs_products():
    target = tiny_target("llama")
    projection = target.model.layers[1].self_attn.q_proj
    projection.weight = nn.Parameter(projection.weight.detach().t().contiguous().t())  # the same values, columns
    direct = direct_forward.DirectForward(target)
    assert not direct.kernel_reads and not direct.fused
    ids = torch.randint(1, 90, (2, 5))
    with torch.no_grad():
        logits, _ = direct(ids, kernel=True)
        torch.testing.assert_close(logits, target(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


class _OnePlusNorm(nn.Module):
    """An RMS norm with Gemma's (1 + weight) scale, shaped as Llama's: only a probe tells them apart."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("kind", sorted(set(SLIDING_FAMILIES) - set(TAKEN)))
def test_targets_built_otherwise_keep_their_own_forward_and_say_why(kind):
    why = direct_forward.unavailable(tiny_target(kind))
    assert why is not None and "holds" in why  # Phi-3's fused projections, Gemma's extra norms


def test_a_target_that_looks_the_part_but_computes_otherwise_is_caught_by_the_probe():
    target = tiny_target("llama")
    target.model.layers[2].input_layernorm = _OnePlusNorm(target.model.layers[2].input_layernorm)
    why = direct_forward.unavailable(target)
    assert why is not None and why.startswith("a probe of its forward differs from LlamaForCausalLM's own")
    assert "float32" in direct_forward.unavailable(tiny_target("llama").to(torch.bfloat16))


def test_the_plan_verifies_direct_and_measures_the_products_both_ways(monkeypatch):
    """Where the direct forward runs the target, the target's own forward is not measured (the same ops with
    transformers' modules around them); the kernel is kept where it measures cheaper."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    offered = []

    def costs(target, transposed, ways, widths, batch_size=1):  # the kernel cheaper from 3 tokens on
        offered.append(list(ways))
        return {way: {w: (0.5 if way.kernel and w >= 3 else 1.0) + 0.1 * w for w in widths} for way in ways}

    monkeypatch.setattr(target_forward, "verify_costs_ways", costs)
    plan = calibrate(target, drafter)
    block = drafter.config.block_size
    Way = target_forward.Way
    assert offered == [[Way(True, False)] + ([Way(True, True)] if KERNEL else [])]
    assert plan.direct_widths == tuple(range(1, block + 1))
    assert plan.cpu_linear_widths == (tuple(range(3, block + 1)) if KERNEL else None)
    assert plan.verify_costs == {w: (0.5 if KERNEL and w >= 3 else 1.0) + 0.1 * w for w in range(1, block + 1)}
    assert plan.to_dict()["direct_widths"] == list(plan.direct_widths)
    assert "direct forward (the target's weights without its modules) at widths 1-8" in plan.reasons
    off = calibrate(target, drafter, direct_forward=False)
    assert off.direct_widths is None
    if KERNEL:  # the target's own forward, with torch's products against the kernel's
        assert offered[-1] == [Way(False, False), Way(False, True)]
    assert "verify through the target's modules: direct_forward=False" in off.reasons
    with pytest.raises(RuntimeError, match="direct_forward=True, but the direct forward cannot run Gemma3"):
        calibrate(tiny_target("gemma3"), drafter, direct_forward=True)


@pytest.mark.parametrize("kind", TAKEN)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_decoding_through_the_direct_forward_equals_plain_generate(kind, batch, monkeypatch):
    target = tiny_target(kind)
    drafter = tiny_drafter(target)
    ids, mask = unevenly_padded(batch, seed=11)
    calls, real = [], direct_forward.DirectForward.__call__

    def counted(*args, **kwargs):  # the engine's verifies (the probe asks for no taps)
        calls.extend([1] if kwargs.get("tap_ids") else [])
        return real(*args, **kwargs)

    monkeypatch.setattr(direct_forward.DirectForward, "__call__", counted)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    for tree in (False, True):
        calls.clear()
        ours = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                               custom_generate=custom_generate, drafter=drafter, direct_forward=True,
                               draft_tree=tree)
        assert torch.equal(ours, plain)
        assert calls  # the verifies ran direct


def test_a_probe_that_raises_gives_a_reason_and_the_plan_falls_back(monkeypatch):
    """A transformers whose modules changed under the direct forward must not escape `calibrate`: the probe's error
    is the reason the plan verifies through the target's own forward."""
    target = tiny_target("llama")

    def broken(self, *args, **kwargs):
        raise TypeError("an interface that changed")

    monkeypatch.setattr(direct_forward.DirectForward, "__call__", broken)
    why = direct_forward.unavailable(target)
    assert why == "a probe of its forward failed (TypeError: an interface that changed)"
    plan = calibrate(target, tiny_drafter(target))
    assert plan.direct_widths is None and f"verify through the target's modules: {why}" in plan.reasons


@pytest.mark.skipif(not KERNEL, reason="the CPU kernel does not run on this machine")
def test_the_probe_runs_the_kernel_products_the_plan_would_run(monkeypatch):
    target = tiny_target("llama")
    calls = []
    original = direct_forward.DirectForward.__call__

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("kernel", False))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(direct_forward.DirectForward, "__call__", spy)
    assert direct_forward.unavailable(target, kernel=True) is None
    assert calls == [False, True]


def test_hf_dscale_reference_forces_transformers_own_forward(monkeypatch):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    monkeypatch.setenv("HF_DSCALE_REFERENCE", "1")
    plan = calibrate(target, drafter)
    assert plan.direct_widths is None and plan.cpu_linear_widths is None and plan.transposed is None
    assert any(r.startswith("HF_DSCALE_REFERENCE=1") for r in plan.reasons)
    with pytest.raises(ValueError, match="HF_DSCALE_REFERENCE=1 runs every verify"):
        calibrate(target, drafter, direct_forward=True)
    ids, mask = unevenly_padded(2, seed=12)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    ours = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                           custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(ours, plain)
