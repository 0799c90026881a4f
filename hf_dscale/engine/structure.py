"""What a target's layers do, read from the layers themselves: a probe forward of a few tokens, once per target.

The engine verifies drafts by position: each verified token's keys and values are written into a cache, and a
rejected token's are dropped by cropping (or masking) its column. That is exact for a layer whose whole state is the
keys and values of the tokens it saw, attending to all of them or to a window of them; it is not for a layer that
folds tokens into a running state (linear attention, Mamba, short convolutions, ...), whose state after a rejected
token cannot be cropped back. Config keys do not say which is which reliably (a Llama config may carry a
`sliding_window` its modeling ignores; Falcon-H1 runs Mamba beside attention in every layer without `layer_types`),
so `probe` runs the target once on three tokens:

* through an attention function of its own, registered with transformers' `AttentionInterface`, which records for
  each attention module the window, sinks and soft-cap it passes, then attends as SDPA does;
* with `use_cache=True`, reading back what the model keeps per layer: a layer is decodable when its cache layer is
  transformers' plain K/V layer (`DynamicLayer`, or `DynamicSlidingWindowLayer`, whose window `generate()` applies
  to every token decoded after the prompt even where the attention itself does not slide).

`Structure.problem` names what the engine cannot decode (None: it can); `decode` raises it as a ValueError before it
decodes. The decoder blocks are found where the attention modules live, whatever the model calls them
(`model.layers`, `transformer.h`, ...).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..models.dscale import compat
from ..models.dscale.modeling_dscale import tap_layers

PROBE = "hf_dscale_probe"
KV_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")  # transformers' cache layers that hold K/V only
STATELESS = "DummyLayer"  # transformers' cache layer of a block that keeps nothing (an MLP or MoE block alone)


@dataclass(frozen=True)
class Structure:
    """One target's decoder blocks and what each does."""

    blocks: nn.ModuleList | None  # the decoder blocks, in order
    windows: tuple[int | None, ...]  # per block: the window its attention applies (None: full), a prefill's too
    cache_windows: tuple[int | None, ...]  # per block: the window its cache layer keeps in generate() (None: all)
    head_dims: tuple[int, ...]  # per block: its attention's head size
    attends: tuple[bool, ...]  # per block: whether it calls an attention function
    stateful: tuple[int, ...]  # the blocks whose cache layer keeps a conv window or a recurrent state
    positions: bool  # the outputs follow the position_ids passed (else positions come from cache columns)
    sinks: bool  # some attention takes sink logits (gpt-oss)
    softcap: bool  # some attention soft-caps its logits (Gemma 2)
    problem: str | None = None  # what the engine cannot decode, in words (None: nothing)
    own_masks: bool = False  # its attention is its own, outside transformers' interface: it takes 2D masks only
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def decode_windows(self) -> tuple[int | None, ...]:
        """Per block, what a token decoded one at a time sees: the attention's window, narrowed by the cache's (a
        Llama config may carry a `sliding_window` its attention ignores but `generate()`'s cache applies)."""
        return tuple(w if c is None else c if w is None else min(w, c)
                     for w, c in zip(self.windows, self.cache_windows))

    def check(self) -> None:
        """Raise the problem as a ValueError, if there is one."""
        if self.problem is not None:
            raise ValueError(self.problem)


_PROBED: "weakref.WeakKeyDictionary[nn.Module, Structure]" = weakref.WeakKeyDictionary()


def of(target: nn.Module) -> Structure:
    """`probe(target)`, run once per target and kept (weakly) for later calls."""
    found = _PROBED.get(target)
    if found is None:
        found = _PROBED[target] = probe(target)
    return found


class _Recorder:
    """The probe's attention function: records each attention module's call and returns zeros of the attention's
    output shape (the probe reads what the layers pass and keep, not what they compute)."""

    def __init__(self):
        self.calls: dict[int, tuple[nn.Module, dict]] = {}

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        self.calls.setdefault(id(module), (module, dict(
            window=kwargs.get("sliding_window"), sinks=kwargs.get("s_aux") is not None,
            softcap=kwargs.get("softcap") is not None, head_dim=int(query.shape[-1]))))
        b, _, n, _ = query.shape
        return query.new_zeros(b, n, query.shape[1], value.shape[-1]), None


