"""DScale block-diffusion drafter (DFlash when `config.fusion == "shared"`).

The drafter is a stack of Qwen3-style decoder layers with no embedding and no LM head of its own: it
embeds its block with the target's table and reads logits through the target's LM head, both frozen
and never saved. Its queries are the block tokens; its keys/values are `[target context | block]`,
attended non-causally. The context is the target's hidden states at `config.target_layer_ids`:

* `fusion="layerwise"` (DScale/DFlare): draft layer d reads `f_d = hidden_norm(Σ_t softmax(w_d)_t h_t)`
  and projects it with its own `k_proj_target`/`v_proj_target`;
* `fusion="shared"` (DFlash): every layer reads `hidden_norm(fc(concat_t h_t))` through its own
  `k_proj`/`v_proj`.

Shapes use B batch, Q block tokens, S new context tokens, C cached context tokens, T taps, H hidden.
This file is self-contained (it is shipped as remote code by `save_pretrained`); eager attention stays
here as the readable specification.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from .compat import reserve
from .configuration_dscale import DScaleConfig


class DScaleRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DScaleRotary(nn.Module):
    """RoPE of the drafter: plain (`rope_theta`), or a scaled type from `config.rope_parameters` computed by
    transformers' own `ROPE_INIT_FUNCTIONS`, whose `attention_scaling` multiplies cos/sin as in the targets.

    "dynamic" (NTK) recomputes the frequencies for each call whose positions pass `max_position_embeddings`
    (for the largest position of the call, block and context alike), as a fresh transformers rotary would;
    context keys cached by earlier calls keep the frequencies they were rotated with, as in transformers' caches.
    """

    def __init__(self, config: DScaleConfig):
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.rope = dict(config.rope_parameters) if config.rope_parameters else None
        self.max_positions = config.max_position_embeddings
        self._shape = (config.hidden_size, config.num_attention_heads)
        inv_freq, self.attention_scaling = self._compute()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def rope_type(self) -> str:
        return "default" if self.rope is None else self.rope["rope_type"]

    def _compute(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        if self.rope is None:
            return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)), 1.0
        from transformers import PretrainedConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        # A throwaway config: the init functions standardise (and so edit) the rope dict of what they are given.
        rope_config = PretrainedConfig()
        rope_config.hidden_size, rope_config.num_attention_heads = self._shape
        rope_config.head_dim, rope_config.max_position_embeddings = self.head_dim, self.max_positions
        rope_config.rope_parameters = dict(self.rope, rope_theta=self.theta)
        kwargs = {} if seq_len is None else {"seq_len": seq_len}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](rope_config, None, **kwargs)  # (config, device) in 5.x
        return inv_freq.float(), float(scaling)

    def frequencies(self) -> torch.Tensor:
        """inv_freq [head_dim / 2] at the configured length (rebuilt by `_init_weights` after meta loading)."""
        return self._compute()[0]

    def seq_len(self, *position_ids: torch.Tensor) -> int | None:
        """For "dynamic" RoPE, the length that the positions of one forward need (None otherwise, no sync)."""
        if self.rope_type != "dynamic":
            return None
        return max((int(p.max()) + 1 for p in position_ids if p.numel()), default=None)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype,
                seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, L] -> cos, sin [B, 1, L, head_dim]."""
        inv_freq = self.inv_freq
        if seq_len is not None and seq_len > self.max_positions:
            inv_freq = self._compute(seq_len)[0]
        freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, d]; cos/sin [B, 1, L, d]."""
    return x * cos + _rotate_half(x) * sin


def _rows(x: torch.Tensor, r: int) -> torch.Tensor:
    """x [B, ...] for r block rows: as is (B = r), shared (B = 1), or each context row for r / B consecutive block
    rows (D²SD re-drafts every context row from several boundaries)."""
    if x.shape[0] == r:
        return x
    if x.shape[0] == 1:
        return x.expand(r, *x.shape[1:])
    return x.repeat_interleave(r // x.shape[0], dim=0)


def _join(context: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """[context | block] along the sequence, the context's rows spread over the block's (`_rows`)."""
    return torch.cat((_rows(context, block.shape[0]), block), dim=-2)


class DraftContextCache:
    """Per-layer K/V of the context tokens only (block K/V are recomputed every call).

    Keys are stored after `k_norm` and RoPE: `keys[layer]` [B, kv_heads, C, head_dim], a view of a buffer allocated
    ahead for `capacity` positions (reallocated at twice the size when it fills up). A call writes the new context
    after the old and the block after that, in place: the block's entries are overwritten by the next context.
    """

    def __init__(self, num_layers: int, capacity: int = 0):
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.buffers: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def extend(self, layer: int, kc, vc, kb, vb) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new context K/V (kc, vc); return [all context | block] keys and values."""
        start = 0 if self.keys[layer] is None else self.keys[layer].shape[-2]
        end = start + kc.shape[-2]
        spread = kb.shape[0] != kc.shape[0]  # one context row serves several block rows (`_rows`): joined
        kbuf, vbuf = self.buffers[layer] = reserve(self.buffers[layer], (self.keys[layer], self.values[layer]),
                                                   (kc, vc), end + (0 if spread else kb.shape[-2]), self.capacity)
        kbuf[:, :, start:end], vbuf[:, :, start:end] = kc, vc
        self.keys[layer], self.values[layer] = kbuf[:, :, :end], vbuf[:, :, :end]
        if spread:
            return _join(self.keys[layer], kb), _join(self.values[layer], vb)
        stop = end + kb.shape[-2]
        kbuf[:, :, end:stop], vbuf[:, :, end:stop] = kb, vb
        return kbuf[:, :, :stop], vbuf[:, :, :stop]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]

    def crop(self, columns: int) -> None:
        """Drop the last `columns` context positions (the next context is written over them)."""
        if columns:
            self.keys = [None if k is None else k[:, :, : k.shape[-2] - columns] for k in self.keys]
            self.values = [None if v is None else v[:, :, : v.shape[-2] - columns] for v in self.values]


