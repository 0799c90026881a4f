"""The one module that knows how transformers drifts inside 5.x (5.17 through the newest).

* The forward kwarg `past_key_values` became `cache` in 5.24 (the old name is deprecated).
* `DynamicCache.crop(n)` with n > 0 truncated to n in <= 5.8, warns in 5.16 and raises in 5.23+;
  `crop(-n)` (drop the last n) works everywhere.
* The built-in DFlash candidate generator (5.16+) passes the drafter `hidden_states[i + 1]` for
  target layer i since 5.23 and `hidden_states[i]` (one layer early) before: a version table
  (`NATIVE_DFLASH_READS_LAYER_OUTPUTS_SINCE`), not a reading of transformers' source.
* `DynamicCache` keeps per-layer `keys`/`values` tensors in `cache.layers` (5.x) and grows a layer it has not
  seen with `cache.layer_class_to_replicate()`; the engine's `position_cache` gives it layers whose keys and values
  are views of buffers allocated ahead (`PositionLayer`), and keeps only the accepted paths of verified token
  trees by rewriting them in place (`keep_paths`).
* `AssistedCandidateGenerator` reads the assistant's cache back as `past_key_values` before 5.24 and as
  `cache` since (see `DraftGenerateOutput` in assistant.py, which answers to both).

It lives beside the drafter because the drafter ships as remote code and must carry it.
"""

from __future__ import annotations

import inspect
from functools import lru_cache, partial

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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


def reserve(buffers, views, like, size: int, capacity: int):
    """Buffers for the tensors `like` ([B, H, *, D] each) with room for `size` positions, holding `views` (the
    positions kept so far, or None) at their start: `buffers` themselves while the views are still theirs and they
    are large enough; else new ones of max(capacity, 2 * size) positions with the views copied in (a batch reorder
    replaces views with copies, which the new buffers then hold)."""
    view = views[0]
    kept = 0 if view is None or view.dim() != 4 else view.shape[-2]
    held = buffers[0] is not None and view is not None and view.dim() == 4 and \
        view.data_ptr() == buffers[0].data_ptr() and view.shape[:2] == buffers[0].shape[:2]
    if held and size <= buffers[0].shape[-2]:
        return buffers
    fresh = tuple(t.new_empty(*t.shape[:2], max(capacity, 2 * size), t.shape[-1]) for t in like)
    if kept:
        for buffer, old in zip(fresh, views):
            buffer[:, :, :kept] = old
    return fresh


class PositionLayer(DynamicLayer):
    """A cache layer whose `keys`/`values` [B, H, S, D] are views of buffers allocated ahead for `capacity`
    positions: an update writes the new positions in place (no concatenation), a crop only shortens the view, so the
    entries of a rejected draft are overwritten by the next verify. A buffer that fills up is reallocated at twice
    the size (any `capacity` is correct; the right one saves the copies)."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        self.key_buffer = self.value_buffer = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = start + key_states.shape[-2]
        self.key_buffer, self.value_buffer = reserve((self.key_buffer, self.value_buffer), (self.keys, self.values),
                                                     (key_states, value_states), end, self.capacity)
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


def position_cache(capacity: int = 0) -> DynamicCache:
    """A `DynamicCache` of `PositionLayer`s, each allocated for `capacity` positions. Every layer keeps every
    position (no sliding-window layers: the engine applies windows in its masks)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(PositionLayer, capacity)
    return cache


class Columns:
    """What the `ColumnLayer`s of one cache share: their `capacity`, the columns the next forward writes (`write`, a
    tensor [Q]) and how many columns hold entries (`length`, what `get_seq_length` reports and a crop shortens)."""

    def __init__(self, capacity: int):
        self.capacity, self.write, self.length = capacity, None, 0


class ColumnLayer(DynamicLayer):
    """A cache layer of fixed shape for a compiled forward: `keys`/`values` [B, H, capacity, D] allocated at the
    first update, which writes the new entries at the columns `columns.write` and returns the whole buffers (the
    caller's 4D mask hides the columns not in use). Its shapes never change, so a compiled forward runs it without
    recompiling; a crop only lowers `columns.length`."""

    def __init__(self, columns: Columns):
        super().__init__()
        self.columns = columns

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.keys = key_states.new_zeros(*key_states.shape[:2], self.columns.capacity, key_states.shape[-1])
            self.values = value_states.new_zeros(*value_states.shape[:2], self.columns.capacity,
                                                 value_states.shape[-1])
            self.is_initialized = True
        self.keys.index_copy_(2, self.columns.write, key_states)
        self.values.index_copy_(2, self.columns.write, value_states)
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.columns.length

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.columns.capacity, 0

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.columns.length + max_length
        self.columns.length = min(self.columns.length, max_length)


def column_cache(capacity: int) -> DynamicCache:
    """A `DynamicCache` of `ColumnLayer`s sharing one `Columns` (`cache.columns`)."""
    cache = DynamicCache()
    cache.columns = Columns(capacity)
    cache.layer_class_to_replicate = partial(ColumnLayer, cache.columns)
    return cache


def grow_columns(cache, capacity: int) -> None:
    """Give a `column_cache` room for `capacity` columns, keeping its entries."""
    for layer in cache.layers:
        if layer.is_initialized:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
                new[:, :, : old.shape[2]] = old
                setattr(layer, name, new)
    cache.columns.capacity = capacity


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


def compile_everywhere() -> dict:
    """`generate()` keyword arguments that make transformers compile its decoding step with a static cache on any
    device, not only where it does by default (a GPU): a `CompileConfig` asking for all devices, or {} where the
    installed transformers has no such setting."""
    from transformers import CompileConfig

    config = CompileConfig()
    if not hasattr(config, "_compile_all_devices"):
        return {}
    config._compile_all_devices = True
    return {"compile_config": config}


def native_dflash_reads_layer_outputs() -> bool:
    """Whether transformers has a built-in DFlash generator (`speculation_type="dflash"`) that hands the drafter
    `hidden_states[i + 1]` (the output of layer i, our convention) for `target_layer_ids` i."""
    try:
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401
    except ImportError:
        return False
    return transformers_release() >= NATIVE_DFLASH_READS_LAYER_OUTPUTS_SINCE