def _blocks_holding(target: nn.Module, modules: list[nn.Module]) -> nn.ModuleList | None:
    """The ModuleList whose entries hold the given (attention) modules: the decoder blocks."""
    owner_of = {}
    for name, module in target.named_modules():
        owner_of[id(module)] = name
    best = None
    for name, module in target.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            inside = sum(any(owner_of.get(id(m), "").startswith(f"{name}.{i}.") for i in range(len(module)))
                         for m in modules)
            if inside and (best is None or inside > best[0]):
                best = (inside, module)
    return None if best is None else best[1]


def _tokens(target: nn.Module, ids: list[int]) -> torch.Tensor:
    """[1, len(ids)] token ids inside the target's vocabulary (a tiny one may hold fewer than ten)."""
    rows = target.get_input_embeddings().weight.shape[0]
    return torch.tensor([[i % rows for i in ids]], device=next(target.parameters()).device)


def _name(target: nn.Module) -> str:
    return type(target).__name__


@torch.no_grad()
def probe(target: nn.Module) -> Structure:
    """Run `target` once on three tokens (see the module's docstring) and describe its blocks."""
    from transformers import AttentionInterface, AttentionMaskInterface

    name = _name(target)
    recorder = _Recorder()
    AttentionInterface.register(PROBE, recorder)
    AttentionMaskInterface.register(PROBE, compat.sdpa_mask())
    before = compat.attention_implementation(target)
    ids = _tokens(target, [1, 2, 3])
    try:
        target.set_attn_implementation(PROBE)
    except Exception as error:  # a model that fixes its attention (no attention interface)
        return _refused(f"Unsupported target class {name}: its attention does not run through transformers' "
                        f"attention interface ({type(error).__name__}: {error}), so hf_dscale cannot verify token "
                        "trees or batches on it; decode it with plain generate() (or assistant_model=).")
    try:
        out = target(input_ids=ids, use_cache=True)  # the model makes its own cache: what each layer keeps
    except Exception as error:
        return _refused(f"Unsupported target class {name}: a forward of three tokens through transformers' "
                        f"attention interface failed ({type(error).__name__}: {str(error)[:200]}); hf_dscale cannot "
                        "verify on it.")
    finally:
        target.set_attn_implementation(before)
    calls = list(recorder.calls.values())
    kept_by_model = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    if not calls:
        return _masking_itself(target, kept_by_model)
    blocks = _blocks_holding(target, [module for module, _ in calls])
    by_block = []
    for block in blocks if blocks is not None else ():
        inside = [seen for module, seen in calls if any(module is m for m in block.modules())]
        by_block.append(inside[0] if inside else None)
    problem = _unsupported(name, blocks, by_block, kept_by_model) or _not_causal(target)
    cache = _own_cache(kept_by_model)
    stateful = tuple(compat.stateful_layers(cache)) if cache is not None else ()
    if problem is None and stateful:
        problem = _rollback_unsupported(target, cache)
    attention = [seen for seen in by_block if seen is not None] or [seen for _, seen in calls]
    kept = list(getattr(cache, "layers", None) or [])
    kept = kept if len(kept) == len(by_block) else [None] * len(by_block)
    return Structure(
        blocks=blocks,
        windows=tuple(seen["window"] if seen else None for seen in by_block),
        cache_windows=tuple(getattr(layer, "sliding_window", None) if type(layer).__name__ in KV_LAYERS else None
                            for layer in kept),
        attends=tuple(seen is not None for seen in by_block),
        positions=_reads_position_ids(target),
        stateful=stateful,
        head_dims=tuple(seen["head_dim"] for seen in attention),
        sinks=any(seen["sinks"] for seen in attention),
        softcap=any(seen["softcap"] for seen in attention),
        problem=problem,
    )


def _own_cache(cache):
    """What a forward with `use_cache=True` kept per layer, as a cache with `layers`: the model's cache, or the
    self-attention half of an encoder-decoder cache a decoder-only model keeps with nothing on its cross side (it
    takes a plain `DynamicCache` as well, which the engine hands it). None where neither."""
    if getattr(cache, "layers", None) is not None:
        return cache
    own, cross = getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None)
    if getattr(own, "layers", None) is not None and (cross is None or cross.get_seq_length() == 0):
        return own
    return None


