"""The drafter model: configuration checks, fusion, context cache, checkpoint layouts, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModel

from hf_dscale import DScaleConfig, DScaleDrafter, build_target_layer_ids
from hf_dscale.models.dscale.convert import save_reference_checkpoint
from hf_dscale.models.dscale.modeling_dscale import DraftContextCache

from ..conftest import tiny_drafter, tiny_target


def test_build_target_layer_ids_uses_bankers_rounding():
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert build_target_layer_ids(30, 9) == [1, 4, 8, 11, 14, 17, 20, 24, 27]
    assert build_target_layer_ids(36, 9) == [1, 5, 9, 13, 17, 21, 25, 29, 33]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(block_size=1), "block_size"),
        (dict(mask_token_id=None), "mask_token_id is missing"),
        (dict(mask_token_id=10_000), "outside the vocabulary"),
        (dict(target_layer_ids=[]), "target_layer_ids is empty"),
        (dict(target_layer_ids=[1, 5]), "outside"),  # a 6-layer target: valid ids 0..4
        (dict(fusion="concat"), "fusion"),
    ],
)
def test_bad_config_is_refused_with_a_clear_error(change, message):
    config = DScaleConfig.from_target(tiny_target().config, mask_token_id=3)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        DScaleDrafter(config)


def test_bind_target_checks_vocab_hidden_and_depth():
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.bind_target(target)
    other_vocab = tiny_target(vocab=64)
    with pytest.raises(ValueError, match="vocab_size"):
        drafter.bind_target(other_vocab)
    wide = DScaleConfig.from_target(target.config, mask_token_id=3)
    wide.hidden_size, wide.head_dim = 128, 32
    with pytest.raises(ValueError, match="hidden_size"):
        DScaleDrafter(wide).bind_target(target)
    deep = DScaleConfig.from_target(target.config, mask_token_id=3)
    deep.num_target_layers, deep.target_layer_ids = 40, [1, 20, 35]
    with pytest.raises(ValueError, match="do not exist"):
        DScaleDrafter(deep).bind_target(target)
    with pytest.raises(ValueError, match="mask_token_id"):
        drafter.config.mask_token_id = 500
        drafter.bind_target(target)


def test_unsupported_target_class_is_refused():
    drafter = tiny_drafter(tiny_target())

    class NotALM(torch.nn.Module):
        config = tiny_target().config

        def get_input_embeddings(self):
            return torch.nn.Embedding(96, 64)

        def get_output_embeddings(self):
            return torch.nn.Linear(64, 96)

    with pytest.raises(ValueError, match="Unsupported target class"):
        drafter.bind_target(NotALM())


def test_layerwise_fusion_init_leans_shallow_to_deep():
    drafter = tiny_drafter(tiny_target())
    weights = drafter.layer_fusion_weights
    homes = weights.argmax(-1).tolist()
    assert homes == sorted(homes) and weights.max() == 2.0 and (weights == 0).sum() == weights.numel() - len(homes)


@pytest.mark.parametrize("fusion", ["layerwise", "shared"])
def test_incremental_context_cache_equals_one_shot(fusion):
    target = tiny_target()
    drafter = tiny_drafter(target, fusion=fusion).bind_target(target)
    torch.manual_seed(0)
    taps = torch.randn(1, 12, drafter.config.num_taps, 64)
    anchor = torch.tensor([[7]])
    with torch.no_grad():
        one = drafter.draft_logits(anchor, taps, torch.tensor([12]), torch.arange(12)[None], DraftContextCache(2))
        cache = DraftContextCache(2)
        drafter.draft_logits(anchor, taps[:, :5], torch.tensor([5]), torch.arange(5)[None], cache)
        two = drafter.draft_logits(anchor, taps[:, 5:], torch.tensor([12]), torch.arange(5, 12)[None], cache)
    assert len(cache) == 12
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-5)


def _same_drafts(a, b, target):
    a.bind_target(target), b.bind_target(target)
    torch.manual_seed(0)
    taps = torch.randn(1, 6, a.config.num_taps, 64)
    args = (torch.tensor([[3]]), taps, torch.tensor([6]), torch.arange(6)[None], None)
    with torch.no_grad():
        torch.testing.assert_close(a.draft_logits(*args), b.draft_logits(*args))


@pytest.mark.parametrize("fusion", ["layerwise", "shared"])
def test_native_round_trip_and_auto_classes(tmp_path, fusion):
    target = tiny_target()
    drafter = tiny_drafter(target, fusion=fusion)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "dscale" and saved["auto_map"]["AutoModel"].endswith("DScaleDrafter")
    assert (tmp_path / "modeling_dscale.py").exists() and (tmp_path / "assistant.py").exists()
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DScaleConfig)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, DScaleDrafter)
    assert not any("embed" in k or "lm_head" in k for k in loaded.state_dict())  # borrowed, never saved
    _same_drafts(drafter, loaded, target)


@pytest.mark.parametrize("fusion, layout, marker", [("shared", "dflash", "fc.weight"),
                                                   ("layerwise", "dflare", "layer_fusion_weights")])
def test_reference_layout_round_trip(tmp_path, fusion, layout, marker):
    from safetensors import safe_open

    target = tiny_target()
    drafter = tiny_drafter(target, fusion=fusion)
    save_reference_checkpoint(drafter, str(tmp_path), layout)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "dflash_config" in config
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert marker in f.keys()
    loaded = DScaleDrafter.from_pretrained(tmp_path)
    assert loaded.config.fusion == fusion and loaded.config.target_layer_ids == drafter.config.target_layer_ids
    _same_drafts(drafter, loaded, target)


def test_reference_layout_with_model_prefix_and_wrong_tap_count(tmp_path):
    from safetensors.torch import load_file, save_file

    drafter = tiny_drafter(tiny_target(), fusion="shared")
    save_reference_checkpoint(drafter, str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    save_file({"model." + k: v for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    assert DScaleDrafter.from_pretrained(tmp_path).config.fusion == "shared"
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 2]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="taps"):
        DScaleDrafter.from_pretrained(tmp_path)


def test_checkpoint_of_another_format_is_refused(tmp_path):
    tiny_target().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a DScale, DFlash or DFlare drafter"):
        DScaleDrafter.from_pretrained(tmp_path)
