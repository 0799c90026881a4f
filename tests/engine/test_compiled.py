"""The compiled verify: a cache of fixed shape, taps without hooks, and decoding through it exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_dscale.engine import calibrate
from hf_dscale.engine import plan as plan_module
from hf_dscale.engine.compiled import StaticVerify
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.engine.masks import TargetAttention
from hf_dscale.models.dscale import assistant, compat
from hf_dscale.models.dscale.assistant import TapRecorder

from ..conftest import tiny_target
from ..generation.test_exactness import _oracle, _prompt


def test_column_cache_writes_at_the_named_columns_crops_by_count_and_grows():
    cache = compat.column_cache(6)
    layer = cache.layer_class_to_replicate()
    cache.columns.write = torch.tensor([0, 1, 2])
    keys, values = layer.update(torch.ones(1, 2, 3, 4), 2 * torch.ones(1, 2, 3, 4))
    assert keys.shape == (1, 2, 6, 4) and keys[0, 0, :3].eq(1).all() and keys[0, 0, 3:].eq(0).all()
    cache.columns.length = 5
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and layer.get_mask_sizes(1) == (6, 0)
    layer.crop(-1)  # a crop per layer of one cache must not compound: the count is shared
    assert cache.columns.length == 2
    cache.layers = [layer]
    compat.grow_columns(cache, 10)
    assert layer.keys.shape[2] == 10 and cache.columns.capacity == 10 and layer.values[0, 0, :3].eq(2).all()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_forwards_taps_equal_the_tap_hooks(kind):
    """The compiled path reads the tapped layers from `hidden_states`; they must be what the hooks record. The last
    layer's output comes back only after the final norm: refused."""
    target = tiny_target(kind)
    taps = list(range(target.config.num_hidden_layers - 1))
    with pytest.raises(ValueError, match="last layer"):
        StaticVerify(target, taps + [target.config.num_hidden_layers - 1], (4,))
    ids, _ = _prompt(1, 9, 0)
    recorder = TapRecorder(target, taps)
    try:
        target(input_ids=ids)
        hooked = recorder.taps()
    finally:
        recorder.remove()
    static = StaticVerify(target, taps, (4,))
    cache = compat.column_cache(16)
    cache.columns.write = torch.arange(9)
    allowed = torch.ones(9, 16, dtype=torch.bool).tril()[None]  # columns 9.. hold nothing: hidden
    mask = TargetAttention.of(target).masks(allowed, torch.arange(9)[None], torch.arange(16)[None], target.dtype)
    logits, read = static.prefill(ids, torch.arange(9)[None], mask, cache)
    assert torch.allclose(read, hooked, atol=1e-5)
    assert torch.allclose(logits[:, -1], target(input_ids=ids).logits[:, -1], atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_compiled_verify_decodes_exactly_batched_and_reports_its_compile_time(kind, monkeypatch):
    """One compile per (batch, width) serves every generation: shapes do not depend on the cache's length."""
    target = tiny_target(kind)
    ids, mask = _prompt(2, 14, 1)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    drafter = _oracle(target, plain, mask, 0.3, 1)
    plan = calibrate(target, drafter, batch_size=2, compile=True)
    assert plan.compile_widths == (drafter.config.block_size,) and plan.compile_s > 0
    assert plan.verify_path == "compiled" and plan.to_dict()["compile_widths"] == [drafter.config.block_size]
    # a confidence cut's minimum comes from the compiled costs (flat up to the width), not from eager verifies
    monkeypatch.setattr(assistant, "verify_costs", lambda *a, **k: pytest.fail("measured an eager verify"))
    confident = calibrate(target, drafter, batch_size=2, compile=True, draft_confidence=0.3)
    assert confident.compile_s == 0.0 and confident.min_drafts == min(8, drafter.config.block_size) - 1
    for new in (30, 41):  # a longer generation: a larger cache, no second compile
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        drafter.oracle = _oracle(target, plain, mask, 0.3, 1).oracle
        stats = DecodeStats()
        spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                               custom_generate=custom_generate, drafter=drafter, plan=plan, dscale_stats=stats)
        assert torch.equal(plain, spec), new
        assert stats.compile_s == 0.0  # compiled in calibrate, for this batch size and width
        assert set(stats.verified) <= set(range(1, drafter.config.block_size + 1))


