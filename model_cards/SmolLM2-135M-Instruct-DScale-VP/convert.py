"""Read and write drafters in the public reference layouts.

* DFlash (z-lab `DFlashDraftModel`, AngelSlim `QwenDFlashDraftModel`): `fc.weight` [H, T·H].
* DFlare (AngelSlim `QwenDFlareDraftModel`): `layer_fusion_weights` [D, T] and per-layer
  `k_proj_target`/`v_proj_target`.

Both store a Qwen3-style `config.json` with `block_size`, `num_target_layers` and
`dflash_config: {mask_token_id, target_layer_ids}`. The layout is detected from the weight names, not
from `architectures`. Our own layout uses the same weight names with a `model_type: "dscale"` config.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .configuration_dscale import DScaleConfig

_WEIGHTS = "model.safetensors"
_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflare": "QwenDFlareDraftModel"}


def _read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path} has no config.json: it is not a saved drafter folder.")
    with open(file) as f:
        return json.load(f)


def _weight_names(path: str) -> list[str]:
    file = os.path.join(path, _WEIGHTS)
    if not os.path.isfile(file):
        return []
    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def reference_layout(path: str) -> str | None:
    """"dflash", "dflare", or None for a native DScale folder; ValueError for anything else."""
    config = _read_config(path)
    if config.get("model_type") == DScaleConfig.model_type:
        return None
    names = {n.removeprefix("model.") for n in _weight_names(path)}
    if "fc.weight" in names:
        return "dflash"
    if "layer_fusion_weights" in names or any(n.endswith("k_proj_target.weight") for n in names):
        return "dflare"
    raise ValueError(
        f"{path} is not a DScale, DFlash or DFlare drafter checkpoint (model_type={config.get('model_type')!r}, "
        "no `fc.weight` or `layer_fusion_weights` in model.safetensors). Load target models with "
        "AutoModelForCausalLM, and drafters from a folder written by DScaleDrafter.save_pretrained."
    )


def config_from_reference(config: dict, layout: str, num_taps: int) -> DScaleConfig:
    extra = config.get("dflash_config") or {}
    rope = config.get("rope_parameters") or {}
    ids = extra.get("target_layer_ids") or config.get("target_layer_ids")
    if ids is None:
        raise ValueError("The checkpoint stores no dflash_config.target_layer_ids; refusing to guess the taps.")
    if len(ids) != num_taps:
        raise ValueError(f"target_layer_ids has {len(ids)} entries but the weights were trained with {num_taps} taps.")
    return DScaleConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        head_dim=config.get("head_dim"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", rope.get("rope_theta", 1e6)),
        max_position_embeddings=config.get("max_position_embeddings", 40960),
        vocab_size=config["vocab_size"],
        target_layer_ids=ids,
        num_target_layers=config.get("num_target_layers"),
        fusion="shared" if layout == "dflash" else "layerwise",
        block_size=config.get("block_size", 16),
        mask_token_id=extra.get("mask_token_id", config.get("mask_token_id")),
    )


def load_reference_checkpoint(cls, path: str, dtype=None, torch_dtype=None, device_map=None, **unused):
    layout = reference_layout(path)
    state = {k.removeprefix("model."): v for k, v in load_file(os.path.join(path, _WEIGHTS)).items()}
    if layout == "dflash":
        num_taps = state["fc.weight"].shape[1] // state["fc.weight"].shape[0]
    else:
        num_taps = state["layer_fusion_weights"].shape[1]
    model = cls(config_from_reference(_read_config(path), layout, num_taps))
    model.load_state_dict(state, strict=True)
    dtype = dtype or torch_dtype
    if dtype is not None and dtype != "auto":
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if isinstance(device_map, (str, torch.device)) and device_map != "auto":
        model = model.to(device_map)
    return model.eval()


def save_reference_checkpoint(model, path: str, layout: str | None = None) -> None:
    """Write `model` in the DFlash (fusion="shared") or DFlare (fusion="layerwise") public layout."""
    cfg = model.config
    expected = "dflash" if cfg.fusion == "shared" else "dflare"
    layout = layout or expected
    if layout != expected:
        raise ValueError(f"A fusion={cfg.fusion!r} drafter can only be written in the {expected!r} layout.")
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": [_ARCHITECTURES[layout]],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(path, _WEIGHTS), metadata={"format": "pt"})
