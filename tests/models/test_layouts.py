"""Drafter checkpoints in every public layout: detection, strict loading, Hub ids, shards, RoPE, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from hf_dscale import DScaleConfig, DScaleDrafter
from hf_dscale.models.dscale.convert import detect_layout, export_drafter
from hf_dscale.models.dscale.modeling_dscale import DraftContextCache

from ..conftest import tiny_drafter, tiny_target
from ..hub_cache import add_to_hub_cache

FUSION_OF = {"native": "layerwise", "dflash": "shared", "dflare": "layerwise", "transformers": "shared"}

# z-lab `DFlashDraftModel` (dflash/model/dflash.py): Qwen3-style layers without embeddings or LM head,
# `fc` over the concatenated taps and `hidden_norm` after it, a final `norm`.
ZLAB_LAYER_KEYS = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                   "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                   "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                   "self_attn.k_norm.weight"]
ZLAB_TOP_KEYS = ["fc.weight", "hidden_norm.weight", "norm.weight"]


def zlab_keys(num_layers: int) -> set[str]:
    return set(ZLAB_TOP_KEYS) | {f"layers.{i}.{k}" for i in range(num_layers) for k in ZLAB_LAYER_KEYS}


def assert_same_forward(a: DScaleDrafter, b: DScaleDrafter, target) -> None:
    """Same block logits, in two calls through a context cache (context, then more context and a partial block)."""
    a.bind_target(target), b.bind_target(target)
    torch.manual_seed(0)
    taps = torch.randn(1, 9, a.config.num_taps, 64)
    outs = []
    for drafter in (a, b):
        cache = DraftContextCache(drafter.config.num_hidden_layers)
        with torch.no_grad():
            first = drafter.draft_logits(torch.tensor([[3]]), taps[:, :6], torch.tensor([6]), torch.arange(6)[None],
                                         cache)
            block = torch.full((1, drafter.config.block_size), drafter.config.mask_token_id)
            block[0, :3] = torch.tensor([5, 7, 11])
            second = drafter.block_logits(block, torch.tensor([9]), taps[:, 6:], torch.arange(6, 9)[None], cache)
        outs.append((first, second))
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y)


def perturbed(drafter: DScaleDrafter) -> DScaleDrafter:
    """Every weight moved off its init (norms away from 1), so a weight loaded into the wrong place shows."""
    torch.manual_seed(2)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return drafter


def names_in(folder) -> set[str]:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return set(f.keys())


def edit_config(folder, **changes) -> dict:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    with open(path, "w") as f:
        json.dump(config, f)
    return config


def shard(folder) -> None:
    """Split a folder's model.safetensors into two shards with an index, as save_pretrained does for big models."""
    state = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in parts.items():
        save_file({k: state[k] for k in keys}, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3")


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("layout", ["native", "dflash", "dflare", "transformers"])
@pytest.mark.parametrize("sharded", [False, True])
def test_export_round_trip_every_layout(tmp_path, qwen3, layout, sharded):
    drafter = perturbed(tiny_drafter(qwen3, fusion=FUSION_OF[layout]))
    written = export_drafter(drafter, str(tmp_path), layout)
    assert os.path.join(str(tmp_path), "config.json") in written
    if sharded:
        shard(tmp_path)
    assert detect_layout(str(tmp_path)) == layout
    loaded = DScaleDrafter.from_pretrained(tmp_path)
    for key in ("fusion", "target_layer_ids", "block_size", "mask_token_id", "num_target_layers", "num_hidden_layers"):
        assert getattr(loaded.config, key) == getattr(drafter.config, key), key
    assert_same_forward(drafter, loaded, qwen3)


def test_dflash_export_has_zlab_keys_and_config(tmp_path, qwen3):
    drafter = tiny_drafter(qwen3, fusion="shared")
    export_drafter(drafter, str(tmp_path), "dflash")
    assert names_in(tmp_path) == zlab_keys(drafter.config.num_hidden_layers)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert config["model_type"] == "qwen3" and config["block_size"] == 8 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": drafter.config.target_layer_ids}
    assert config["layer_types"] == ["full_attention"] * 2 and config["head_dim"] == 16
    qwen = Qwen3Config.from_pretrained(tmp_path)  # what DFlashDraftModel is built from
    assert qwen.num_hidden_layers == 2 and qwen.dflash_config["target_layer_ids"] == drafter.config.target_layer_ids


def test_dflare_export_keeps_fusion_names(tmp_path, qwen3):
    drafter = tiny_drafter(qwen3, fusion="layerwise")
    export_drafter(drafter, str(tmp_path), "dflare")
    names = names_in(tmp_path)
    assert "layer_fusion_weights" in names and "layers.1.self_attn.k_proj_target.weight" in names
    assert "fc.weight" not in names
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["QwenDFlareDraftModel"]


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}])
def test_transformers_layout_loads_in_transformers_dflash_assistant_with_the_same_forward(tmp_path, qwen3, rope):
    drafter = perturbed(DScaleDrafter(DScaleConfig.from_target(qwen3.config, fusion="shared", mask_token_id=95,
                                                               rope_parameters=rope)).eval())
    export_drafter(drafter, str(tmp_path), "transformers")
    names = names_in(tmp_path)
    assert {"encoder.fc.weight", "encoder.output_norm_enc.weight"} <= names and "fc.weight" not in names
    native, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert type(native).__name__ == "MuseGlimmerAssistantModel"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    torch.manual_seed(0)
    s, t, q = 300, drafter.config.num_taps, drafter.config.block_size
    taps, block = torch.randn(1, s, t, 64), torch.randn(1, q, 64)
    with torch.no_grad():
        ours = drafter(block, taps, torch.arange(s, s + q)[None], torch.arange(s)[None])
        theirs = native(noise_embeds=block, context_hidden_states=taps.flatten(-2),
                        position_ids=torch.arange(s + q)[None]).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fusion, layout", [("layerwise", "dflash"), ("layerwise", "transformers"),
                                            ("shared", "dflare")])