class _TransformersCache:
    """Adapter for the cache of transformers' built-in DFlash generator, which keeps context *and* block
    K/V and crops the block itself before the next call."""

    def __init__(self, cache):
        self.cache = cache

    def extend(self, layer: int, kc, vc, kb, vb) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(torch.cat((kc, kb), dim=-2), torch.cat((vc, vb), dim=-2), layer)


class DScaleAttention(nn.Module):
    def __init__(self, config: DScaleConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.window = config.window(layer_idx)  # None: full attention
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        h, qd, kvd = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, qd, bias=False)
        self.k_proj = nn.Linear(h, kvd, bias=False)
        self.v_proj = nn.Linear(h, kvd, bias=False)
        self.o_proj = nn.Linear(qd, h, bias=False)
        self.q_norm = DScaleRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DScaleRMSNorm(self.head_dim, config.rms_norm_eps)
        if config.fusion == "layerwise":
            self.k_proj_target = nn.Linear(h, kvd, bias=False)
            self.v_proj_target = nn.Linear(h, kvd, bias=False)
        else:  # DFlash: the context shares the block's projections
            self.k_proj_target = self.v_proj_target = None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def forward(
        self,
        hidden: torch.Tensor,  # [B, Q, H] block stream
        context: torch.Tensor,  # [B, S, H] fused context of this layer (S may be 0)
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        cache: DraftContextCache | None,
        attention_mask: torch.Tensor | None,  # [B, 1, Q, C + Q] bool, True = attend
        positions: tuple[torch.Tensor, torch.Tensor] | None = None,  # the block's [B, Q] and new context's [B, S]
    ) -> torch.Tensor:
        q = apply_rope(self.q_norm(self._heads(self.q_proj(hidden), self.num_heads)), *block_rope)
        kb = apply_rope(self.k_norm(self._heads(self.k_proj(hidden), self.num_kv_heads)), *block_rope)
        vb = self._heads(self.v_proj(hidden), self.num_kv_heads)
        k_proj = self.k_proj_target or self.k_proj
        v_proj = self.v_proj_target or self.v_proj
        kc = apply_rope(self.k_norm(self._heads(k_proj(context), self.num_kv_heads)), *context_rope)
        vc = self._heads(v_proj(context), self.num_kv_heads)
        if cache is not None:
            k, v = cache.extend(self.layer_idx, kc, vc, kb, vb)
        else:
            k, v = _join(kc, kb), _join(vc, vb)
        if self.window is not None:
            attention_mask = windowed(attention_mask, *positions, k.shape[-2], self.window)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))