def _masking_itself(target: nn.Module, cache) -> Structure:
    """A target whose attention is its own, outside transformers' interface (GPT-Neo, Bloom, XGLM, ...): it builds its
    masks from the 2D attention mask it is given, so it takes no tree masks. It is decodable where what it keeps
    is keys and values in transformers' plain cache layers, one per block, and it is causal: the engine then feeds
    it 2D masks as plain `generate()` does, a tree path by path."""
    name = _name(target)
    layers = list(getattr(_own_cache(cache), "layers", None) or [])
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        kept = type(cache).__name__ if not layers else sorted({type(layer).__name__ for layer in layers})
        return _refused(f"Unsupported target class {name}: none of its layers calls transformers' attention "
                        f"interface and what it keeps ({kept}) is not transformers' plain cache of keys and values "
                        "(a recurrent or convolutional model, or a cache of its own); hf_dscale verifies drafts on "
                        "layers whose keys and values can be dropped by position.")
    try:
        blocks = tap_layers(target)
    except ValueError as error:
        return _refused(str(error))
    n = len(blocks)
    problem = None if n == len(layers) else (
        f"Unsupported target class {name}: it keeps keys and values for {len(layers)} layers but has {n} blocks.")
    problem = problem or _not_causal(target) or _cached_forward_differs(target)
    return Structure(blocks=blocks, windows=(None,) * n, cache_windows=(None,) * n, head_dims=(), attends=(False,) * n,
                     stateful=(), positions=problem is None and _reads_position_ids(target), sinks=False,
                     softcap=False, problem=problem, own_masks=True)


def _cached_forward_differs(target: nn.Module) -> str | None:
    """Why a verify's forward, two tokens at once over a cache, does not give what plain decoding gives, one token at a
    time over the same cache (None: it does). A model that masks itself is checked this way before the engine
    relies on it."""
    device = next(target.parameters()).device
    ids = _tokens(target, [4, 5, 6, 7, 8])

    def run(steps):
        cache, logits, done = compat.position_cache(), [], 0
        for n in steps:
            out = target(input_ids=ids[:, done : done + n], attention_mask=torch.ones_like(ids[:, : done + n]),
                         position_ids=torch.arange(done, done + n, device=device)[None], use_cache=True,
                         **compat.cache_kwargs(target, cache))
            logits.append(out.logits[0])
            done += n
        return torch.cat(logits)[3:]

    try:
        stepped, verified = run([3, 1, 1]), run([3, 2])
    except Exception as error:
        return (f"Unsupported target class {_name(target)}: a forward of two tokens over its cache, as a verify runs, "
                f"failed ({type(error).__name__}: {str(error)[:200]}).")
    if any(_differ(a, b) for a, b in zip(stepped, verified)):
        return (f"Unsupported target class {_name(target)}: a forward of two tokens over its cache gives other logits "
                "than the same tokens decoded one at a time, so hf_dscale cannot verify drafts on it.")
    return None


def _refused(problem: str) -> Structure:
    return Structure(blocks=None, windows=(), cache_windows=(), head_dims=(), attends=(), stateful=(),
                     positions=False, sinks=False, softcap=False, problem=problem)


