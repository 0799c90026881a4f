"""Verify masks for targets whose layers attend through a sliding window (Mistral, Phi-3, Gemma 2/3, Qwen2 with
`use_sliding_window`), exact with the decoders' holes and token trees.

transformers builds a sliding-window mask from *cache columns*: a query at column q sees the keys at columns
k > q - window. The decoders' caches are not contiguous sequences, though: a batch keeps the columns a row
rejected as masked holes, and a token tree puts siblings side by side. Counted in columns, the window would
shrink by the holes and reach across siblings. So for such a target the decoders build the masks themselves, from
*positions* (a row's own token count, as plain `generate()` sees it): a query at position p sees an allowed key at
position p' when p - p' < window, for each kind of layer, and hand them over as transformers takes prepared
masks: one 4D mask when every layer has the same window, else a dict keyed by `config.layer_types`. The target's
cache keeps every position in every layer (`compat.position_cache`, no sliding layers), so that a rejected block can be cropped and a tree's path kept; the window lives in the mask.

Targets with only full-attention layers keep transformers' own masks (a 2D padding mask for a chain).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import structure

FULL, SLIDING = "full_attention", "sliding_attention"
ALL_LAYERS = "all"  # the key of a target without `layer_types`, whose layers share one window


@dataclass(frozen=True)
class TargetAttention:
    """How a target's layers attend: a window per layer kind (None = full attention)."""

    windows: dict[str, int | None]  # layer kind -> window; kinds are `config.layer_types` values or ALL_LAYERS

    @classmethod
    def of(cls, target, prefill: bool = False) -> "TargetAttention":
        """Read from what the target's layers do (`structure.of`): for tokens decoded after the prompt, the window
        each attention module passes to its attention function, narrowed by the one its cache layer keeps in
        `generate()`; for the prompt (`prefill`), the attention's alone. Keyed by `config.layer_types` where the
        layers differ. A target the engine cannot decode (a recurrent or convolutional layer, a chunked attention)
        is refused with a ValueError naming it."""
        found = structure.of(target)
        found.check()
        config = target.config.get_text_config(decoder=True) if hasattr(target.config, "get_text_config") \
            else target.config
        layer_types = list(getattr(config, "layer_types", None) or [])
        # The kinds of blocks that do not attend (linear attention, conv, MLP alone) or keep a state beside their
        # attention (Falcon-H1's "hybrid") are rolled back or stateless, not masked
        masked = [i < len(found.attends) and found.attends[i] and i not in found.stateful
                  for i in range(len(layer_types))]
        kinds = {kind for kind, on in zip(layer_types, masked) if on and kind not in (FULL, SLIDING)}
        if kinds:
            raise ValueError(
                f"Unsupported target class {type(target).__name__}: its layer_types hold {sorted(kinds)}; hf_dscale "
                f"verifies drafts on attention layers that are {FULL!r} or {SLIDING!r} (a token's keys must be kept "
                "and dropped by position, which a chunked or indexed layer's state does not allow).")
        per_layer = found.windows if prefill else found.decode_windows
        windows = {w for w, on in zip(per_layer, found.attends) if on}
        if len(windows) <= 1:
            return cls({ALL_LAYERS: next(iter(windows), None)})
        by_kind: dict[str, set] = {}
        for kind, window in zip(layer_types, per_layer):
            by_kind.setdefault(kind, set()).add(window)
        if len(layer_types) != len(per_layer) or any(len(seen) > 1 for seen in by_kind.values()) or \
                not all(found.attends) or found.stateful:
            raise ValueError(
                f"Unsupported target class {type(target).__name__}: its layers attend through windows "
                f"{list(per_layer)} that its config's layer_types ({layer_types or 'none'}) do not key (or beside "
                "layers with a recurrent state, whose prompt mask transformers builds), and transformers takes prepared "
                "masks by layer type; hf_dscale cannot hand each layer its mask.")
        return cls({kind: next(iter(seen)) for kind, seen in sorted(by_kind.items())})

    @property
    def sliding(self) -> bool:
        """Whether some layer attends through a window (the decoders then build the masks)."""
        return any(w is not None for w in self.windows.values())

    def masks(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype):
        """The target's attention masks for a forward whose queries may see `allowed` keys.

        allowed [B, Q, K] bool (padding, holes, causality or tree ancestry); query_pos [B, Q] and key_pos [B, K]
        the positions of queries and keys. Returns an additive 4D mask [B, 1, Q, K] in `dtype` when every
        layer kind has the same window, else {layer kind: mask}.
        """
        distance = query_pos[:, :, None] - key_pos[:, None, :]  # [B, Q, K]
        built: dict[int | None, torch.Tensor] = {}
        for window in set(self.windows.values()):
            seen = allowed if window is None else allowed & (distance < window)
            mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)
            built[window] = mask[:, None]
        if len(built) == 1:
            return next(iter(built.values()))
        return {kind: built[window] for kind, window in self.windows.items()}

    def after_cache(self, valid: torch.Tensor, query_pos: torch.Tensor, new_allowed: torch.Tensor,
                    dtype: torch.dtype):
        """`masks` for Q new tokens appended after the cache's C columns: each query sees the valid columns
        (valid [B, C]) and the new tokens `new_allowed` [Q, Q] lets it see (causal for a chain, ancestors for a
        tree); query_pos [B, Q]."""
        b, q = query_pos.shape
        allowed = torch.cat((valid[:, None, :].expand(b, q, -1), new_allowed.expand(b, -1, -1)), dim=2)
        key_pos = torch.cat((column_positions(valid), query_pos), dim=1)
        return self.masks(allowed, query_pos, key_pos, dtype)


def column_positions(valid: torch.Tensor) -> torch.Tensor:
    """valid [B, C] bool over cache columns -> each column's position in its row (its count of valid columns
    before it; holes and padding get their neighbour's, and are masked anyway)."""
    return (valid.long().cumsum(-1) - 1).clamp_min(0)