def windowed(mask: torch.Tensor | None, positions: torch.Tensor, context_positions: torch.Tensor, keys: int,
             window: int) -> torch.Tensor:
    """A sliding layer's mask [B, 1, Q, C + Q]: `mask` (None: every key) and, as z-lab's drafter attends with
    flash attention's window (w - 1 positions on each side), only the keys less than `window` positions from the
    query. The block's queries and last Q keys are at `positions` [B, Q]. The C context keys before them are at
    their columns' positions: where `mask` has holes, each row's count of valid columns before the column; else
    the new context's `context_positions` [B, S] for the last S columns, and the column index before them."""
    b, q = positions.shape
    c = keys - q
    if mask is not None:
        context = mask[:, 0, 0, :c].expand(b, -1).long().cumsum(-1) - 1
    else:
        s = context_positions.shape[1]
        earlier = torch.arange(c - s, device=positions.device).expand(b, -1)
        context = torch.cat((earlier, context_positions.expand(b, -1)), dim=1)
    key_pos = torch.cat((context, positions), dim=1)  # [B, C + Q]
    near = (positions[:, :, None] - key_pos[:, None, :]).abs() < window  # [B, Q, C + Q]
    return near[:, None] if mask is None else mask & near[:, None]


class DScaleMLP(nn.Module):
    def __init__(self, config: DScaleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DScaleDecoderLayer(nn.Module):
    def __init__(self, config: DScaleConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DScaleAttention(config, layer_idx)
        self.mlp = DScaleMLP(config)
        self.input_layernorm = DScaleRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DScaleRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, context, block_rope, context_rope, cache, attention_mask, positions=None):
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), context, block_rope, context_rope, cache, attention_mask, positions
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class _TargetHandle:
    """What the drafter borrows from its target: embedding, LM head, and the target itself.

    A plain object (not an `nn.Module` attribute) so the borrowed weights are never saved or trained.
    """

    def __init__(self, target: nn.Module):
        self.target = target
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()