def test_a_fusion_cannot_be_written_in_the_other_layout(tmp_path, qwen3, fusion, layout):
    with pytest.raises(ValueError, match="cannot be written"):
        export_drafter(tiny_drafter(qwen3, fusion=fusion), str(tmp_path), layout)


# --------------------------------------------------------------------------------------------- Hub ids
@pytest.mark.parametrize("layout", ["native", "dflash", "transformers"])
def test_hub_id_resolves_through_the_cache_then_detects_the_layout(tmp_path, qwen3, layout):
    drafter = tiny_drafter(qwen3, fusion=FUSION_OF[layout])
    export_drafter(drafter, str(tmp_path / "src"), layout)
    cache = tmp_path / "cache"
    add_to_hub_cache(cache, "z-lab/tiny-drafter", tmp_path / "src")
    loaded = DScaleDrafter.from_pretrained("z-lab/tiny-drafter", cache_dir=str(cache), local_files_only=True)
    assert loaded.config.target_layer_ids == drafter.config.target_layer_ids
    assert_same_forward(drafter, loaded, qwen3)


def test_hub_id_with_hf_hub_offline_in_a_fresh_process(tmp_path, qwen3):
    export_drafter(tiny_drafter(qwen3, fusion="shared"), str(tmp_path / "src"), "dflash")
    add_to_hub_cache(tmp_path / "cache", "z-lab/tiny-DFlash-b8", tmp_path / "src")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "cache"))
    script = ("from hf_dscale import DScaleDrafter; d = DScaleDrafter.from_pretrained('z-lab/tiny-DFlash-b8'); "
              "print('OK', d.config.fusion, d.config.block_size)")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK shared 8" in result.stdout


def test_unknown_hub_id_offline_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a Hub model id"):
        DScaleDrafter.from_pretrained("z-lab/no-such-drafter", cache_dir=str(tmp_path), local_files_only=True)


