"""A small masked-diffusion language model with a dual KV cache, and the adapter for hub dLLMs.

`DiffusionLM` is a bidirectional Llama-style transformer trained to fill masked tokens. Two forward
modes, both through `forward`:

* **full**: the whole sequence [B, L]; with `cache` given, every layer's K/V for all L positions are
  stored in it (keys after RoPE, at their absolute positions);
* **block**: only some positions [B, Q] (absolute `position_ids`); their new K/V replace the cached
  ones in place where `write` is True, and their queries attend to all L cached keys of their row:
  the prefix, the fresh block and a possibly stale suffix. That is Fast-dLLM's *dual cache*.

`config.logits_shift` = 0 is LLaDA-style (the logit at p predicts token p), 1 is Dream-style (the logit
at p - 1 predicts token p); decoders go through `DiffusionModel`, which aligns both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ModelOutput


class DiffusionLMConfig(PretrainedConfig):
    """Args: the usual decoder sizes; `mask_token_id` (the noise token, required); `logits_shift` (0 or 1)."""

    model_type = "hf_dscale_dlm"

    def __init__(self, vocab_size=128, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=512, rms_norm_eps=1e-6,
                 initializer_range=0.02, mask_token_id=None, logits_shift=0, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id
        self.logits_shift = logits_shift
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class DualCache:
    """Per-layer keys/values [B, heads, L, head_dim] of every position of the sequence."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    @property
    def batch_size(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[0]

    def expand(self, rows: int) -> None:
        """Broadcast a batch-1 cache to `rows` independent rows."""
        self.keys = [k.expand(rows, -1, -1, -1).clone() for k in self.keys]
        self.values = [v.expand(rows, -1, -1, -1).clone() for v in self.values]

    def copy_row(self, dst: int, src: int) -> None:
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[dst] = t[src]

    def write_rows(self, rows: torch.Tensor, other: "DualCache") -> None:
        """Rows `rows` of this cache take the rows of `other` (a cache of len(rows) rows)."""
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for layer, t in enumerate(mine):
                t[rows] = theirs[layer]


@dataclass
class DiffusionLMOutput(ModelOutput):
    logits: torch.Tensor | None = None


def _rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, positions, theta):
    """x [B, H, Q, d], positions [B, Q]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions[:, None, :, None].float() * inv
    cos, sin = torch.cat((freqs, freqs), -1).cos().to(x.dtype), torch.cat((freqs, freqs), -1).sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def dual_cache_kv(k, v, positions, cache: DualCache | None, layer: int, write: torch.Tensor | None):
    """The keys and values [B, heads, *, d] a layer attends to. Without a cache, k and v; a full forward (the layer's
    cache still empty) stores them; a block forward writes them in place at `positions` [B, Q] where `write` [B, Q]
    is True (all of them when None) and returns every cached position of the row."""
    if cache is None:
        return k, v
    if cache.keys[layer] is None:
        cache.keys[layer], cache.values[layer] = k, v
        return k, v
    keys, values = cache.keys[layer], cache.values[layer]
    b, q = positions.shape
    rows = torch.arange(b, device=k.device)[:, None].expand(b, q)
    sel = write if write is not None else torch.ones(b, q, dtype=torch.bool, device=k.device)
    keys[rows[sel], :, positions[sel]] = k.transpose(1, 2)[sel]
    values[rows[sel], :, positions[sel]] = v.transpose(1, 2)[sel]
    return keys, values


class _Layer(nn.Module):
    def __init__(self, config: DiffusionLMConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.heads, self.eps, self.theta = config.num_attention_heads, config.rms_norm_eps, config.rope_theta
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x, positions, cache: DualCache | None, layer: int, write: torch.Tensor | None):
        b, q, h = x.shape
        qkv = self.qkv(_rms(x, self.attn_norm, self.eps)).view(b, q, 3, self.heads, h // self.heads)
        qh, kh, vh = (t.transpose(1, 2) for t in qkv.unbind(2))
        qh, kh = _rope(qh, positions, self.theta), _rope(kh, positions, self.theta)
        kh, vh = dual_cache_kv(kh, vh, positions, cache, layer, write)
        out = F.scaled_dot_product_attention(qh, kh, vh)  # bidirectional
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, q, h))
        gate, up = self.gate_up(_rms(x, self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DiffusionLM(PreTrainedModel, GenerationMixin):
    """See the module docstring. `forward(input_ids, position_ids=None, cache=None, write=None)`.

    Decode it with `model.generate(..., custom_generate=hf_dscale.generation.dllm_generate,
    dllm_method="fast-dllm" | "blockbatch")`; plain autoregressive `generate()` does not apply.
    """

    config_class = DiffusionLMConfig
    base_model_prefix = ""
    _supports_sdpa = True

    def __init__(self, config: DiffusionLMConfig):
        super().__init__(config)
        if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
            raise ValueError("DiffusionLMConfig.mask_token_id must be a token id of the vocabulary (the noise token).")
        if config.logits_shift not in (0, 1):
            raise ValueError(f"logits_shift must be 0 (LLaDA-style) or 1 (Dream-style), got {config.logits_shift}.")
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, position_ids=None, cache: DualCache | None = None, write=None, **unused):
        b, q = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(q, device=input_ids.device)[None].expand(b, q)
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, position_ids, cache, i, write)
        return DiffusionLMOutput(logits=self.lm_head(_rms(x, self.norm, self.config.rms_norm_eps)))