def _unsupported(name: str, blocks, by_block: list, cache) -> str | None:
    """Why the engine cannot decode the target's layers (None: every layer keeps keys and values, a conv window or
    a recurrent state, which the engine drops or rolls back per row)."""
    if blocks is None:
        return (f"Unsupported target class {name}: its attention modules are not inside a list of decoder blocks, "
                "whose outputs hf_dscale taps for the drafter.")
    layers = getattr(_own_cache(cache), "layers", None)
    if cache is not None and layers is None:
        return (f"Unsupported target class {name}: it keeps its cache in a {type(cache).__name__}, not in "
                "transformers' per-layer cache, so hf_dscale cannot drop a rejected token's state.")
    layers = list(layers or [])
    stateful = {i for i, layer in enumerate(layers) if compat.is_stateful(layer)}
    stateless = {i for i, layer in enumerate(layers) if type(layer).__name__ == STATELESS}
    without = [i for i, seen in enumerate(by_block) if seen is None and i not in stateful | stateless]
    if without:
        kinds = sorted({type(blocks[i]).__name__ for i in without})
        return (f"Unsupported target class {name}: its decoder blocks {without} ({', '.join(kinds)}) neither attend "
                "nor keep a state in transformers' cache; hf_dscale verifies drafts on layers whose keys and values "
                "can be dropped by position, or whose conv window or recurrent state it can roll back.")
    odd = sorted((i, type(layer).__name__) for i, layer in enumerate(layers)
                 if type(layer).__name__ not in (*KV_LAYERS, STATELESS)
                 and (i not in stateful or "Sliding" in type(layer).__name__))
    if odd:
        kinds = sorted({kind for _, kind in odd})
        return (f"Unsupported target class {name}: its layers {[i for i, _ in odd]} keep a state hf_dscale cannot "
                f"roll back to the accepted token ({', '.join(kinds)}: an indexed or windowed state). Decode it "
                "with assistant_model= (where transformers can crop it) or plain generate().")
    return None


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two logit vectors differ by more than rounding (the same row computed in another batch of tokens)."""
    return bool((a - b).abs().max() > 1e-4 * a.abs().max().clamp_min(1.0))


def _not_causal(target: nn.Module) -> str | None:
    """Why the target is not causal (a token's output depends on a later token), or None."""
    first = [target(input_ids=_tokens(target, [4, later]), use_cache=False).logits[0, 0]
             for later in (5, 6)]
    if not _differ(*first):
        return None
    return (f"Unsupported target class {_name(target)}: its attention is bidirectional (a token's output changes with "
            "a later token: an encoder loaded without is_decoder=True?), so a verify of several tokens would let "
            "each see the ones after it. Load it as a decoder (config.is_decoder=True) or decode with plain "
            "generate().")


def _reads_position_ids(target: nn.Module) -> bool:
    """Whether a batch may hold masked columns in the target's attention: `generate()` hands its forward
    position_ids (its signature names them), and a masked column changes nothing: four tokens at positions 0-3, and
    the same after a masked column (at the position the engine gives it), give the same last logits. A model that
    counts positions from its cache columns (Marian, Pegasus, Whisper's decoder) does not; one that reads its
    position_ids, or has none (Granite 4's NoPE attention), does. (A layer with a recurrent state never sees the
    engine's holes: it is rolled back instead.)"""
    if "position_ids" not in inspect.signature(target.forward).parameters:
        return False  # generate() then hands it none, and the model counts columns
    device = next(target.parameters()).device

    def last(ids, mask, positions):
        return target(input_ids=_tokens(target, ids), attention_mask=torch.tensor([mask], device=device),
                      position_ids=torch.tensor([positions], device=device), use_cache=False).logits[0, -1]

    return not _differ(last([4, 5, 6, 7], [1, 1, 1, 1], [0, 1, 2, 3]),
                       last([9, 4, 5, 6, 7], [0, 1, 1, 1, 1], [0, 0, 1, 2, 3]))


def _rollback_unsupported(target: nn.Module, cache) -> str | None:
    """After the probe's three tokens: two more with recording on, and whether every stateful layer kept the conv
    window and recurrent state of each (`compat.keep_states` needs them). Why not, in words (None: it did)."""
    compat.record_states(cache, 2)
    device = next(target.parameters()).device
    try:
        target(input_ids=_tokens(target, [4, 5]), position_ids=torch.tensor([[3, 4]], device=device),
               use_cache=True, **compat.cache_kwargs(target, cache))
    except Exception as error:
        return (f"Unsupported target class {_name(target)}: a forward of two tokens while its cache records each "
                f"token's state failed ({type(error).__name__}: {str(error)[:200]}).")
    why = compat.recurrent_steps_recorded(cache, 2)
    if why is None:
        return None
    return (f"Unsupported target class {_name(target)}: {why}, so hf_dscale cannot roll it back to the accepted "
            "token. Decode it with assistant_model= or plain generate(), or upgrade transformers.")