# ------------------------------------------------------------------------------------ config variants
@pytest.mark.parametrize("layout", ["native", "dflash"])
def test_num_target_layers_null_loads(tmp_path, qwen3, layout):
    drafter = tiny_drafter(qwen3, fusion=FUSION_OF[layout])
    export_drafter(drafter, str(tmp_path), layout)
    edit_config(tmp_path, num_target_layers=None)
    loaded = DScaleDrafter.from_pretrained(tmp_path)
    assert loaded.config.num_target_layers is None
    assert_same_forward(drafter, loaded, qwen3)


def test_zlab_without_target_layer_ids_derives_them_like_zlab_or_refuses(tmp_path, qwen3):
    target = qwen3
    config = DScaleConfig.from_target(target.config, num_hidden_layers=2, num_taps=2, fusion="shared",
                                      mask_token_id=95)
    export_drafter(DScaleDrafter(config), str(tmp_path), "dflash")
    edit_config(tmp_path, dflash_config={"mask_token_id": 95})
    assert DScaleDrafter.from_pretrained(tmp_path).config.target_layer_ids == [1, 3]  # z-lab's rule for N=6, 2 layers
    edit_config(tmp_path, num_target_layers=None)
    with pytest.raises(ValueError, match="no target_layer_ids"):
        DScaleDrafter.from_pretrained(tmp_path)


ROPES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16.0,
     "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"] + str(r["factor"]))
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_rotary_equals_transformers_for_each_rope_type(rope, family):
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96,
                  num_hidden_layers=6, intermediate_size=128, max_position_embeddings=512,
                  rope_parameters=dict(rope, rope_theta=10000.0))
    config = Qwen3Config(**common) if family == "qwen3" else LlamaConfig(**common)
    reference = (Qwen3RotaryEmbedding if family == "qwen3" else LlamaRotaryEmbedding)(config)
    drafter = DScaleDrafter(DScaleConfig.from_target(config, mask_token_id=3))
    assert drafter.config.rope_parameters["rope_type"] == rope["rope_type"]
    positions = torch.arange(0, 1400, 5)[None]  # past max_position_embeddings (dynamic rescales there)
    cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions)
    ours = drafter.rotary(positions, torch.float32, drafter.rotary.seq_len(positions))
    torch.testing.assert_close(ours[0][:, 0], cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1][:, 0], sin, rtol=1e-5, atol=1e-5)


def test_default_rope_is_unchanged_and_rebuilt_after_meta_loading(tmp_path, qwen3):
    drafter = tiny_drafter(qwen3)
    assert drafter.config.rope_parameters is None and drafter.rotary.attention_scaling == 1.0
    d, theta = drafter.config.head_dim, drafter.config.rope_theta
    torch.testing.assert_close(drafter.rotary.inv_freq, 1.0 / theta ** (torch.arange(0, d, 2).float() / d),
                               rtol=0, atol=0)
    config = DScaleConfig.from_target(qwen3.config, mask_token_id=95,
                                      rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 256})
    scaled = DScaleDrafter(config)
    scaled.save_pretrained(tmp_path)
    loaded = DScaleDrafter.from_pretrained(tmp_path)  # inv_freq is non-persistent: _init_weights rebuilds it
    assert loaded.config.rope_parameters["rope_type"] == "yarn"
    torch.testing.assert_close(loaded.rotary.inv_freq, scaled.rotary.inv_freq, rtol=0, atol=0)
    assert loaded.rotary.attention_scaling == scaled.rotary.attention_scaling > 1.0


def test_zlab_rope_scaling_of_transformers_4_is_read(tmp_path, qwen3):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}
    config = DScaleConfig.from_target(qwen3.config, num_hidden_layers=2, fusion="shared", mask_token_id=95,
                                      rope_parameters=rope)
    drafter = DScaleDrafter(config)
    export_drafter(drafter, str(tmp_path), "dflash")
    exported = json.loads((tmp_path / "config.json").read_text())
    assert exported["rope_parameters"]["rope_type"] == "llama3" and exported["rope_scaling"]["factor"] == 8.0
    positions = torch.arange(300)[None]
    reference = Qwen3RotaryEmbedding(Qwen3Config.from_pretrained(tmp_path))  # what z-lab's model would compute
    torch.testing.assert_close(drafter.rotary(positions, torch.float32)[0][:, 0],
                               reference(torch.zeros(1), positions)[0])
    edit_config(tmp_path, rope_parameters=..., rope_scaling={**rope, "type": rope["rope_type"]})
    loaded = DScaleDrafter.from_pretrained(tmp_path)
    assert loaded.config.rope_parameters["factor"] == 8.0
    assert_same_forward(drafter, loaded, qwen3)
    reference = Qwen3RotaryEmbedding(Qwen3Config.from_pretrained(tmp_path))
    torch.testing.assert_close(loaded.rotary(positions, torch.float32)[0][:, 0],
                               reference(torch.zeros(1), positions)[0])