class DraftVocab:
    """The tokens a drafter may propose in one generation: its `draft_vocab` plus every token of the sequences.

    The drafter reads logits through the target's LM head. Over a few thousand rows that head is far
    cheaper than over the whole vocabulary (SmolLM2 on a 2-core CPU, 15 positions: 1.7 ms for 8,192
    rows, 13.7 ms for all 49,152, whose weights do not stay in cache). Tokens outside the set get logit
    -inf. That changes what is proposed, never what is accepted: the target verifies with its whole
    distribution, and speculative sampling is lossless for any proposal distribution. The sequences'
    own tokens are added because what a frequency list misses is mostly what a text repeats (names,
    identifiers), which drafters predict well.
    """

    def __init__(self, head: nn.Linear, tokens: torch.Tensor, vocab_size: int):
        weight = head.weight
        self.vocab_size, self.size = vocab_size, 0
        self.known: set[int] = set()  # the ids in the set, on the host: adding tokens reads nothing from the device
        self._head = head
        self._ids = torch.empty(0, dtype=torch.long, device=weight.device)
        self._weight = weight.new_empty(0, weight.shape[1])
        self._bias = None if head.bias is None else head.bias.new_empty(0)
        self.add(tokens)

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[: self.size]

    @torch.no_grad()
    def add(self, tokens: torch.Tensor | list[int]) -> None:
        """Let the drafter propose `tokens` (a tensor of any shape, read once, or a list of ids; ids outside the
        vocabulary, such as -1 padding, are ignored)."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        fresh = sorted({t for t in tokens if 0 <= t < self.vocab_size} - self.known)
        if not fresh:
            return
        self.known.update(fresh)
        new = torch.tensor(fresh, dtype=torch.long, device=self._ids.device)
        end = self.size + len(fresh)
        if end > self._ids.numel():  # grow with room for the tokens a generation adds, copying rarely
            extra = end + 512 - self.size

            def grow(t: torch.Tensor) -> torch.Tensor:
                return torch.cat((t[: self.size], t.new_empty(extra, *t.shape[1:])))

            self._ids, self._weight = grow(self._ids), grow(self._weight)
            if self._bias is not None:
                self._bias = grow(self._bias)
        self._ids[self.size : end] = new
        self._weight[self.size : end] = self._head.weight[new]
        if self._bias is not None:
            self._bias[self.size : end] = self._head.bias[new]
        self.size = end

    def compact_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`head(hidden)` over the set only: [..., size], column j for token `ids[j]`.

        Enough for a greedy proposal and its confidence: over the rest of the vocabulary the logits are -inf, so
        the argmax and the softmax's values on the set are the same. The product is one 2-D matmul (a 3-D input
        would run as a batched matmul, several times slower on a CPU).
        """
        bias = None if self._bias is None else self._bias[: self.size]
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self._weight.dtype)
        return F.linear(flat, self._weight[: self.size], bias).view(*hidden.shape[:-1], self.size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`head(hidden)` over the set, -inf elsewhere: [..., vocab_size]."""
        return self.spread(self.compact_logits(hidden))

    def spread(self, part: torch.Tensor) -> torch.Tensor:
        """Compact logits [..., size] (column j for token `ids[j]`) over the whole vocabulary, -inf elsewhere."""
        out = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids[: part.shape[-1]], part)


class DScalePreTrainedModel(PreTrainedModel):
    config_class = DScaleConfig
    base_model_prefix = ""
    _no_split_modules = ["DScaleDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DScaleRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, DScaleRotary):  # a non-persistent buffer: rebuilt after meta-device loading
            module.inv_freq.copy_(module.frequencies())
        elif isinstance(module, DScaleDrafter) and module.layer_fusion_weights is not None:
            module.reset_fusion_weights()


class DScaleDrafter(DScalePreTrainedModel):
    """Block-diffusion drafter; see the module docstring.

    Attach it to a target with `bind_target(target)` (done automatically when it is passed as
    `assistant_model=` to `target.generate`), then `draft_logits(...)` proposes a block.
    """

    def __init__(self, config: DScaleConfig):
        super().__init__(config)
        config.validate()
        d, t, h = config.num_hidden_layers, config.num_taps, config.hidden_size
        self.layers = nn.ModuleList(DScaleDecoderLayer(config, i) for i in range(d))
        self.norm = DScaleRMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = DScaleRMSNorm(h, config.rms_norm_eps)
        self.rotary = DScaleRotary(config)
        if config.fusion == "layerwise":
            self.fc = None
            self.layer_fusion_weights = nn.Parameter(torch.zeros(d, t))
        else:
            self.fc = nn.Linear(t * h, h, bias=False)
            self.layer_fusion_weights = None
        size = config.draft_vocab_size
        self.register_buffer("draft_vocab", None if size is None else torch.zeros(size, dtype=torch.long))
        self._handle: _TargetHandle | None = None
        self._assist = None  # state of the plain `assistant_model=` protocol, see assistant.py
        # How much of each block `generate(assistant_model=drafter)` proposes: "auto" = the head with the most
        # tokens expected per second of verify, a number = the head whose cumulative confidence is at least
        # it, 0 = all of it; None = "auto" on a CPU (where wide verifies cost more), 0 elsewhere.
        self.draft_confidence: float | str | None = None
        # A measured plan (`hf_dscale.engine.calibrate`) whose cut the assistant uses instead of measuring its own.
        self.plan = None
        self.post_init()
        self.generation_config = GenerationConfig(
            num_assistant_tokens=config.block_size - 1,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )

    def reset_fusion_weights(self) -> None:
        """All logits 0 except a 'home' tap per draft layer at 2.0, leaning shallow→deep (DFlare init)."""
        d, t = self.layer_fusion_weights.shape
        with torch.no_grad():
            self.layer_fusion_weights.zero_()
            for i in range(d):
                self.layer_fusion_weights[i, min(t - 1, (i * t) // d)] = 2.0

    # ----------------------------------------------------------------------------------------- target
    def bind_target(self, target: nn.Module) -> "DScaleDrafter":
        """Check that `target` fits this drafter and borrow its embedding and LM head.

        Raises ValueError naming the mismatch (hidden size, vocabulary, depth, mask token).
        """
        cfg = self.config
        text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        embed = target.get_input_embeddings()
        head = target.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"{type(target).__name__} has no input embeddings or LM head; use a *ForCausalLM class.")
        if text.hidden_size != cfg.hidden_size:
            raise ValueError(
                f"Drafter hidden_size {cfg.hidden_size} != target hidden_size {text.hidden_size}: this drafter was "
                "trained for another target."
            )
        if embed.weight.shape[1] != cfg.hidden_size or head.weight.shape[1] != cfg.hidden_size:
            raise ValueError(
                f"{type(target).__name__}'s token embeddings are {embed.weight.shape[1]} wide and its LM head reads "
                f"{head.weight.shape[1]}, not its hidden size {cfg.hidden_size} (a projected embedding, as in "
                "ELECTRA): the drafter embeds its block with the target's table and reads it with the target's head, "
                "so both must be hidden-size wide."
            )
        if embed.weight.shape[0] != cfg.vocab_size or head.weight.shape[0] != cfg.vocab_size:
            raise ValueError(
                f"Drafter vocab_size {cfg.vocab_size} != target vocabulary {embed.weight.shape[0]}: this drafter "
                "was trained for another target."
            )
        depth = len(tap_layers(target))  # raises for unsupported model classes
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < depth - 1]
        if bad:
            raise ValueError(f"target_layer_ids {bad} do not exist in a {depth}-layer target (valid: 0..{depth - 2}).")
        if not 0 <= cfg.mask_token_id < embed.weight.shape[0]:
            raise ValueError(f"mask_token_id {cfg.mask_token_id} is not a row of the target's embedding table.")
        self._handle = _TargetHandle(target)
        return self

    @property
    def target(self) -> nn.Module | None:
        return None if self._handle is None else self._handle.target

    def _require_target(self) -> _TargetHandle:
        if self._handle is None:
            raise RuntimeError("The drafter is not bound to a target: call drafter.bind_target(target) first.")
        return self._handle

    # ------------------------------------------------------------------------------------ draft vocab
    def set_draft_vocab(self, tokens: torch.Tensor | list[int] | None) -> None:
        """Propose only `tokens` (target ids, e.g. the most frequent in the training data) plus, in each
        generation, the tokens of its own sequences; None proposes from the whole vocabulary again.

        Saved with the weights (buffer `draft_vocab`, `config.draft_vocab_size`; in the upstream layouts, as
        `draft_vocab.safetensors` beside them, see `convert.py`). See `DraftVocab`.
        """
        if tokens is None:
            self.draft_vocab, self.config.draft_vocab_size = None, None
            return
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        vocab = self.config.vocab_size
        if not tokens.numel() or int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise ValueError(f"draft_vocab needs at least one token id, all in [0, {vocab}).")
        if tokens.unique().numel() != tokens.numel():
            raise ValueError("draft_vocab has repeated token ids.")
        self.draft_vocab = tokens.to(self.norm.weight.device)
        self.config.draft_vocab_size = tokens.numel()

    def draft_vocab_for(self, context_ids: torch.Tensor | None = None) -> DraftVocab | None:
        """The proposal set for one generation whose sequences start with `context_ids`; None when the drafter
        proposes from the whole vocabulary (no `draft_vocab`, or a target LM head that is not a plain Linear)."""
        head = self._require_target().lm_head
        if self.draft_vocab is None or not isinstance(head, nn.Linear):
            return None
        vocab = DraftVocab(head, self.draft_vocab, self.config.vocab_size)
        if context_ids is not None:
            vocab.add(context_ids)
        return vocab

    # ---------------------------------------------------------------------------------------- forward
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, S, T, H] -> layerwise: [B, S, D, H]; shared: [B, S, H]."""
        taps = taps.to(self.norm.weight.dtype)
        if self.fc is not None:
            return self.hidden_norm(self.fc(taps.flatten(-2)))
        mix = torch.softmax(self.layer_fusion_weights.float(), dim=-1).to(taps.dtype)  # [D, T]
        return self.hidden_norm(torch.einsum("bsth,dt->bsdh", taps, mix))

    def forward(
        self,
        block_embeds: torch.Tensor | None = None,  # [B, Q, H]
        taps: torch.Tensor | None = None,  # [B, S, T, H] target hidden states of the new context tokens
        block_position_ids: torch.Tensor | None = None,  # [B, Q]
        context_position_ids: torch.Tensor | None = None,  # [B, S]
        cache: DraftContextCache | None = None,
        attention_mask: torch.Tensor | None = None,  # [B, 1, Q, C + Q] bool, True = attend
        **native,
    ) -> torch.Tensor:
        """Returns the final-normed block hidden states [B, Q, H] (apply the target LM head for logits).

        transformers' built-in DFlash generator (`speculation_type="dflash"`) calls with its own names
        (`noise_embeds`, `context_hidden_states`, `position_ids`, `cache`/`past_key_values`); see
        `_native_forward`.
        """
        if "noise_embeds" in native:
            return self._native_forward(cache=cache, **native)
        fused = self.fuse(taps)
        hidden = block_embeds.to(self.norm.weight.dtype)
        seq_len = self.rotary.seq_len(block_position_ids, context_position_ids)
        block_rope = self.rotary(block_position_ids, hidden.dtype, seq_len)
        context_rope = self.rotary(context_position_ids, hidden.dtype, seq_len)
        for i, layer in enumerate(self.layers):
            context = fused if self.fc is not None else fused[:, :, i]
            hidden = layer(hidden, context, block_rope, context_rope, cache, attention_mask,
                           (block_position_ids, context_position_ids))
        return self.norm(hidden)

    def _native_forward(self, noise_embeds, context_hidden_states, position_ids, cache=None,
                        past_key_values=None, **unused):
        from transformers.modeling_outputs import BaseModelOutput

        from .compat import native_dflash_reads_layer_outputs

        if not native_dflash_reads_layer_outputs():
            raise ValueError(
                "This transformers release's built-in DFlash generator passes hidden_states[i] (the output of layer "
                "i-1) for target layer i, one layer off from what this drafter was trained on. Use "
                "`target.generate(..., assistant_model=drafter)` without speculation_type (same output, right "
                "taps), or transformers >= 5.23."
            )
        b, s, _ = context_hidden_states.shape
        taps = context_hidden_states.view(b, s, self.config.num_taps, self.config.hidden_size)
        hf_cache = cache if cache is not None else past_key_values
        hidden = self(noise_embeds, taps, position_ids[:, s:], position_ids[:, :s],
                      None if hf_cache is None else _TransformersCache(hf_cache))
        return BaseModelOutput(last_hidden_state=hidden)

    def draft_logits(
        self,
        anchor_ids: torch.Tensor,  # [B, 1] last committed token of each row
        taps: torch.Tensor,  # [B, S, T, H]
        anchor_positions: torch.Tensor,  # [B] absolute position of each anchor
        context_position_ids: torch.Tensor,  # [B, S]
        cache: DraftContextCache | None,
        context_valid: torch.Tensor | None = None,  # [B, C] bool over all cached context columns
        vocab: DraftVocab | None = None,
        compact: bool = False,
    ) -> torch.Tensor:
        """Propose one block: logits [B, γ-1, V] for the γ-1 tokens after each anchor (see `block_logits`)."""
        b, gamma = anchor_ids.shape[0], self.config.block_size
        block = anchor_ids.new_full((b, gamma), self.config.mask_token_id)
        block[:, :1] = anchor_ids
        return self.block_logits(block, anchor_positions, taps, context_position_ids, cache, context_valid, vocab,
                                 compact)

    def block_logits(
        self,
        block_ids: torch.Tensor,  # [R, γ]: anchor, then known tokens or mask_token_id
        anchor_positions: torch.Tensor,  # [R] (or [1], shared)
        taps: torch.Tensor,  # [B, S, T, H] with B = R, or B = 1 for a context shared by all rows
        context_position_ids: torch.Tensor,  # [B, S]
        cache: DraftContextCache | None,
        context_valid: torch.Tensor | None = None,  # [B, C] bool over all cached context columns
        vocab: DraftVocab | None = None,  # from `draft_vocab_for`; None = the whole vocabulary
        compact: bool = False,
    ) -> torch.Tensor:
        """Logits [R, γ-1, V] at block positions 1..γ-1 (-inf for tokens outside `vocab`); with `compact` and a
        `vocab`, over its tokens only, [R, γ-1, len(vocab.ids)] (`DraftVocab.compact_logits`).

        A variable-prefix drafter reads rows like `[anchor, t_1..t_i, mask, ...]` and fills the rest; a context of B
        rows serves R = m·B block rows, m consecutive rows per context row, its K/V computed once.
        """
        handle = self._require_target()
        r, gamma = block_ids.shape
        positions = _rows(anchor_positions.reshape(-1, 1) + torch.arange(gamma, device=block_ids.device), r)
        mask = None
        if context_valid is not None:
            ones = context_valid.new_ones(context_valid.shape[0], gamma)
            mask = _rows(torch.cat((context_valid, ones), dim=1)[:, None, None, :], r).expand(r, 1, gamma, -1)
        hidden = self(handle.embed(block_ids), taps, positions, context_position_ids, cache, mask)
        hidden = hidden[:, 1:].to(handle.lm_head.weight.dtype)
        if vocab is None:
            return handle.lm_head(hidden)
        return vocab.compact_logits(hidden) if compact else vocab.logits(hidden)

    # ------------------------------------------------------------------ plain `assistant_model=` path
    def generate(self, input_ids: torch.Tensor, **kwargs):
        """The assistant side of `target.generate(..., assistant_model=drafter)`.

        transformers calls this with the token ids only; the drafter finds the target that called it,
        reads the target's hidden states through forward hooks on the tapped layers, and returns a
        block of candidates. See `assistant.py`.
        """
        from .assistant import assistant_generate

        return assistant_generate(self, input_ids, **kwargs)

    def _supports_logits_to_keep(self) -> bool:  # read by AssistedCandidateGenerator
        return False

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a drafter from a folder or a Hub id (`revision`, `cache_dir`, `local_files_only`, `token`,
        `subfolder` as in transformers; `HF_HUB_OFFLINE` is honoured), in any layout of `convert.py`: native,
        z-lab DFlash, AngelSlim DFlare or transformers' DFlash assistant, detected from the weight names.

        Loading is strict: missing or unexpected weights raise a ValueError, and so does a folder holding
        something else (an EAGLE or Medusa head, a causal LM, a config without weights, weights without a config).
        """
        from .convert import detect_layout, load_reference_checkpoint, resolve_folder, split_hub_kwargs

        hub, rest = split_hub_kwargs(kwargs)
        path = resolve_folder(pretrained_model_name_or_path, **hub)
        layout = detect_layout(path)
        if layout != "native":
            return load_reference_checkpoint(cls, path, layout=layout, **rest)
        want_info = rest.pop("output_loading_info", False)
        model, info = super().from_pretrained(path, *args, output_loading_info=True, **rest)
        problems = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(problems.values()):
            raise ValueError(
                f"{path} does not match the drafter its config.json describes: "
                + ", ".join(f"{k.replace('_', ' ')} {v[:6]}" for k, v in problems.items() if v)
                + ". Save the drafter again with save_pretrained, or fix config.json (e.g. draft_vocab_size, fusion)."
            )
        return (model, info) if want_info else model


def tap_layers(target: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM whose outputs the drafter taps, wherever the model keeps them
    (`model.layers` for Llama-style classes, `transformer.h` for GPT-2-style ones, ...): the decoder's `layers`
    where it has them, else the one ModuleList in the model as long as its config's depth. Raises ValueError naming
    the class and what is missing."""
    name = type(target).__name__
    decoder = target.get_decoder() if callable(getattr(target, "get_decoder", None)) else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    depth = getattr(text, "decoder_layers", None) or getattr(text, "num_hidden_layers", None)
    found = [m for m in target.modules() if isinstance(m, nn.ModuleList) and len(m) == depth] if depth else []
    if len(found) != 1:
        raise ValueError(
            f"Unsupported target class {name}: hf_dscale taps the outputs of its decoder blocks, but found "
            f"{len(found)} lists of {depth} blocks in it (none under get_decoder().layers); supported are "
            "decoder-only causal LMs with one list of blocks (`model.layers`, `transformer.h`, ...)."
        )
    return found[0]


__all__ = ["DScaleDrafter", "DScalePreTrainedModel", "DraftContextCache", "DraftVocab", "tap_layers"]
