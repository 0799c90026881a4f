"""The one module that knows how transformers drifts inside 5.x (5.17 through the newest).

* The forward kwarg `past_key_values` became `cache` in 5.24 (the old name is deprecated).
* `DynamicCache.crop(n)` with n > 0 truncated to n in <= 5.8, warns in 5.16 and raises in 5.23+;
  `crop(-n)` (drop the last n) works everywhere.
* The built-in DFlash candidate generator (5.16+) passes the drafter `hidden_states[i + 1]` for
  target layer i since 5.23 and `hidden_states[i]` (one layer early) before: a version table
  (`NATIVE_DFLASH_READS_LAYER_OUTPUTS_SINCE`), not a reading of transformers' source.
* `DynamicCache` keeps per-layer `keys`/`values` tensors in `cache.layers` (5.x); the engine keeps only the
  accepted paths of verified token trees by rewriting them in place (`keep_paths`).
* `AssistedCandidateGenerator` reads the assistant's cache back as `past_key_values` before 5.24 and as
  `cache` since (see `DraftGenerateOutput` in assistant.py, which answers to both).

It lives beside the drafter because the drafter ships as remote code and must carry it.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache


@lru_cache(maxsize=None)
def _cache_kwarg(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """{'cache': cache} or {'past_key_values': cache}, whichever `model.forward` takes."""
    return {_cache_kwarg(type(model)): cache}


def find_cache(model_kwargs: dict):
    """Pop the cache `generate()` prepared (under either name), or None."""
    found = None
    for name in ("cache", "past_key_values"):
        value = model_kwargs.pop(name, None)
        found = found if value is None else value
    return found


def new_cache(model, full: bool = False):
    """A `DynamicCache` for `model`; `full`: every layer keeps every position (no sliding-window layers, which
    cannot be cropped once past their window; the decoders then apply the window in their masks)."""
    if full:
        return DynamicCache()
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


def crop_to(cache, length: int) -> None:
    """Keep the first `length` positions of every layer."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def keep_paths(cache, start: int, index: torch.Tensor) -> None:
    """After a forward appended N nodes per row at `start`, pack each row's accepted path at start, start + 1, ...:
    index [B, L] holds the node (0..N-1) for each of those columns. The caller crops to start + L."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") for layer in layers):
        raise TypeError(f"{type(cache).__name__} does not expose per-layer keys/values; token trees need a DynamicCache.")
    b, width = index.shape
    for layer in layers:
        for tensor in (layer.keys, layer.values):  # [B, H, S, D]
            gather = (index + start)[:, None, :, None].expand(b, tensor.shape[1], width, tensor.shape[-1])
            tensor[:, :, start : start + width] = tensor.gather(2, gather.to(tensor.device))


def attention_implementation(model) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def sdpa_attention():
    """transformers' SDPA attention function (the fallback of hf_dscale's tree attention)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def sdpa_mask():
    """transformers' SDPA mask builder, registered for hf_dscale's tree attention."""
    from transformers.masking_utils import sdpa_mask as builder

    return builder


# The releases whose `DFlashTokenCandidateGenerator` hands the drafter `hidden_states[i + 1]` (the output of layer i)
# for target layer i: 5.23 on. 5.16-5.22 pass `hidden_states[i]`, one layer early.
NATIVE_DFLASH_READS_LAYER_OUTPUTS_SINCE = (5, 23)


def transformers_release() -> tuple[int, int]:
    """(major, minor) of the installed transformers."""
    return Version(transformers.__version__).release[:2]


def native_dflash_reads_layer_outputs() -> bool:
    """Whether transformers has a built-in DFlash generator (`speculation_type="dflash"`) that hands the drafter
    `hidden_states[i + 1]` (the output of layer i, our convention) for `target_layer_ids` i."""
    try:
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401
    except ImportError:
        return False
    return transformers_release() >= NATIVE_DFLASH_READS_LAYER_OUTPUTS_SINCE
