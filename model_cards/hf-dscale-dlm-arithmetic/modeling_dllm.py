"""A small masked-diffusion language model with a dual KV cache, and the adapter for hub dLLMs.

`DiffusionLM` is a bidirectional Llama-style transformer trained to fill masked tokens. Two forward
modes, both through `forward`:

* **full**: the whole sequence [B, L]; with `cache` given, every layer's K/V for all L positions are
  stored in it (keys after RoPE, at their absolute positions);
* **block**: only some positions [B, Q] (absolute `position_ids`) of a filled cache; their new K/V
  replace the cached ones in place, and their queries attend to all L cached keys of their row: the
  prefix, the fresh block and a possibly stale suffix. That is Fast-dLLM's *dual cache*. `write`
  [B, Q] marks the queries that run (False: padding, which is not computed and gets zero logits):
  the real queries of all rows run packed as one row through everything but attention.

`config.logits_shift` = 0 is LLaDA-style (the logit at p predicts token p), 1 is Dream-style (the logit
at p - 1 predicts token p); decoders go through `DiffusionModel`, which aligns both.
"""

from __future__ import annotations

import itertools
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
    """Per-layer keys/values [B, heads, L, head_dim] of every position of the sequence.

    Once `expand`ed to several rows, every layer's keys and values are views of one tensor (`storage`, [2 * layers,
    B, heads, L, head_dim]), so that a row is copied, or every row refilled, in one operation, not one per tensor.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.storage: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    @property
    def batch_size(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[0]

    def clear(self) -> None:
        """Empty it, for a full forward to fill."""
        self.keys, self.values, self.storage = [None] * len(self.keys), [None] * len(self.values), None

    def expand(self, rows: int) -> None:
        """Broadcast a batch-1 cache to `rows` independent rows."""
        tensors = [*self.keys, *self.values]
        if len({(t.shape, t.dtype) for t in tensors}) > 1:  # layers unlike each other: one tensor each
            self.keys = [k.expand(rows, -1, -1, -1).clone() for k in self.keys]
            self.values = [v.expand(rows, -1, -1, -1).clone() for v in self.values]
            return
        self.storage = torch.stack(tensors).expand(-1, rows, -1, -1, -1).clone()
        n = len(self.keys)
        self.keys, self.values = list(self.storage[:n].unbind(0)), list(self.storage[n:].unbind(0))

    def copy_row(self, dst: int, src: int) -> None:
        if self.storage is not None:
            self.storage[:, dst] = self.storage[:, src]
            return
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[dst] = t[src]

    def fill(self, other: "DualCache") -> None:
        """Every row takes the single row of `other`."""
        if self.storage is not None:
            self.storage.copy_(torch.stack([*other.keys, *other.values]).expand_as(self.storage))
            return
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for t, u in zip(mine, theirs):
                t.copy_(u.expand_as(t))


@dataclass
class DiffusionLMOutput(ModelOutput):
    logits: torch.Tensor | None = None


def _rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary(positions, head_dim, theta, dtype):
    """RoPE's (cos, sin) [B, 1, Q, head_dim] for positions [B, Q]: computed once per forward, used by every layer."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions[:, None, :, None].float() * inv
    angles = torch.cat((freqs, freqs), -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x, rot):
    """Split-half RoPE of x [B, H, Q, d] with `rotary`'s (cos, sin)."""
    cos, sin = rot
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


