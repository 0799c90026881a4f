"""The cascade tree attention as a transformers attention implementation, `"hf_dscale_tree"`.

Registered through transformers' public `AttentionInterface` / `AttentionMaskInterface` (no patching).
A call whose 4D mask shows the same prefix visibility for every query (a D²SD tree, or any chunk
appended after a cache) runs `tree_attention`: the keys before the last N are the prefix, the last N
the block with the mask's block part. Everything else (prefill without a cache, single-token steps,
sliding windows, attention sinks, soft-capping) goes to transformers' SDPA function unchanged.
"""

from __future__ import annotations

import torch

from ..kernels.tree_attention import tree_attention
from ..models.dscale import compat

NAME = "hf_dscale_tree"


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask == 0


def tree_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, Hq, N, D]; key/value [B, Hkv, C + N, D]; attention_mask [B, 1, N, >= C + N] or None."""
    n, length = query.shape[2], key.shape[2]
    plain = (
        attention_mask is None or attention_mask.dim() != 4 or n == 1 or length < n or dropout
        or kwargs.get("sliding_window") is not None or kwargs.get("s_aux") is not None
        or kwargs.get("softcap") is not None
    )
    if not plain:
        allowed = _allowed(attention_mask[:, 0, :, :length])
        prefix = allowed[:, :, : length - n]
        plain = not bool((prefix == prefix[:, :1]).all())
    if plain:
        return compat.sdpa_attention()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       **kwargs)
    c = length - n
    out = tree_attention(query, key[:, :, :c], value[:, :, :c], key[:, :, c:], value[:, :, c:], allowed[:, :, c:],
                         scaling, prefix_valid=allowed[:, 0, :c])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register `"hf_dscale_tree"` with transformers (idempotent) and return the name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, tree_attention_forward)
    AttentionMaskInterface.register(NAME, compat.sdpa_mask())
    return NAME
