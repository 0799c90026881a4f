"""LLaDA and Dream, the published masked-diffusion LMs, as hf_dscale classes that read their checkpoints as published.

Both are bidirectional pre-norm transformers (RMSNorm, split-half RoPE, SwiGLU MLP); they differ in names and in
what a logit predicts:

* **LLaDA** (`model_type: "llada"`, e.g. GSAI-ML/LLaDA-8B-Instruct): an OLMo-style config (`d_model`, `n_layers`,
  `n_heads`, `n_kv_heads`, `mlp_hidden_size`, `embedding_size`, `weight_tying`, `include_bias`, ...) and weights
  under `model.transformer.`: `wte`, `blocks.N.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm, ff_proj (the
  gate), up_proj, ff_out (down)}`, `ln_f`, `ff_out` (the LM head, absent with `weight_tying`). The logit at p predicts
  the token at p. Mask token 126336 (`mask_token_id` in its config).
* **Dream** (`model_type: "Dream"`, e.g. Dream-org/Dream-v0-Instruct-7B): a Qwen2 config and Qwen2 weight names
  (`model.embed_tokens`, `model.layers.N.self_attn.{q,k,v}_proj` with biases, `o_proj`, `mlp.{gate,up,down}_proj`,
  `model.norm`, `lm_head`), attention without a causal mask. The logit at p predicts the token at p + 1 (the
  decoders align it, `DiffusionModel`). Mask token 151666.

With `import hf_dscale` the Auto classes know both model types, so `AutoModel.from_pretrained(folder_or_hub_id)`
(or `AutoModelForCausalLM`) loads a published checkpoint with this code, without `trust_remote_code` (the published
remote code does not load on transformers 5.x). Both forward the dual KV cache of hf_dscale's `DiffusionLM` (`cache`,
`write`, `position_ids`: see modeling_dllm.py) and have `generate()`, so
`model.generate(..., custom_generate=dllm_generate)` decodes them with Fast-dLLM or BlockBatch. Options of the
published configs that change the forward and are not computed here are refused by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel

from .modeling_dllm import BlockQueries, DiffusionLMOutput, DualCache, _rms, attend, block_queries, rotary, rotate

LLADA_MASK_ID = 126336
DREAM_MASK_ID = 151666


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return _rms(x, self.weight, self.eps)


def _attend(q, k, v, rot, cache: DualCache | None, layer: int, block: BlockQueries | None, key_padding):
    """Bidirectional attention of q [B, Hq, Q, d] over k, v [B, Hkv, Q, d] (rotated here) with the dual cache
    (`modeling_dllm.attend`); key_padding [B, L] bool (True = a real token) or None. Returns [B, Q, Hq * d]."""
    bias = None
    if key_padding is not None:
        bias = torch.zeros(key_padding.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~key_padding, torch.finfo(q.dtype).min)[:, None, None, :]
    return attend(rotate(q, rot), rotate(k, rot), v, cache, layer, block, bias)


def _heads(x, proj, heads):
    b, q, _ = x.shape
    return proj(x).view(b, q, heads, -1).transpose(1, 2)


def _key_padding(attention_mask):
    if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.bool().all()):
        return None
    return attention_mask.bool()


def _refuse(config, what: dict, family: str) -> None:
    """ValueError naming the config keys whose values change the forward in ways not computed here. `what`: {key:
    a test of its value}, the value read from the config (Dream's `rope_scaling` as the config received it)."""
    values = {key: getattr(config, "given_rope_scaling" if key == "rope_scaling" else key, None) for key in what}
    found = {key: values[key] for key, ok in what.items() if not ok(values[key])}
    if found:
        raise ValueError(
            f"This {family} checkpoint sets {found}, which hf_dscale's {family} class does not compute (it reads the "
            "published checkpoints' layout). Load a checkpoint without them, or its own remote code."
        )


def _plain_rope(rope: dict | None) -> bool:
    """Whether a rope dict (transformers 5.x fills one in from `rope_theta`) asks for plain, unscaled RoPE."""
    return not rope or rope.get("rope_type", rope.get("type", "default")) == "default"


# ---------------------------------------------------------------------------------------------------------- LLaDA
class LLaDAConfig(PretrainedConfig):
    """LLaDA's published config keys (OLMo-style), with the usual transformers names as aliases."""

    model_type = "llada"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads"}

    def __init__(self, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=None, mlp_hidden_size=None, mlp_ratio=4,
                 vocab_size=126464, embedding_size=None, weight_tying=False, include_bias=False,
                 include_qkv_bias=False, rms_norm_eps=1e-5, rope_theta=10000.0, max_sequence_length=4096,
                 mask_token_id=LLADA_MASK_ID, block_type="llama", layer_norm_type="rms", activation_type="silu",
                 rope=True, alibi=False, input_emb_norm=False, scale_logits=False, attention_layer_norm=False,
                 block_group_size=1, layer_norm_with_affine=True, bias_for_layer_norm=None, **kwargs):
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.n_kv_heads = n_kv_heads
        self.mlp_hidden_size, self.mlp_ratio = mlp_hidden_size, mlp_ratio
        self.vocab_size, self.embedding_size, self.weight_tying = vocab_size, embedding_size, weight_tying
        self.include_bias, self.include_qkv_bias = include_bias, include_qkv_bias
        self.rms_norm_eps, self.rope_theta, self.max_sequence_length = rms_norm_eps, rope_theta, max_sequence_length
        self.mask_token_id = mask_token_id
        self.block_type, self.layer_norm_type, self.activation_type = block_type, layer_norm_type, activation_type
        self.rope, self.alibi, self.input_emb_norm, self.scale_logits = rope, alibi, input_emb_norm, scale_logits
        self.attention_layer_norm, self.block_group_size = attention_layer_norm, block_group_size
        self.layer_norm_with_affine, self.bias_for_layer_norm = layer_norm_with_affine, bias_for_layer_norm
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def mlp_size(self) -> int:
        return self.mlp_hidden_size or self.mlp_ratio * self.d_model

    @property
    def rows(self) -> int:
        """The embedding's and the LM head's rows (`embedding_size`, at least the vocabulary)."""
        return self.embedding_size or self.vocab_size


class _LLaDABlock(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        d, h, kv = config.d_model, config.mlp_size, config.kv_heads * (config.d_model // config.n_heads)
        bias, qkv_bias = config.include_bias, config.include_bias or config.include_qkv_bias
        self.heads, self.kv_heads = config.n_heads, config.kv_heads
        self.attn_norm, self.ff_norm = _RMSNorm(d, config.rms_norm_eps), _RMSNorm(d, config.rms_norm_eps)
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=qkv_bias), nn.Linear(d, kv, bias=qkv_bias)
        self.v_proj, self.attn_out = nn.Linear(d, kv, bias=qkv_bias), nn.Linear(d, d, bias=bias)
        self.ff_proj, self.up_proj = nn.Linear(d, h, bias=bias), nn.Linear(d, h, bias=bias)
        self.ff_out = nn.Linear(h, d, bias=bias)

    def forward(self, x, rot, cache, layer, block, key_padding):
        h = self.attn_norm(x)
        x = x + self.attn_out(_attend(_heads(h, self.q_proj, self.heads), _heads(h, self.k_proj, self.kv_heads),
                                      _heads(h, self.v_proj, self.kv_heads), rot, cache, layer, block, key_padding))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class _LLaDAModel(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        layers = dict(wte=nn.Embedding(config.rows, config.d_model),
                      blocks=nn.ModuleList(_LLaDABlock(config) for _ in range(config.n_layers)),
                      ln_f=_RMSNorm(config.d_model, config.rms_norm_eps))
        if not config.weight_tying:
            layers["ff_out"] = nn.Linear(config.d_model, config.rows, bias=config.include_bias)
        self.transformer = nn.ModuleDict(layers)


class LLaDAModelLM(PreTrainedModel, GenerationMixin):
    """LLaDA with the dual KV cache. `forward(input_ids, attention_mask=None, position_ids=None, cache=None,
    write=None)` -> logits [B, Q, embedding_size] (the logit at p predicts p)."""

    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["_LLaDABlock"]

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        _refuse(config, {"block_type": lambda v: v == "llama", "layer_norm_type": lambda v: v == "rms",
                         "activation_type": lambda v: v in ("silu", "swiglu"), "rope": bool,
                         "alibi": lambda v: not v, "input_emb_norm": lambda v: not v,
                         "scale_logits": lambda v: not v, "attention_layer_norm": lambda v: not v,
                         "block_group_size": lambda v: v in (None, 1),
                         "layer_norm_with_affine": lambda v: v in (None, True),
                         "bias_for_layer_norm": lambda v: not v}, "LLaDA")
        self.model = _LLaDAModel(config)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, _RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: DualCache | None = None, write=None,
                **unused):
        t, key_padding = self.model.transformer, _key_padding(attention_mask)
        input_ids, positions, block = block_queries(input_ids, position_ids, cache, write)
        x = t.wte(input_ids)
        rot = rotary(positions, self.config.d_model // self.config.n_heads, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(t.blocks):
            x = layer(x, rot, cache, i, block, key_padding)
        x = t.ln_f(x)
        logits = t.ff_out(x) if "ff_out" in t else F.linear(x, t.wte.weight)
        return DiffusionLMOutput(logits=logits if block is None else block.unpack(logits))


# ---------------------------------------------------------------------------------------------------------- Dream
class DreamConfig(PretrainedConfig):
    """Dream's published config: Qwen2's keys, `mask_token_id`."""

    model_type = "Dream"

    def __init__(self, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False,
                 mask_token_id=DREAM_MASK_ID, tie_word_embeddings=False, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.hidden_act, self.max_position_embeddings, self.rms_norm_eps = hidden_act, max_position_embeddings, \
            rms_norm_eps
        self.rope_theta, self.use_sliding_window = rope_theta, use_sliding_window
        self.given_rope_scaling = rope_scaling  # refused by the model unless plain RoPE; not set as `rope_scaling`,
        # which transformers 5.x turns into `rope_parameters` with a deprecation warning
        self.mask_token_id = mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class _DreamAttention(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        d, head = config.hidden_size, config.hidden_size // config.num_attention_heads
        kv = config.num_key_value_heads * head
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, kv), nn.Linear(d, kv)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, h, rot, cache, layer, block, key_padding):
        return self.o_proj(_attend(_heads(h, self.q_proj, self.heads), _heads(h, self.k_proj, self.kv_heads),
                                   _heads(h, self.v_proj, self.kv_heads), rot, cache, layer, block, key_padding))


class _DreamMLP(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class _DreamLayer(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _DreamAttention(config)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _DreamMLP(config)

    def forward(self, x, rot, cache, layer, block, key_padding):
        x = x + self.self_attn(self.input_layernorm(x), rot, cache, layer, block, key_padding)
        return x + self.mlp(self.post_attention_layernorm(x))


class _DreamBase(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_DreamLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)


class DreamModel(PreTrainedModel, GenerationMixin):
    """Dream with the dual KV cache. `forward(input_ids, attention_mask=None, position_ids=None, cache=None,
    write=None)` -> logits [B, Q, vocab] (the logit at p predicts p + 1, as published)."""

    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules = ["_DreamLayer"]

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        _refuse(config, {"hidden_act": lambda v: v == "silu", "rope_scaling": _plain_rope,
                         "use_sliding_window": lambda v: not v}, "Dream")
        self.model = _DreamBase(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    _init_weights = LLaDAModelLM._init_weights

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: DualCache | None = None, write=None,
                **unused):
        key_padding = _key_padding(attention_mask)
        input_ids, positions, block = block_queries(input_ids, position_ids, cache, write)
        x = self.model.embed_tokens(input_ids)
        rot = rotary(positions, self.config.hidden_size // self.config.num_attention_heads, self.config.rope_theta,
                     x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rot, cache, i, block, key_padding)
        x = self.model.norm(x)
        head = self.lm_head.weight if not self.config.tie_word_embeddings else self.model.embed_tokens.weight
        logits = F.linear(x, head)
        return DiffusionLMOutput(logits=logits if block is None else block.unpack(logits))