def test_unsupported_rope_type_is_refused(qwen3):
    config = DScaleConfig.from_target(qwen3.config, mask_token_id=95)
    config.rope_parameters = {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}
    with pytest.raises(ValueError, match="longrope"):
        DScaleDrafter(config)


@pytest.mark.parametrize("layout, change, found", [
    ("transformers", dict(layer_types=...), "no layer_types"),
    ("transformers", dict(layer_types=["sliding_attention"] * 2), "layer_types"),
])
def test_transformers_sliding_window_configs_are_refused_by_name(tmp_path, qwen3, layout, change, found):
    export_drafter(tiny_drafter(qwen3, fusion=FUSION_OF[layout]), str(tmp_path), layout)
    edit_config(tmp_path, **change)
    with pytest.raises(ValueError, match="full attention") as error:
        DScaleDrafter.from_pretrained(tmp_path)
    assert found in str(error.value) and "layer_types" in str(error.value)


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window must be a number"),
    (dict(layer_types=["sliding_attention"], sliding_window=4), "layer_types"),
    (dict(layer_types=["chunked_attention", "full_attention"], sliding_window=4), "chunked_attention"),
    (dict(use_sliding_window=True, sliding_window=4), "name them in layer_types"),
])
def test_bad_native_window_configs_are_refused(tmp_path, qwen3, change, message):
    drafter = tiny_drafter(qwen3)
    drafter.save_pretrained(tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        DScaleDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize("change, types, window", [
    (dict(sliding_window=4096, use_sliding_window=False, layer_types=...), None, None),  # a stock Qwen3 config
    (dict(layer_types=["sliding_attention"] * 2), None, None),  # Qwen3Config drops the window without use_sliding_window
    (dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, layer_types=...),
     ["full_attention", "sliding_attention"], 6),  # layer_types derived from max_window_layers, as Qwen3Config does
    (dict(use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
     ["sliding_attention", "full_attention"], 6),  # z-lab's current drafters
])
def test_zlab_layer_types_are_read_as_zlab_computes_them(tmp_path, qwen3, change, types, window):
    export_drafter(tiny_drafter(qwen3, fusion="shared"), str(tmp_path), "dflash")
    edit_config(tmp_path, **change)
    config = DScaleDrafter.from_pretrained(tmp_path).config
    assert (config.layer_types if types else None, config.sliding_window if types else None) == (types, window)
    assert [config.window(i) for i in range(2)] == [window if t == "sliding_attention" else None
                                                   for t in (types or ["full_attention"] * 2)]


def test_a_sliding_draft_layer_sees_only_the_keys_within_its_window(tmp_path, qwen3):
    """A one-layer sliding drafter against the same weights at full attention, each block query run alone with the
    context keys its window (w - 1 positions back, as z-lab's flash attention) leaves it: equal outputs. A round
    trip through z-lab's layout keeps the window."""
    torch.manual_seed(3)
    full = DScaleDrafter(DScaleConfig.from_target(qwen3.config, num_hidden_layers=1, fusion="shared",
                                                  mask_token_id=95, block_size=4)).eval().bind_target(qwen3)
    sliding = DScaleDrafter(DScaleConfig.from_target(qwen3.config, num_hidden_layers=1, fusion="shared",
                                                     mask_token_id=95, block_size=4,
                                                     layer_types=["sliding_attention"], sliding_window=6))
    sliding.load_state_dict(full.state_dict())
    export_drafter(sliding, str(tmp_path), "dflash")
    sliding = DScaleDrafter.from_pretrained(tmp_path).eval().bind_target(qwen3)
    assert sliding.config.window(0) == 6
    c, h = 12, qwen3.config.hidden_size
    taps = torch.randn(1, c, full.config.num_taps, h)
    block = torch.randn(1, 4, h)
    positions = torch.arange(c, c + 4)[None]
    with torch.no_grad():
        out = sliding(block, taps, positions, torch.arange(c)[None])
        assert not torch.allclose(out, full(block, taps, positions, torch.arange(c)[None]), atol=1e-4)
        for i in range(4):
            first = c + i - 6 + 1  # the oldest context position within the window of query i
            alone = full(block, taps[:, first:], positions, torch.arange(first, c)[None])
            torch.testing.assert_close(out[0, i], alone[0, i], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- refusals
def test_eagle3_folder_is_refused(tmp_path):
    h = 64
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "num_hidden_layers": 1, "draft_vocab_size": 32, "vocab_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(h, 3 * h), "midlayer.self_attn.q_proj.weight": torch.zeros(h, 2 * h),
               "d2t": torch.zeros(32, dtype=torch.long), "t2d": torch.zeros(96, dtype=torch.bool),
               "norm.weight": torch.ones(h), "lm_head.weight": torch.zeros(32, h)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="EAGLE draft head.*LlamaForCausalLMEagle3.*d2t"):
        DScaleDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize("names", [dict(architectures=["DFlash2DraftModel"]),
                                   dict(auto_map={"AutoModel": "dfly.DFlyDrafter"})])
def test_newer_variants_are_refused_by_name(tmp_path, names):
    """DFlash2 and AngelSlim's DFly keep DFlash's tensor names; their forward is not public, so they are refused
    before any weight is read as if it were DFlash's."""
    h = 64
    config = {"model_type": "qwen3", "hidden_size": h, "num_hidden_layers": 1, "vocab_size": 96, **names,
              "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1]}, "block_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(h, 2 * h), "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"newer block-diffusion variant \((DFlash2DraftModel|dfly.DFlyDrafter)"):
        DScaleDrafter.from_pretrained(tmp_path)


def test_medusa_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    save_file({"medusa_head.0.0.linear.weight": torch.zeros(8, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="Medusa head.*medusa_num_heads"):
        DScaleDrafter.from_pretrained(tmp_path)


def test_plain_causal_lm_is_refused(tmp_path):
    tiny_target("qwen3").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="causal language model.*AutoModelForCausalLM"):
        DScaleDrafter.from_pretrained(tmp_path)


def test_config_without_weights_and_weights_without_config(tmp_path, qwen3):
    export_drafter(tiny_drafter(qwen3, fusion="shared"), str(tmp_path), "dflash")
    os.rename(tmp_path / "model.safetensors", tmp_path / "elsewhere.bin")
    with pytest.raises(ValueError, match="config.json .* but no weights"):
        DScaleDrafter.from_pretrained(tmp_path)
    os.rename(tmp_path / "elsewhere.bin", tmp_path / "model.safetensors")
    os.remove(tmp_path / "config.json")
    with pytest.raises(ValueError, match="has weights .* but no config.json"):
        DScaleDrafter.from_pretrained(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no config.json and no model.safetensors"):
        DScaleDrafter.from_pretrained(tmp_path)


@pytest.mark.parametrize("change, message", [
    (dict(block_size=8, dflash_config={"mask_token_id": 95, "target_layer_ids": [1, 2, 3], "block_size": 16}),
     "disagree"),
    (dict(block_size=...), "no block_size"),
    (dict(num_hidden_layers=3), "num_hidden_layers=3 but the weights hold 2 layers"),
    (dict(hidden_size=32), "fc.weight has shape"),
    (dict(dflash_config={"mask_token_id": 95, "target_layer_ids": [1, 2]}), "taps"),
    (dict(dflash_config={"mask_token_id": 95, "target_layer_ids": [1, 2, 3], "input_embedding_scale": 8.0}),
     "input_embedding_scale"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(is_causal=True), "is_causal"),
])
def test_zlab_config_inconsistent_with_its_weights_is_refused(tmp_path, qwen3, change, message):
    config = DScaleConfig.from_target(qwen3.config, num_taps=3, fusion="shared", mask_token_id=95, block_size=8)
    export_drafter(DScaleDrafter(config), str(tmp_path), "dflash")
    edit_config(tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        DScaleDrafter.from_pretrained(tmp_path)


def test_zlab_forward_options_at_their_neutral_values_load(tmp_path, qwen3):
    drafter = perturbed(tiny_drafter(qwen3, fusion="shared"))
    export_drafter(drafter, str(tmp_path), "dflash")
    config = edit_config(tmp_path, is_causal=False, final_logit_softcapping=None, output_multiplier=1.0)
    edit_config(tmp_path, dflash_config=dict(config["dflash_config"], input_embedding_scale=1.0))
    assert_same_forward(drafter, DScaleDrafter.from_pretrained(tmp_path), qwen3)


def test_unexpected_or_missing_weights_are_refused_in_every_layout(tmp_path, qwen3):
    for layout in ("native", "dflash", "dflare", "transformers"):
        folder = tmp_path / layout
        export_drafter(tiny_drafter(qwen3, fusion=FUSION_OF[layout]), str(folder), layout)
        state = load_file(str(folder / "model.safetensors"))
        state["layers.0.attention_conv.base_kernel"] = torch.zeros(2)  # a DFlash2-style extra
        state.pop("norm.weight")
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match="attention_conv") as error:
            DScaleDrafter.from_pretrained(folder)
        assert "norm.weight" in str(error.value), layout


# -------------------------------------------------------------------------------------- draft vocab
@pytest.mark.parametrize("layout", ["native", "dflash", "dflare", "transformers"])
def test_draft_vocab_round_trips_without_upstream_seeing_it(tmp_path, qwen3, layout):
    drafter = tiny_drafter(qwen3, fusion=FUSION_OF[layout])
    drafter.set_draft_vocab([5, 9, 2, 40])
    export_drafter(drafter, str(tmp_path), layout)
    if layout != "native":
        assert "draft_vocab" not in names_in(tmp_path)  # upstream loaders see their own names only
        assert (tmp_path / "draft_vocab.safetensors").exists()
        assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 4
    if layout == "dflash":
        assert names_in(tmp_path) == zlab_keys(2)
    loaded = DScaleDrafter.from_pretrained(tmp_path)
    assert loaded.draft_vocab.tolist() == [5, 9, 2, 40] and loaded.config.draft_vocab_size == 4


def test_draft_vocab_inside_reference_weights_is_accepted_and_a_missing_one_refused(tmp_path, qwen3):
    drafter = tiny_drafter(qwen3, fusion="shared")
    drafter.set_draft_vocab([1, 2, 3])
    export_drafter(drafter, str(tmp_path), "dflash")
    state = load_file(str(tmp_path / "model.safetensors"))  # as earlier versions wrote it: inside the weights
    state["draft_vocab"] = load_file(str(tmp_path / "draft_vocab.safetensors"))["draft_vocab"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    os.remove(tmp_path / "draft_vocab.safetensors")
    edit_config(tmp_path, draft_vocab_size=...)
    assert DScaleDrafter.from_pretrained(tmp_path).draft_vocab.tolist() == [1, 2, 3]
    state.pop("draft_vocab")
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    edit_config(tmp_path, draft_vocab_size=3)
    with pytest.raises(ValueError, match="draft_vocab_size 3 but neither draft_vocab.safetensors"):
        DScaleDrafter.from_pretrained(tmp_path)


def test_reference_layout_dtype_auto_keeps_the_checkpoint_dtype(tmp_path, qwen3):
    export_drafter(tiny_drafter(qwen3, fusion="shared").to(torch.bfloat16), str(tmp_path), "dflash")
    assert DScaleDrafter.from_pretrained(tmp_path, dtype="auto").norm.weight.dtype == torch.bfloat16
    assert DScaleDrafter.from_pretrained(tmp_path, dtype=torch.float32).norm.weight.dtype == torch.float32
