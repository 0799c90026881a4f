"""A verify forward that runs a Llama-family target's own weights layer by layer, without transformers' modules.

On a small CPU an eager verify spends much of its time outside the arithmetic: SmolLM2-135M's forward is 30 decoder
layers of module calls, keyword plumbing, mask preparation and cache bookkeeping, about 2,600 torch calls around
matrix products that take 26-37 ms at 1-16 tokens. `DirectForward` computes the same forward from the same
parameters in one loop over the layers. With the CPU kernel (`kernels/cpu_linear.py`) every step of a layer runs in
the kernel's library, eight calls a layer: the RMS norm, q, k and v in one pass, the per-head norms and rotary
embedding in place, attention over the cache with the engine's mask, o_proj adding into the residual stream, the
second norm, gate and up in one pass, SiLU(gate) * up, and down_proj adding into the stream. With torch's products
the same loop runs torch's ops (RMS norm, the target's rotary embedding and activation, scaled-dot-product
attention). The keys and values go into the same cache (`cache.update`), so a verify may take either forward.

Measured ad hoc on a 2-core Xeon (SmolLM2, a 300-token cache, the median of 9 interleaved runs): a verify of 1, 8
and 16 tokens took 42.9, 80.5 and 87.0 ms through the model with torch's products, 46.8, 61.2 and 73.0 ms with the
kernel's, and 32.4, 39.5 and 49.5 ms direct with the kernel.

Which targets it takes is decided by what they are and do, not by name: the decoder must be built of the modules a
Llama-style layer holds (attention projections, optional per-head query/key norms as in Qwen3, a gated MLP, two
RMS norms, nothing else), float32, and a probe must show the direct forward's logits equal to the target's own on
a short input (`unavailable`). Anything else (Gemma's extra norms, Phi-3's fused projections, other dtypes) keeps
the target's own forward. Whether a verify of a given width runs it is measured by the engine's `calibrate`
(`Plan.direct_widths`). Its sums run in another order than torch's, as the kernel's products already do, so greedy
decoding stays identical to plain `generate()` on the same terms (the benches and tests check it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_linear
from .masks import ALL_LAYERS, TargetAttention

_BASE_PARTS = {"embed_tokens", "layers", "norm", "rotary_emb"}
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_ATTENTION_PARTS = {*_ATTENTION_LINEARS, "q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _children(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


def _norm_eps(norm: nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _structure(target: nn.Module) -> str | None:
    """Why `target` is not built as `DirectForward` reads it (None: it is)."""
    base = getattr(target, "base_model", None)
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if base is None or base is target or not isinstance(head, nn.Linear):
        return f"{type(target).__name__} is not a base model under an nn.Linear LM head"
    if _children(base) != _BASE_PARTS or not isinstance(base.embed_tokens, nn.Embedding):
        return f"{type(base).__name__} holds {sorted(_children(base))}, not {sorted(_BASE_PARTS)}"
    if not any(p.dtype == torch.float32 for p in target.parameters()) or \
            any(p.dtype != torch.float32 for p in target.parameters()):
        return f"the direct forward runs float32 targets; this one is {next(target.parameters()).dtype}"
    for layer in base.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if _children(layer) != _LAYER_PARTS or attention is None or mlp is None:
            return f"a {type(layer).__name__} holds {sorted(_children(layer))}, not {sorted(_LAYER_PARTS)}"
        if not _children(attention) >= set(_ATTENTION_LINEARS) or not _children(attention) <= _ATTENTION_PARTS:
            return f"a {type(attention).__name__} holds {sorted(_children(attention))}, not the four projections " \
                   "(and per-head norms)"
        if _children(mlp) != _MLP_PARTS:
            return f"a {type(mlp).__name__} holds {sorted(_children(mlp))}, not a gated MLP's {sorted(_MLP_PARTS)}"
        linears = [getattr(attention, n) for n in _ATTENTION_LINEARS] + [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(type(m) is nn.Linear for m in linears):
            return "some projection is not a plain nn.Linear"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, base.norm]
        norms += [getattr(attention, n) for n in ("q_norm", "k_norm") if hasattr(attention, n)]
        if any(_norm_eps(n) is None or getattr(n, "weight", None) is None for n in norms):
            return "some norm has no weight and epsilon to read"
        if not isinstance(getattr(attention, "scaling", None), float) or not isinstance(
                getattr(attention, "head_dim", None), int):
            return f"a {type(attention).__name__} has no float `scaling` and int `head_dim`"
    return None


@torch.no_grad()
def unavailable(target: nn.Module, width: int = 5, kernel: bool = False) -> str | None:
    """Why `DirectForward` cannot run `target`'s verifies (None: it can): its structure, or a probe whose logits
    (over `width` tokens after as many cached ones, masked as the engine masks a verify, with torch's products and,
    with `kernel`, with the CPU kernel's too) differ from the target's own. An error inside the probe (a transformers
    whose modules changed) is a reason too: the caller falls back to the target's own forward."""
    try:
        return _probe(target, width, kernel)
    except Exception as error:
        return f"a probe of its forward failed ({type(error).__name__}: {str(error)[:200]})"


def _probe(target: nn.Module, width: int, kernel: bool) -> str | None:
    why = _structure(target)
    if why is not None:
        return why
    from ..models.dscale import compat

    device = target.get_output_embeddings().weight.device
    ids = torch.arange(3, 3 + 2 * width, device=device)[None] % target.get_output_embeddings().weight.shape[0]
    positions = torch.arange(2 * width, device=device)[None]
    own_cache = compat.position_cache(2 * width)
    target(input_ids=ids[:, :width], position_ids=positions[:, :width], use_cache=True,
           **compat.cache_kwargs(target, own_cache))
    mask = torch.ones(1, 2 * width, dtype=torch.long, device=device)
    attention = TargetAttention.of(target)
    if attention.sliding:  # such a target's verifies get 4D masks by position (`engine/masks.py`)
        mask = attention.after_cache(mask[:, :width].bool(), positions[:, width:],
                                     torch.ones(width, width, dtype=torch.bool, device=device).tril(), target.dtype)
    new = dict(input_ids=ids[:, width:], position_ids=positions[:, width:])
    own = target(**new, attention_mask=mask, use_cache=True, **compat.cache_kwargs(target, own_cache)).logits
    scale = own.abs().max().clamp_min(1.0)
    for products in (False, True) if kernel else (False,):
        cache = compat.position_cache(2 * width)
        target(input_ids=ids[:, :width], position_ids=positions[:, :width], use_cache=True,
               **compat.cache_kwargs(target, cache))
        direct, _ = DirectForward(target)(**new, attention_mask=mask, cache=cache, kernel=products)
        error = ((direct - own).abs().max() / scale).item()
        if not error <= 1e-4:
            return (f"a probe of its forward{' with the CPU kernel' if products else ''} differs from "
                    f"{type(target).__name__}'s own (relative error {error:.2g})")
    return None


class _Layer:
    """One decoder layer's parameters, read once: norms as (weight, eps), projections as (weight, bias)."""

    def __init__(self, layer: nn.Module, kind: str | None):
        attention, mlp = layer.self_attn, layer.mlp
        self.kind, self.head_dim, self.scaling = kind, attention.head_dim, attention.scaling
        self.norms = [(n.weight, _norm_eps(n)) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        head_norms = [getattr(attention, n, None) for n in ("q_norm", "k_norm")]
        self.head_norms = [None if n is None else (n.weight, _norm_eps(n)) for n in head_norms]
        self.qkv = [(m.weight, m.bias) for m in (attention.q_proj, attention.k_proj, attention.v_proj)]
        self.qkv_sizes = [w.shape[0] for w, _ in self.qkv]
        self.o = (attention.o_proj.weight, attention.o_proj.bias)
        self.gate_up = [(m.weight, m.bias) for m in (mlp.gate_proj, mlp.up_proj)]
        self.down = (mlp.down_proj.weight, mlp.down_proj.bias)
        self.act = mlp.act_fn


def _products(x: torch.Tensor, linears, kernel: bool) -> torch.Tensor:
    """The products of x with each (weight, bias), side by side in the last dimension."""
    if kernel:
        return cpu_linear._run_many(x, [w for w, _ in linears], [b for _, b in linears])
    outs = [F.linear(x, w, b) for w, b in linears]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class DirectForward:
    """`forward(input_ids, attention_mask, position_ids, cache, ...)` -> (logits [B, T, V], taps [B, T, L, H] or
    None) for a target `unavailable` accepts, computed from its parameters directly.

    `attention_mask`: a 2D padding mask over the cache's columns and the new tokens (the new tokens then attend
    causally), or the 4D additive masks `engine/masks.py` builds (one tensor, or one per `config.layer_types`
    kind). `cache`: a `DynamicCache` the new keys and values are appended to (`cache.update`), or None (the tokens
    see only each other). `kernel`: the products by `cpu_linear` (a layer's q, k and v in one pass, its gate and up
    in another; torch's where some weight is not laid out as contiguous rows), else `F.linear`; `transposed`: the LM
    head in `target_forward.apply_head`'s transposed layout (torch's products only). `tap_ids`: the layers whose
    outputs come back as taps, as the engine's `TapRecorder` records them.
    """

    def __init__(self, target: nn.Module):
        self.target = target
        self.base = target.base_model
        self.head = target.get_output_embeddings()
        config = target.config.get_text_config(decoder=True) if hasattr(target.config, "get_text_config") \
            else target.config
        kinds = getattr(config, "layer_types", None) or [None] * len(self.base.layers)
        self.layers = [_Layer(layer, kind) for layer, kind in zip(self.base.layers, kinds)]
        self.hidden = self.base.embed_tokens.embedding_dim
        self.final_norm = (self.base.norm.weight, _norm_eps(self.base.norm))
        # the kernel reads weights as rows in memory: where one is laid out otherwise, torch's products run
        self.kernel_reads = all(p.is_contiguous() for p in target.parameters())
        probe = torch.linspace(-8, 8, 33, dtype=torch.float32, device=self.head.weight.device)
        # the whole layer in the kernel's library where its activation is SiLU and its MLP's two halves match
        self.fused = self.kernel_reads and all(torch.equal(layer.act(probe), F.silu(probe)) and
                                               layer.gate_up[0][0].shape == layer.gate_up[1][0].shape
                                               for layer in self.layers)

    @staticmethod
    def _masks(attention_mask, position_ids: torch.Tensor, s: int, dtype: torch.dtype):
        """The additive mask SDPA takes ([B, 1, Q, S + Q]) from a 2D padding mask (the new tokens attending causally,
        as `TargetAttention.after_cache` builds it for full attention), else the 4D masks given."""
        if isinstance(attention_mask, dict) or attention_mask.dim() == 4:
            return attention_mask
        q = position_ids.shape[1]
        causal = torch.ones(q, q, dtype=torch.bool, device=attention_mask.device).tril()
        full = TargetAttention({ALL_LAYERS: None})
        return full.after_cache(attention_mask[:, :s].bool(), position_ids, causal, dtype)

    def __call__(self, input_ids: torch.Tensor, attention_mask=None, position_ids: torch.Tensor | None = None,
                 cache=None, kernel: bool = False, transposed: bool = False, tap_ids=()):
        b, q = input_ids.shape
        kernel = kernel and self.kernel_reads
        s = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(s, s + q, device=input_ids.device)[None].expand(b, q)
        if attention_mask is None:
            attention_mask = torch.ones(b, s + q, dtype=torch.long, device=input_ids.device)
        x = self.base.embed_tokens(input_ids)  # [B, Q, H]
        masks = self._masks(attention_mask, position_ids, s, x.dtype)
        cos, sin = self.base.rotary_emb(x, position_ids)  # [B, Q, D] each
        cos, sin = cos[:, None], sin[:, None]
        taps, wanted = [None] * len(tap_ids), {layer: slot for slot, layer in enumerate(tap_ids)}
        if kernel and self.fused:
            logits = self._fused(x, cos, sin, masks, cache, taps, wanted)
            return logits, (torch.stack(taps, dim=2) if tap_ids else None)
        shape = (self.hidden,)
        for i, layer in enumerate(self.layers):
            mask = masks[layer.kind] if isinstance(masks, dict) else masks
            h = F.rms_norm(x, shape, *layer.norms[0])
            x = x + self._attention(layer, h, cos, sin, mask, cache, i, kernel)
            h = F.rms_norm(x, shape, *layer.norms[1])
            gate, up = _products(h, layer.gate_up, kernel).split(layer.gate_up[0][0].shape[0], dim=-1)
            x = x + _products(layer.act(gate) * up, [layer.down], kernel)
            if i in wanted:
                taps[wanted[i]] = x
        x = F.rms_norm(x, shape, *self.final_norm)
        if kernel:
            logits = cpu_linear._run(x, self.head.weight, self.head.bias)
        else:
            from .target_forward import apply_head

            logits = apply_head(self.head, x, transposed)
        return logits, (torch.stack(taps, dim=2) if tap_ids else None)

    def _fused(self, x, cos, sin, masks, cache, taps, wanted) -> torch.Tensor:
        """The layers and the head with every step in the kernel's library: the residual stream `x` is updated in
        place by the products (o_proj and down_proj add into it), q and k are normed and rotated in place."""
        b, q, hidden = x.shape
        x = x.reshape(b * q, hidden).contiguous()
        cos, sin = cos.reshape(b * q, -1).contiguous(), sin.reshape(b * q, -1).contiguous()
        for i, layer in enumerate(self.layers):
            mask = masks[layer.kind] if isinstance(masks, dict) else masks
            d, (nq, nk, _) = layer.head_dim, layer.qkv_sizes
            h = cpu_linear.rms_norm(x, *layer.norms[0])
            qkv = cpu_linear._run_many(h, [w for w, _ in layer.qkv], [bias for _, bias in layer.qkv])  # [BQ, q|k|v]
            cpu_linear.rope_(qkv, nq // d, d, cos, sin, layer.head_norms[0])
            cpu_linear.rope_(qkv[:, nq:], nk // d, d, cos, sin, layer.head_norms[1])
            key = qkv[:, nq : nq + nk].view(b, q, -1, d).transpose(1, 2)  # [B, G, Q, D]
            value = qkv[:, nq + nk :].view(b, q, -1, d).transpose(1, 2)
            key, value = cache.update(key, value, i) if cache is not None else (key, value)
            if key.stride()[2:] != (d, 1) or value.stride() != key.stride():  # rows of D floats, alike
                key, value = key.contiguous(), value.contiguous()
            if mask.stride(-1) != 1 or mask.dtype != torch.float32:
                mask = mask.float().contiguous()
            out = cpu_linear.attention(qkv[:, :nq].view(b, q, -1, d), key, value, mask, layer.scaling)
            cpu_linear._run(out.view(b * q, -1), *layer.o, into=x)
            h = cpu_linear.rms_norm(x, *layer.norms[1])
            gate_up = cpu_linear._run_many(h, [w for w, _ in layer.gate_up], [bias for _, bias in layer.gate_up])
            cpu_linear._run(cpu_linear.silu_mul(gate_up), *layer.down, into=x)
            if i in wanted:
                taps[wanted[i]] = x.view(b, q, hidden).clone()
        x = cpu_linear.rms_norm(x, *self.final_norm)
        return cpu_linear._run(x, self.head.weight, self.head.bias).view(b, q, -1)

    def _attention(self, layer: _Layer, h, cos, sin, mask, cache, index: int, kernel: bool) -> torch.Tensor:
        b, q, _ = h.shape
        d = layer.head_dim
        heads = [t.view(b, q, -1, d) for t in _products(h, layer.qkv, kernel).split(layer.qkv_sizes, dim=-1)]
        for j, norm in enumerate(layer.head_norms):  # [B, Q, heads, D] each
            if norm is not None:
                heads[j] = F.rms_norm(heads[j], (d,), *norm)
        query, key, value = (t.transpose(1, 2) for t in heads)  # [B, heads, Q, D]
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, index)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=layer.scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return _products(out.transpose(1, 2).reshape(b, q, -1), [layer.o], kernel)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as Llama applies it: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