def test_each_target_gets_its_own_compiled_weights():
    """Freezing bakes a target's weights into its graph: a second target of the same shapes must not run the first's."""
    outputs = []
    for seed in (0, 1):
        target = tiny_target("llama", seed=seed)
        ids, mask = _prompt(1, 10, 2)
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        drafter = _oracle(target, plain, mask, 0.2)
        spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                               custom_generate=custom_generate, drafter=drafter, compile=True)
        assert torch.equal(plain, spec), seed
        outputs.append(plain)
    assert not torch.equal(*outputs)  # the two targets do decode differently


def test_compile_is_the_default_on_a_gpu_only_and_falls_back_to_eager_where_it_fails(monkeypatch, caplog):
    """A call that does not say compiles where `compile_by_default` says so (a GPU); a compile that then fails decodes
    eagerly and says why, while one the caller asked for raises."""
    assert plan_module.compile_by_default(torch.device("cuda"))[0]
    assert not plan_module.compile_by_default(torch.device("cpu"))[0]
    target = tiny_target("llama")
    ids, mask = _prompt(1, 10, 3)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    drafter = _oracle(target, plain, mask, 0.2)
    default = calibrate(target, drafter)  # this CPU: eager, with the reason
    assert default.compile_widths is None and any(r.startswith("eager verify: the default") for r in default.reasons)

    def broken(self, batch_size=1):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(plan_module, "compile_by_default", lambda device: (True, "compiled verify: the default"))
    monkeypatch.setattr(StaticVerify, "measure", broken)
    with caplog.at_level("WARNING", logger=plan_module.__name__):
        fallen = calibrate(target, drafter)
    assert fallen.compile_widths is None and fallen.verify_path != "compiled"
    assert any("compiling failed (RuntimeError: no C++ compiler found)" in r for r in fallen.reasons)
    assert "no C++ compiler found" in caplog.text and "eager verify" in caplog.text
    assert fallen.verify_costs == default.verify_costs  # sized by the eager costs, as the default plan
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                           custom_generate=custom_generate, drafter=drafter, plan=fallen)
    assert torch.equal(plain, spec)
    with pytest.raises(RuntimeError, match="decode without compile=True"):
        calibrate(target, drafter, compile=True)


def test_every_compiled_shape_stays_compiled_past_dynamos_default_limit():
    """Every StaticVerify shares one compile cache (that of `_forward`); dynamo's recompile limit (8 by default, 1
    here) must not turn a later batch size into a silent eager run."""
    from torch._dynamo.utils import counters

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    torch.manual_seed(0)
    static = StaticVerify(LlamaForCausalLM(config).eval(), [0], (2,))
    with torch._dynamo.config.patch(recompile_limit=1):
        before = counters["stats"]["unique_graphs"]
        for batch in (1, 2, 3):
            static.measure(batch, context=4, repeats=1)
        assert counters["stats"]["unique_graphs"] - before == 3


def test_a_target_changed_in_place_compiles_again():
    """Freezing copies the weights into the graph: after a training step (or any in-place change to a parameter),
    the next call must not decode with the old weights."""
    target = tiny_target("llama", seed=4)
    ids, mask = _prompt(1, 10, 5)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    drafter = _oracle(target, plain, mask, 0.2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, custom_generate=custom_generate,
              drafter=drafter, compile=True)
    assert torch.equal(target.generate(**kw), plain)
    with torch.no_grad():
        for p in target.model.layers[-1].parameters():
            p.add_(torch.randn_like(p))  # what an optimizer step does: in place
    changed = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert not torch.equal(changed, plain)
    drafter.oracle = _oracle(target, changed, mask, 0.2).oracle
    stats = DecodeStats()
    assert torch.equal(target.generate(**kw, dscale_stats=stats), changed)
    assert stats.compile_s > 0  # compiled again (reading the weights at every call), apart from decode time
    with torch.no_grad():
        target.lm_head.weight.mul_(-1.0)  # a second change: read as it is, no third compile
    again = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    drafter.oracle = _oracle(target, again, mask, 0.2).oracle
    stats = DecodeStats()
    assert torch.equal(target.generate(**kw, dscale_stats=stats), again) and stats.compile_s == 0.0