class BlockQueries:
    """The queries of a block call that run: those where `write` [B, Q] is True (False marks padding, e.g. a short
    window in a batch of wider ones). Position-wise work (norms, projections, MLP, LM head) takes the T real queries
    packed into one row [1, T]; attention takes each row's queries (a contiguous span of the packed row) against its
    own cache row. A batch of windows of 16 and 32 positions costs 48 queries, not 2 x 32."""

    def __init__(self, write: torch.Tensor, positions: torch.Tensor):
        self.shape = write.shape
        counts = write.sum(-1).tolist()  # real queries per row
        self.dense = min(counts) == write.shape[1]
        self.index = None if self.dense else write.flatten().nonzero().squeeze(1)  # [T] into B * Q
        ends = list(itertools.accumulate(counts))
        self.spans = [(row, end - c, end) for row, (c, end) in enumerate(zip(counts, ends)) if c]  # (row, from, to)
        rows = torch.arange(write.shape[0], device=write.device)[:, None].expand(write.shape)
        self.rows = self.pack(rows)[0]  # [T]: the cache row of each query
        self.positions = self.pack(positions)  # [1, T]

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """[B, Q, ...] -> [1, T, ...]: the real queries."""
        flat = t.flatten(0, 1)
        return (flat if self.dense else flat[self.index])[None]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [B, Q, ...], zeros at padding."""
        if self.dense:
            return t.reshape(*self.shape, *t.shape[2:])
        out = t.new_zeros(self.shape[0] * self.shape[1], *t.shape[2:])
        out[self.index] = t[0]
        return out.view(*self.shape, *t.shape[2:])


def attend(q, k, v, cache: DualCache | None, layer: int, block: BlockQueries | None, bias=None):
    """Bidirectional attention; q [b, Hq, T, d], k and v [b, Hkv, T, d] (rotated). Returns [b, T, Hq * d].

    Without `block`, the T positions attend to each other (a full forward, whose K/V fill `cache` when given). With
    `block` (b = 1, T packed queries), their K/V replace the cached ones of their rows at their positions, and each
    row's queries attend to all L cached keys of that row: the prefix, the fresh block and a possibly stale suffix
    (the dual cache). `bias`: an additive attention mask [B, 1, 1, L] (key padding) or None.
    """
    if block is None:
        if cache is not None:
            cache.keys[layer], cache.values[layer] = k, v
        return _sdpa(q, k, v, bias).transpose(1, 2).flatten(2)
    keys, values = cache.keys[layer], cache.values[layer]
    keys[block.rows, :, block.positions[0]] = k[0].transpose(0, 1)
    values[block.rows, :, block.positions[0]] = v[0].transpose(0, 1)
    if len(block.spans) == 1:  # one row: its queries against its cache row
        r = block.spans[0][0]
        out = _sdpa(q, keys[r : r + 1], values[r : r + 1], None if bias is None else bias[r : r + 1])
        return out.transpose(1, 2).flatten(2)
    # several rows: one call over all of them, each row's queries padded to the widest (a padding query attends, and
    # its output is dropped), which costs less than a call per row
    rows, width = block.shape
    heads, d = q.shape[1], q.shape[-1]
    if block.dense:
        padded = q[0].reshape(heads, rows, width, d).transpose(0, 1)
    else:
        padded = q.new_zeros(rows * width, heads, d)
        padded[block.index] = q[0].transpose(0, 1)
        padded = padded.view(rows, width, heads, d).transpose(1, 2)  # [B, H, Q, d]
    out = _sdpa(padded, keys, values, bias).transpose(1, 2).reshape(rows * width, heads * d)  # [B * Q, H * d]
    return (out if block.dense else out[block.index])[None]


def _sdpa(q, k, v, bias):
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def block_queries(input_ids, position_ids, cache: DualCache | None, write) -> tuple:
    """A forward's (input_ids, positions, BlockQueries or None): a block call (the cache already filled) runs its
    real queries packed; a full forward, or one without a cache, runs as given."""
    b, q = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(q, device=input_ids.device)[None].expand(b, q)
    if cache is None or not len(cache):
        return input_ids, position_ids, None
    block = BlockQueries(torch.ones_like(input_ids, dtype=torch.bool) if write is None else write, position_ids)
    return block.pack(input_ids), block.positions, block


class _Layer(nn.Module):
    def __init__(self, config: DiffusionLMConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.heads, self.eps = config.num_attention_heads, config.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x, rot, cache: DualCache | None, layer: int, block: BlockQueries | None):
        b, q, h = x.shape
        qkv = self.qkv(_rms(x, self.attn_norm, self.eps)).view(b, q, 3, self.heads, h // self.heads)
        qh, kh, vh = (t.transpose(1, 2) for t in qkv.unbind(2))
        x = x + self.o_proj(attend(rotate(qh, rot), rotate(kh, rot), vh, cache, layer, block))
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
        input_ids, positions, block = block_queries(input_ids, position_ids, cache, write)
        x = self.embed(input_ids)
        rot = rotary(positions, self.config.hidden_size // self.config.num_attention_heads, self.config.rope_theta,
                     x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rot, cache, i, block)
        logits = self.lm_head(_rms(x, self.norm, self.config.rms_norm_eps))
        return DiffusionLMOutput(logits=logits if block is None else block.unpack(logits))
