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
* Layers that fold tokens into a state (linear attention, Mamba, short convolutions) keep it in a
  `LinearAttentionCacheLayerMixin` layer (5.17+). After `activate_past_recording()` a layer keeps the conv window of
  every token of a forward; since 5.25 `activate_past_recording(recurrent_states_to_keep=n)` also makes the model step
  its recurrence one token at a time over the last n tokens of a forward and keep each step's state (read from the
  method's signature: `records_recurrent_steps`). `keep_states` rolls each row back to its own accepted length.
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
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

try:  # 5.17+: the cache layers of recurrent, linear-attention and conv layers
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # pragma: no cover - older releases are outside the supported range
    LinearAttentionCacheLayerMixin = None


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
    """Keep the first `length` positions of every layer. A layer with a recurrent or conv state is left as it is
    (`keep_states` rolled it back), apart from its token count."""
    if not stateful_layers(cache):
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)
        return
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            extra = layer.get_seq_length() - length
            if extra > 0:
                DynamicLayer.crop(layer, -extra)  # the K/V part alone of a layer that also keeps a state
        count = getattr(layer, "cumulative_length_linear", None)
        if isinstance(count, torch.Tensor):
            count.fill_(length)


def is_stateful(layer) -> bool:
    """Whether a cache layer keeps a conv window or a recurrent state (besides any keys and values)."""
    return LinearAttentionCacheLayerMixin is not None and isinstance(layer, LinearAttentionCacheLayerMixin)


def stateful_layers(cache) -> list[int]:
    """The indices of a cache's layers that keep a conv window or a recurrent state."""
    return [i for i, layer in enumerate(getattr(cache, "layers", ())) if is_stateful(layer)]


def records_recurrent_steps() -> bool:
    """Whether the installed transformers can keep a recurrent state per token of a forward (5.25+): its layers'
    `activate_past_recording` takes `recurrent_states_to_keep`."""
    if LinearAttentionCacheLayerMixin is None:
        return False
    return "recurrent_states_to_keep" in inspect.signature(
        LinearAttentionCacheLayerMixin.activate_past_recording).parameters


def hybrid_cache(config, capacity: int = 0) -> DynamicCache:
    """The cache of a target with stateful layers: transformers' own layers for those (as `generate()` builds them
    from `config`), `PositionLayer`s for the attention layers (every position kept; the engine's masks apply any
    window). Raises ValueError for a layer that keeps a state and a sliding window of keys together."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
            cache.layers[i] = PositionLayer(capacity)
        elif is_stateful(layer) and isinstance(layer, DynamicSlidingWindowLayer):
            raise ValueError(f"Layer {i} keeps a recurrent state and a sliding window of keys "
                             f"({type(layer).__name__}); hf_dscale cannot roll such a layer back.")
    return cache


def record_states(cache, steps: int) -> None:
    """After the prefill: make the stateful layers keep every token's conv window and, where transformers can,
    the recurrent state after each of the last `steps` tokens of a forward (the widest verify), for `keep_states`."""
    if records_recurrent_steps():
        cache.activate_past_recording(recurrent_states_to_keep=steps)
    else:
        for i in stateful_layers(cache):
            cache.layers[i].activate_past_recording()


def keep_states(cache, kept: torch.Tensor) -> int:
    """After a forward of N tokens per row: each stateful layer's conv window and recurrent state become those after
    the first `kept[b]` (0..N) of them, row by row (the state before the forward for 0). Returns the bytes the
    forward kept to choose from (every token's conv window and recurrent state)."""
    recorded = 0
    for i in stateful_layers(cache):
        layer = cache.layers[i]
        for s in range(layer.number_of_states):
            if layer.is_conv_states_initialized[s]:
                full, kernel = layer.conv_states[s], layer.conv_kernel_size[s]  # [B, C, kernel + N]
                recorded += full.numel() * full.element_size()
                at = (kept.to(full.device)[:, None] + torch.arange(kernel, device=full.device))[:, None, :]
                layer.conv_states[s] = full.gather(-1, at.expand(full.shape[0], full.shape[1], kernel))
            if layer.is_recurrent_states_initialized[s]:
                history = layer.recurrent_states_history[s]  # the state before the forward, then after each token
                current = layer.recurrent_states[s]
                steps = torch.stack([*history, current])  # [N + 1, B, ...]
                recorded += steps.numel() * steps.element_size()
                rows = torch.arange(current.shape[0], device=current.device)
                current.copy_(steps[kept.to(current.device), rows])
                layer.recurrent_states_history[s] = []
    return recorded


def recurrent_steps_recorded(cache, tokens: int) -> str | None:
    """After a forward of `tokens` tokens with recording on: why some stateful layer did not keep what `keep_states`
    needs (None: every one did)."""
    for i in stateful_layers(cache):
        layer = cache.layers[i]
        for s in range(layer.number_of_states):
            if layer.is_conv_states_initialized[s] and \
                    layer.conv_states[s].shape[-1] != layer.conv_kernel_size[s] + tokens:
                return f"layer {i} did not keep the conv window of each token of a forward"
            if layer.is_recurrent_states_initialized[s]:
                if not records_recurrent_steps():
                    return (f"layer {i} keeps a recurrent state, which transformers {transformers.__version__} cannot "
                            "keep per token (5.25 and newer can)")
                if len(layer.recurrent_states_history[s]) != tokens:
                    return f"layer {i} did not keep its recurrent state after each token of a forward"
    return None


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep the batch rows `index` in every layer (transformers' `batch_select_indices`, and the stateful layers'
    `reorder_cache`, which they have instead)."""
    for layer in cache.layers:
        if is_stateful(layer):  # the states alone (a layer that also keeps K/V may reorder both in its own method)
            LinearAttentionCacheLayerMixin.reorder_cache(layer, index)
        if isinstance(layer, DynamicLayer):
            DynamicLayer.batch_select_indices(layer, index)


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
