"""Read and write drafters in every public layout; resolve Hub ids.

Layouts (detected from the weight names, never from `architectures` alone):

* "native": our `save_pretrained` folder, `model_type: "dscale"`.
* "dflash": z-lab `DFlashDraftModel` (also AngelSlim `QwenDFlashDraftModel`): `fc.weight` [H, T·H],
  `hidden_norm.weight`, `layers.N.*`, `norm.weight`; a Qwen3 `config.json` with `block_size`,
  `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`.
* "dflare": AngelSlim `QwenDFlareDraftModel`: `layer_fusion_weights` [D, T] and per-layer
  `k_proj_target`/`v_proj_target`, same config as DFlash.
* "transformers": transformers' own DFlash assistant (`MuseGlimmerAssistantModel`,
  `model_type: "muse_glimmer_assistant"`): `encoder.fc.weight` and `encoder.output_norm_enc.weight` for our
  `fc`/`hidden_norm`, other names as ours; flat `target_layer_ids`, `mask_token_id`, `block_size`,
  `rope_parameters`, `layer_types` in the config.

Weights are `model.safetensors` or a sharded `model.safetensors.index.json` in every layout; a leading
`model.` on the names is ignored. Loading is strict: a missing or unexpected weight is an error.

Draft vocabulary: the upstream layouts have no `draft_vocab`. Exports to them keep `model.safetensors` to
the upstream names and write a drafter's `draft_vocab` to a separate `draft_vocab.safetensors`, with
`draft_vocab_size` in the config (a key upstream loaders ignore); the reader takes it from there, or from a
`draft_vocab` tensor inside `model.safetensors` (written by earlier versions).
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .configuration_dscale import DScaleConfig, build_target_layer_ids, sliding_attention_in

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
LAYOUTS = ("native", "dflash", "dflare", "transformers")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflare": "QwenDFlareDraftModel",
                 "transformers": "MuseGlimmerAssistantModel"}
AUTO_MAPS = {"dflash": {"AutoModel": "dflash.DFlashDraftModel"}}  # z-lab's Hub repos ship dflash.py
TRANSFORMERS_MODEL_TYPE = "muse_glimmer_assistant"
TRANSFORMERS_DEFAULT_THETA = 500000.0  # MuseGlimmerAssistantConfig.default_theta
# transformers' DFlash assistant -> our names (the rest is shared)
TRANSFORMERS_RENAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.py"]
_HUB_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "force_download", "subfolder")


# ----------------------------------------------------------------------------------------------- Hub
def split_hub_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """(the Hub arguments of a from_pretrained call, the rest)."""
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    return hub, {k: v for k, v in kwargs.items() if k not in _HUB_KWARGS}


def resolve_folder(name_or_path, revision=None, cache_dir=None, local_files_only=False, token=None,
                   force_download=False, subfolder: str = "") -> str:
    """A local folder for a folder path or a Hub model id (config, weights and code files only).

    Hub ids go through huggingface_hub's `snapshot_download`, which honours `HF_HUB_OFFLINE` and the cache.
    """
    path = str(name_or_path)
    if os.path.isdir(path):
        return os.path.join(path, subfolder) if subfolder else path
    from huggingface_hub import snapshot_download

    patterns = [f"{subfolder}/{p}" for p in HUB_PATTERNS] if subfolder else HUB_PATTERNS
    try:
        folder = snapshot_download(path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                                   token=token, force_download=force_download, allow_patterns=patterns)
    except Exception as error:  # huggingface_hub's errors: not found, offline, gated, invalid id
        raise FileNotFoundError(
            f"{path!r} is neither a local folder nor a Hub model id that could be fetched "
            f"(revision {revision or 'main'}): {type(error).__name__}: {error}. Pass a drafter folder, or a Hub id "
            "that is in the cache when offline (HF_HUB_OFFLINE=1 or local_files_only=True)."
        ) from error
    return os.path.join(folder, subfolder) if subfolder else folder


# ------------------------------------------------------------------------------------------- weights
def _read_config(path: str) -> dict | None:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def _shards(path: str) -> list[str] | None:
    """The safetensors files of a folder (one, or the shards of its index); None when it has none."""
    if os.path.isfile(os.path.join(path, WEIGHTS)):
        return [os.path.join(path, WEIGHTS)]
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    return [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]


def weight_names(path: str) -> list[str]:
    """Every tensor name of a folder's safetensors weights ([] when it has none)."""
    names = []
    for file in _shards(path) or []:
        with safe_open(file, framework="pt") as f:
            names.extend(f.keys())
    return names


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a folder (single file or shards)."""
    state = {}
    for file in _shards(path) or []:
        state.update(load_file(file))
    return state


# ------------------------------------------------------------------------------------------ detection
def _refuse_foreign(path: str, config: dict, names: set[str]) -> None:
    """ValueError for the speculative heads that are not drafters of ours (EAGLE, Medusa), for the block drafters of
    newer variants whose modeling code is not public (DFlash2, AngelSlim's DFly), and for plain LMs."""
    architectures = config.get("architectures") or []
    named = [*architectures, str(config.get("model_type") or ""), *map(str, (config.get("auto_map") or {}).values())]
    newer = sorted({name for name in named if re.search(r"dflash-?2|dfly", name, re.IGNORECASE)})
    if newer:
        raise ValueError(
            f"{path} is a drafter of a newer block-diffusion variant ({', '.join(newer)}: DFlash2 or AngelSlim's DFly) "
            "whose modeling code hf_dscale has not read (none was public), so it cannot tell how that drafter "
            "computes a block and does not guess. Load it with its own code (trust_remote_code=True), or use a "
            "DScale, DFlash or DFlare drafter."
        )
    eagle = [a for a in architectures if "eagle" in a.lower()]
    eagle_tensors = sorted(n for n in names if n in ("d2t", "t2d") or n.startswith("midlayer."))
    if eagle or eagle_tensors:
        found = ", ".join(filter(None, [f"architectures {eagle}" if eagle else "",
                                        f"tensors {eagle_tensors[:4]}" if eagle_tensors else "",
                                        "draft_vocab_size" if "draft_vocab_size" in config else ""]))
        raise ValueError(
            f"{path} is an EAGLE draft head ({found}), not a block-diffusion drafter: hf_dscale cannot run it. "
            "Load it with the EAGLE/SpecForge code (or SGLang/vLLM), or use a DScale/DFlash/DFlare drafter."
        )
    medusa = sorted(n for n in names if n.startswith("medusa_head"))
    if "medusa_num_heads" in config or medusa:
        found = "medusa_num_heads in config.json" if "medusa_num_heads" in config else f"tensors {medusa[:3]}"
        raise ValueError(
            f"{path} is a Medusa head ({found}), not a block-diffusion drafter: hf_dscale cannot run it. Load it "
            "with the Medusa code, or use a DScale/DFlash/DFlare drafter."
        )
    lm = [n for n in names if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    drafter_markers = {"fc.weight", "encoder.fc.weight", "layer_fusion_weights"} & names
    causal = [a for a in architectures if a.endswith(("ForCausalLM", "LMHeadModel")) and not drafter_markers]
    if lm or causal:
        found = f"architectures {causal}" if causal else f"tensors {sorted(lm)}"
        raise ValueError(
            f"{path} is a causal language model ({found}, model_type={config.get('model_type')!r}), "
            "not a DScale, DFlash or DFlare drafter. Load target models with AutoModelForCausalLM, and drafters with "
            "DScaleDrafter.from_pretrained."
        )


def detect_layout(path: str) -> str:
    """One of `LAYOUTS` for a local folder; FileNotFoundError/ValueError naming what it holds otherwise."""
    config = _read_config(path)
    names = {n.removeprefix("model.") for n in weight_names(path)}
    if config is None:
        if names:
            raise ValueError(
                f"{path} has weights ({len(names)} tensors, e.g. {min(names)!r}) but no config.json. Copy the "
                "config.json the weights were saved with next to them."
            )
        raise FileNotFoundError(f"{path} has no config.json and no model.safetensors: it is not a drafter folder.")
    _refuse_foreign(path, config, names)
    if not names:
        raise ValueError(
            f"{path} has a config.json (model_type={config.get('model_type')!r}) but no weights "
            f"({WEIGHTS} or {INDEX}; other formats such as pytorch_model.bin are not read). Download the "
            "safetensors weights too, or save the drafter again with save_pretrained."
        )
    if config.get("model_type") == DScaleConfig.model_type:
        return "native"
    if "encoder.fc.weight" in names:
        return "transformers"
    if "fc.weight" in names:
        return "dflash"
    if "layer_fusion_weights" in names or any(n.endswith("k_proj_target.weight") for n in names):
        return "dflare"
    raise ValueError(
        f"{path} is not a DScale, DFlash or DFlare drafter checkpoint (model_type={config.get('model_type')!r}, "
        f"architectures={config.get('architectures')}, no `fc.weight`, `encoder.fc.weight` or `layer_fusion_weights` "
        "in its weights). Load target models with AutoModelForCausalLM, and drafters from a folder written by "
        "DScaleDrafter.save_pretrained or `hf-dscale export`."
    )


# ------------------------------------------------------------------------------------------- reading
def _our_names(state: dict, layout: str) -> dict:
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if layout == "transformers":
        state = {TRANSFORMERS_RENAMES.get(k, k): v for k, v in state.items()}
    return state


def _layer_count(names) -> int:
    found = {int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}
    return max(found) + 1 if found else 0


# z-lab options (in `dflash_config` or at the top level) that change a drafter's forward, and their neutral values.
FORWARD_OPTIONS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
                   "is_causal": None}


def _forward_options(config: dict) -> dict:
    """The forward-changing options an upstream config sets to other than their neutral values."""
    extra = config.get("dflash_config") or {}
    found = {}
    for key, neutral in FORWARD_OPTIONS.items():
        value = extra.get(key, config.get(key))
        if value is not None and value != neutral and (neutral is not None or value):
            found[key] = value
    return found


def config_from_reference(config: dict, layout: str, state: dict, path: str = "the checkpoint") -> DScaleConfig:
    """Our config for an upstream config dict and its (renamed) weights; ValueError naming any inconsistency."""
    extra = config.get("dflash_config") or {}
    hidden = config["hidden_size"]
    if layout == "transformers" and "layer_types" not in config:
        sliding = "no layer_types (MuseGlimmerAssistantConfig then makes every layer sliding_attention)"
    else:
        sliding = None if layout == "dflash" else sliding_attention_in(config,
                                                                       bare_window_slides=layout == "transformers")
    if sliding:
        raise ValueError(
            f"{path}: the drafter's layers are full attention, but this {layout} checkpoint asks for sliding-window "
            f"attention: {sliding}. It differs from full attention only on contexts longer than the window; to load "
            "it with full attention, set layer_types to full_attention for every layer (and use_sliding_window to "
            "false) in its config.json."
        )
    changed = _forward_options(config)
    if changed:
        raise ValueError(
            f"{path}: this {layout} checkpoint sets {changed}, which change the drafter's forward (scaled block "
            "embeddings or logits, soft-capped logits, a causal block); hf_dscale's drafter computes none of them, "
            "so it would draft differently from what the checkpoint was trained for. Use a checkpoint without them."
        )
    if layout == "dflare":
        num_taps = state["layer_fusion_weights"].shape[1]
    else:
        fc = state["fc.weight"]
        if fc.shape[0] != hidden or fc.shape[1] % hidden:
            raise ValueError(f"{path}: fc.weight has shape {list(fc.shape)}, not [hidden_size={hidden}, taps x "
                             f"{hidden}]; the config does not belong to these weights.")
        num_taps = fc.shape[1] // hidden
    layers = _layer_count(state)
    if layers != config["num_hidden_layers"]:
        raise ValueError(f"{path}: config.json says num_hidden_layers={config['num_hidden_layers']} but the weights "
                         f"hold {layers} layers; the config does not belong to these weights.")
    layer_types, window = _zlab_attention(config) if layout == "dflash" else (None, None)
    ids = config.get("target_layer_ids") if layout == "transformers" else extra.get("target_layer_ids")
    ids = ids if ids is not None else config.get("target_layer_ids")
    num_target_layers = config.get("num_target_layers")
    if ids is None and num_target_layers and num_taps == layers:  # z-lab's default: one tap per draft layer
        ids = build_target_layer_ids(num_target_layers, layers)
    if ids is None:
        raise ValueError(f"{path}: the config stores no target_layer_ids (dflash_config.target_layer_ids) and the "
                         f"weights' {num_taps} taps cannot be derived from it; add them to config.json.")
    if len(ids) != num_taps:
        raise ValueError(f"{path}: target_layer_ids has {len(ids)} entries but the weights were trained with "
                         f"{num_taps} taps.")
    sizes = {k: v for k, v in (("block_size", config.get("block_size")),
                               ("dflash_config.block_size", extra.get("block_size"))) if v is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{path}: {sizes} disagree; keep the block size the drafter was trained with.")
    if not sizes:
        raise ValueError(f"{path}: the config has no block_size; add the block size the drafter was trained with.")
    if "vocab_size" not in config:
        raise ValueError(f"{path}: config.json has no vocab_size (transformers' DFlash assistant config does not "
                         "require one); add the target's vocab_size to it.")
    default_theta = TRANSFORMERS_DEFAULT_THETA if layout == "transformers" else 1e6
    rope = config.get("rope_parameters") or {}
    vocab = state.get("draft_vocab")
    return DScaleConfig(
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        head_dim=config.get("head_dim"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", default_theta)),
        rope_parameters=config.get("rope_parameters"),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config.get("max_position_embeddings", 40960),
        vocab_size=config["vocab_size"],
        target_layer_ids=ids,
        num_target_layers=num_target_layers,
        fusion="layerwise" if layout == "dflare" else "shared",
        block_size=next(iter(sizes.values())),
        mask_token_id=config.get("mask_token_id") if layout == "transformers" else extra.get(
            "mask_token_id", config.get("mask_token_id")),
        draft_vocab_size=None if vocab is None else vocab.numel(),
        layer_types=layer_types,
        sliding_window=window,
    )


def _zlab_attention(config: dict) -> tuple[list[str] | None, int | None]:
    """The draft layers' attention as z-lab's `DFlashDraftModel` computes it: its config is transformers'
    `Qwen3Config`, which keeps `sliding_window` only with `use_sliding_window: true` and derives `layer_types` from
    `max_window_layers` where they are not given, and each layer with `layer_types[i] == "sliding_attention"` passes
    that window to its attention. (layer_types, window), or (None, None) where no layer slides."""
    from transformers import Qwen3Config

    keys = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")
    qwen = Qwen3Config(num_hidden_layers=config["num_hidden_layers"], **{k: config[k] for k in keys if k in config})
    types, window = list(qwen.layer_types), qwen.sliding_window
    if window is None or "sliding_attention" not in types:
        return None, None
    return types, window


def _strict_load(model, state: dict, path: str, layout: str) -> None:
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path} ({layout} layout) does not match the drafter it describes: missing weights {missing[:6]}, "
            f"unexpected weights {unexpected[:6]}. It may be a variant this reader does not support (e.g. "
            "DFlash2DraftModel, or attention_bias: true); hf_dscale reads DScale, DFlash, DFlare and transformers' "
            "DFlash assistant checkpoints."
        )
    model.load_state_dict(state, strict=True)


def load_reference_checkpoint(cls, path: str, dtype=None, torch_dtype=None, device_map=None, layout=None, **unused):
    """A drafter from a local folder in an upstream layout (see the module docstring)."""
    layout = layout or detect_layout(path)
    state = _our_names(load_weights(path), layout)
    draft_vocab_file = os.path.join(path, DRAFT_VOCAB_FILE)
    if os.path.isfile(draft_vocab_file):
        state.setdefault("draft_vocab", load_file(draft_vocab_file)["draft_vocab"])
    config = _read_config(path)
    model = cls(config_from_reference(config, layout, state, path))
    size = config.get("draft_vocab_size")
    if size is not None and "draft_vocab" not in state:
        raise ValueError(f"{path}: config.json has draft_vocab_size {size} but neither {DRAFT_VOCAB_FILE} nor a "
                         f"draft_vocab tensor; copy {DRAFT_VOCAB_FILE} too, or remove draft_vocab_size to propose "
                         "from the whole vocabulary.")
    if size is not None and size != state["draft_vocab"].numel():
        raise ValueError(f"{path}: config.json has draft_vocab_size {size} but the draft_vocab tensor holds "
                         f"{state['draft_vocab'].numel()} tokens; export the drafter again.")
    _strict_load(model, state, path, layout)
    dtype = dtype or torch_dtype
    if dtype == "auto":  # the checkpoint's own dtype, as in transformers
        dtype = next((v.dtype for k, v in state.items() if v.is_floating_point()), None)
    if dtype is not None:
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if isinstance(device_map, (str, torch.device)) and device_map != "auto":
        model = model.to(device_map)
    return model.eval()


# ------------------------------------------------------------------------------------------- writing
def _rope_fields(cfg: DScaleConfig, legacy: bool) -> dict:
    """`rope_parameters` (transformers 5.x) and `rope_theta`; with `legacy`, a scaled RoPE also as the 4.x
    `rope_scaling` (which 5.x reads as the same dict), for z-lab/AngelSlim code pinned to transformers 4."""
    rope = dict(cfg.rope_parameters or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
    fields = {"rope_theta": cfg.rope_theta, "rope_parameters": rope}
    if legacy and cfg.rope_parameters:
        fields["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return fields


def reference_config(cfg: DScaleConfig, layout: str) -> dict:
    """The config.json an upstream loader of `layout` reads for a drafter with config `cfg`."""
    full = ["full_attention"] * cfg.num_hidden_layers
    common = {
        "architectures": [ARCHITECTURES[layout]],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **_rope_fields(cfg, legacy=layout != "transformers"),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_dropout": 0.0,
        "layer_types": full,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
    }
    slides = cfg.layer_types is not None and "sliding_attention" in cfg.layer_types
    if layout == "dflash" and slides:  # z-lab's Qwen3Config keeps the window only with use_sliding_window
        common["layer_types"] = list(cfg.layer_types)
    elif slides:
        raise ValueError(f"The {layout} layout has no sliding-window draft layers; export this drafter as dflash.")
    if layout == "transformers":
        return {**common, "model_type": TRANSFORMERS_MODEL_TYPE, "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": list(cfg.target_layer_ids), "sliding_window": cfg.max_position_embeddings,
                "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    config = {**common, "model_type": "qwen3", "attention_bias": False, "use_sliding_window": slides,
              "sliding_window": cfg.sliding_window if slides else None, "tie_word_embeddings": False,
              "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}}
    if layout in AUTO_MAPS:
        config["auto_map"] = AUTO_MAPS[layout]
    return config


def save_reference_checkpoint(model, path: str, layout: str | None = None) -> list[str]:
    """Write `model` in an upstream layout: "dflash" or "transformers" (fusion="shared"), "dflare"
    (fusion="layerwise"; the default follows the fusion). Returns the files written."""
    cfg = model.config
    allowed = ("dflash", "transformers") if cfg.fusion == "shared" else ("dflare",)
    layout = layout or allowed[0]
    if layout not in allowed:
        kind = "shared-fusion (DFlash)" if cfg.fusion == "shared" else "layer-wise (DScale/DFlare)"
        raise ValueError(f"A {kind} drafter (fusion={cfg.fusion!r}) cannot be written in the {layout!r} layout, whose "
                         f"weights have another shape; write it as {' or '.join(map(repr, allowed))} or 'native'.")
    os.makedirs(path, exist_ok=True)
    config = reference_config(cfg, layout)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    vocab = state.pop("draft_vocab", None)
    if layout == "transformers":
        state = {{v: k for k, v in TRANSFORMERS_RENAMES.items()}.get(k, k): v for k, v in state.items()}
    written = [os.path.join(path, "config.json"), os.path.join(path, WEIGHTS)]
    if vocab is not None:
        config["draft_vocab_size"] = vocab.numel()
        save_file({"draft_vocab": vocab}, os.path.join(path, DRAFT_VOCAB_FILE), metadata={"format": "pt"})
        written.append(os.path.join(path, DRAFT_VOCAB_FILE))
    with open(written[0], "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, written[1], metadata={"format": "pt"})
    return written


def export_drafter(model, path: str, layout: str) -> list[str]:
    """Write `model` to `path` in one of `LAYOUTS`; returns the files written."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
    if layout != "native":
        return save_reference_checkpoint(model, path, layout)
    model.save_pretrained(path)
    return sorted(os.path.join(path, name) for name in os.listdir(path))
