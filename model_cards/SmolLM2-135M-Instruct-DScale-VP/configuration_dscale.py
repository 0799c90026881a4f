"""Configuration of DScale drafters (DFlash is the `fusion="shared"` special case).

The file is self-contained so that `save_pretrained` can ship it as remote code.
"""

from __future__ import annotations

from transformers import PretrainedConfig

FUSIONS = ("layerwise", "shared")
LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE types the drafter computes with transformers' own `ROPE_INIT_FUNCTIONS` ("default" is computed here).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def normalise_rope(rope_parameters: dict | None, rope_scaling: dict | None = None) -> dict | None:
    """One RoPE dict (`rope_type`, its parameters, maybe `rope_theta`) from the 5.x `rope_parameters` or the
    4.x `rope_scaling` (whose type may be under `type`); None for the plain default RoPE."""
    merged = dict(rope_scaling or {})
    merged.update(rope_parameters or {})
    if "type" in merged:
        merged.setdefault("rope_type", merged.pop("type"))
    merged.setdefault("rope_type", "default")
    return None if merged["rope_type"] == "default" else merged


def sliding_attention_in(config: dict, bare_window_slides: bool = True) -> str | None:
    """What in a config (a dict) asks for sliding-window attention, in words; None when nothing does.

    `layer_types` (transformers 5.x) names each layer's attention and wins. Qwen2/3 configs carry a
    `sliding_window` that applies only with `use_sliding_window: true` (`bare_window_slides=False`);
    elsewhere a `sliding_window` alone slides.
    """
    layer_types = config.get("layer_types")
    if layer_types:
        sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
        return f"layer_types {layer_types} (layers {sliding} are not full_attention)" if sliding else None
    if config.get("use_sliding_window"):
        return f"use_sliding_window: true (sliding_window {config.get('sliding_window')})"
    if bare_window_slides and config.get("sliding_window") and "use_sliding_window" not in config:
        return f"sliding_window: {config['sliding_window']}"
    return None


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Evenly spaced taps over [1, N-3], with Python's round (half to even) as in the references.

    Worked example: `build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]`.
    """
    if num_taps == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_taps - 1))) for i in range(num_taps)]


def _read(config, name: str):
    """`config.name`, or None where the config has no such value (or keeps it per layer, as Gemma 4 does)."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers raises its own error for a per-layer attribute read globally
        return None


def _head_dim(config) -> int | None:
    """The target's head size: `head_dim`, or where it is per layer, that of its first full-attention layer."""
    found = _read(config, "head_dim")
    if isinstance(found, int):
        return found
    per_layer, kinds = _read(config, "per_layer_config"), _read(config, "layer_types") or []
    if per_layer is None:
        return None
    index = kinds.index("full_attention") if "full_attention" in kinds else 0
    return _read(per_layer[index], "head_dim")


def _drafter_rope(rope: dict) -> dict:
    """The RoPE a new drafter takes from a target's `rope_parameters`: the full-attention layers' where they are
    kept per layer type (Gemma 3/4), or another kind's whose type the drafter computes, else only the theta."""
    if rope and all(isinstance(v, dict) for v in rope.values()):
        kinds = [rope.get("full_attention")] + [v for k, v in rope.items() if k != "full_attention"]
        usable = [k for k in kinds if k and k.get("rope_type", "default") in ROPE_TYPES]
        rope = usable[0] if usable else {"rope_theta": (kinds[0] or {}).get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        rope = {"rope_theta": rope.get("rope_theta", 10000.0)}
    return rope


def _check_layer_types(layer_types, sliding_window, num_hidden_layers: int, use_sliding_window) -> None:
    """A ValueError that says what is wrong with a drafter's `layer_types` and `sliding_window` (None: nothing)."""
    if use_sliding_window:
        raise ValueError("use_sliding_window: true does not say which draft layers slide; name them in layer_types "
                         "(\"full_attention\" or \"sliding_attention\" per layer) with a sliding_window.")
    if layer_types is None:
        return
    if len(layer_types) != num_hidden_layers or set(layer_types) - set(LAYER_TYPES):
        raise ValueError(f"layer_types must hold one of {LAYER_TYPES} per draft layer ({num_hidden_layers}); got "
                         f"{layer_types}.")
    if "sliding_attention" in layer_types and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                               or sliding_window < 1):
        raise ValueError(f"layer_types has sliding_attention layers, so sliding_window must be a number of positions "
                         f"(1 or more); got {sliding_window!r}.")


class DScaleConfig(PretrainedConfig):
    r"""A block-diffusion drafter conditioned on hidden states of a target model.

    Args:
        hidden_size: must equal the target's hidden size (the drafter embeds with the target's table).
        num_hidden_layers: number of draft layers D.
        target_layer_ids: target decoder layers whose *outputs* feed the drafter (id = output of layer
            `id` = `hidden_states[id + 1]` in transformers' convention). Always stored explicitly.
        num_target_layers: depth N of the target, used to validate the taps.
        fusion: `"layerwise"` (DScale: every draft layer mixes the T taps with its own softmax weights
            and has separate target K/V projections) or `"shared"` (DFlash: one `fc` over the
            concatenated taps, shared by all layers).
        block_size: tokens per draft block, anchor included (γ).
        mask_token_id: id of the token that fills the masked block positions.
        vocab_size: the target's vocabulary size (the drafter borrows its LM head).
        prefix_prior: β of the truncated geometric prior over prefix lengths that a variable-prefix
            drafter (D²SD's second drafter) was trained with; None for a plain block drafter.
        draft_vocab_size: length of the drafter's `draft_vocab` buffer, the target tokens it proposes
            from (most frequent in its training data first; each generation adds the tokens of its own
            sequences). None = the whole vocabulary. Verification always uses the whole vocabulary.
        rope_parameters: RoPE scaling as transformers stores it (`rope_type` in `ROPE_TYPES`, its parameters);
            None = plain RoPE with `rope_theta`. The 4.x name `rope_scaling` is accepted too. The drafter
            uses the target's RoPE, including cos/sin scaling (YaRN's `attention_factor`).

        layer_types: per draft layer, "full_attention" or "sliding_attention" (z-lab's current layout); None = all
            full. A sliding layer's queries see the keys (context and block) less than `sliding_window` positions
            away, as z-lab's drafter computes with flash attention's window. Qwen2's `use_sliding_window` is refused:
            name the layers in `layer_types` instead.
        sliding_window: the window of the sliding layers, in positions.
    """

    model_type = "dscale"

    def __init__(
        self,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 8192,
        initializer_range: float = 0.02,
        vocab_size: int = 49152,
        target_layer_ids: list[int] | None = None,
        num_target_layers: int | None = None,
        fusion: str = "layerwise",
        block_size: int = 16,
        mask_token_id: int | None = None,
        loss_decay_gamma: float = 7.0,
        target_model_type: str | None = None,
        prefix_prior: float | None = None,
        draft_vocab_size: int | None = None,
        rope_parameters: dict | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        **kwargs,
    ):
        self.layer_types = None if layer_types is None else list(layer_types)
        self.sliding_window = sliding_window
        rope = normalise_rope(rope_parameters, kwargs.pop("rope_scaling", None))
        if rope is not None:
            rope_theta = rope.get("rope_theta", rope_theta)
            rope["rope_theta"] = rope_theta
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.vocab_size = vocab_size
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else None
        self.num_target_layers = num_target_layers
        self.fusion = fusion
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.loss_decay_gamma = loss_decay_gamma
        self.target_model_type = target_model_type
        self.prefix_prior = prefix_prior
        self.draft_vocab_size = draft_vocab_size
        kwargs.setdefault("tie_word_embeddings", False)
        _check_layer_types(self.layer_types, sliding_window, num_hidden_layers, kwargs.get("use_sliding_window"))
        super().__init__(**kwargs)
        self.rope_parameters = rope  # after the base class, whose RoPE standardisation differs across 5.x

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def validate(self) -> None:
        """Raise a ValueError that says what to fix; the drafter calls it when it is built or loaded."""
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {self.fusion!r}.")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (anchor + one draft token), got {self.block_size}.")
        if not self.target_layer_ids:
            raise ValueError(
                "target_layer_ids is empty: store the tapped target layers explicitly, e.g. "
                "build_target_layer_ids(num_target_layers, 5)."
            )
        if self.num_target_layers is not None:
            bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers - 1]
            if bad:
                raise ValueError(
                    f"target_layer_ids {bad} are outside [0, {self.num_target_layers - 2}] for a target with "
                    f"{self.num_target_layers} layers (the last layer's output is normalised in hidden_states, "
                    "so it cannot be tapped)."
                )
        if self.mask_token_id is None:
            raise ValueError(
                "mask_token_id is missing: choose a token id of the target's vocabulary that fills masked "
                "block positions (e.g. an unused special token) and set config.mask_token_id."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}).")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}], or None for "
                "the whole vocabulary."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads.")
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_parameters has rope_type {rope_type!r}; the drafter supports {ROPE_TYPES}. Use a target "
                "whose RoPE is one of these, or set rope_parameters to the nearest supported type."
            )

    def window(self, layer: int) -> int | None:
        """The window of draft layer `layer` in positions, None for full attention."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_target(cls, target_config, num_hidden_layers: int = 2, num_taps: int | None = None,
                    fusion: str = "layerwise", mask_token_id: int | None = None, **kwargs) -> "DScaleConfig":
        """A drafter config whose width, heads and RoPE follow `target_config`: a Llama/Qwen3-style config, a
        GPT-2-style one (`n_embd`, `n_inner`, read through transformers' attribute maps) or one whose head size is
        per layer (Gemma 4: its full-attention layers' head size). Where the target's RoPE is of a type the drafter does not compute,
        the drafter takes another layer kind's, or the plain one with the target's theta. Raises ValueError naming
        a size it cannot read."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        hidden, heads, n = (_read(text, name) for name in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
        n = _read(text, "decoder_layers") or n  # the decoder half of an encoder-decoder family (Bart, Marian)
        heads = _read(text, "decoder_attention_heads") or heads
        missing = [name for name, value in (("hidden_size", hidden), ("num_attention_heads", heads),
                                            ("num_hidden_layers", n)) if not isinstance(value, int)]
        if missing:
            raise ValueError(f"DScaleConfig.from_target cannot read {missing} from a {type(text).__name__}; pass a "
                             "causal LM's config with a hidden size, a head count and a depth.")
        num_taps = num_taps or (9 if fusion == "layerwise" else 5)
        num_taps = min(num_taps, max(1, n - 3))
        head_dim = _head_dim(text) or hidden // heads
        if head_dim % 2:  # RoPE rotates pairs: the drafter takes the nearest head count with an even head size
            heads = max(h for h in range(1, heads + 1) if hidden % h == 0 and (hidden // h) % 2 == 0)
            head_dim = hidden // heads
        kv_heads = _read(text, "num_key_value_heads") or heads
        kv_heads = kv_heads if heads % kv_heads == 0 else heads
        rope = _drafter_rope(_read(text, "rope_parameters") or {})
        rope_theta = rope.get("rope_theta", _read(text, "rope_theta") or 10000.0)
        fields = dict(
            hidden_size=hidden,
            intermediate_size=_read(text, "intermediate_size") or _read(text, "n_inner") or 4 * hidden,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_read(text, "rms_norm_eps") or _read(text, "layer_norm_epsilon") or 1e-6,
            rope_theta=rope_theta,
            rope_parameters=normalise_rope(dict(rope)),
            max_position_embeddings=_read(text, "max_position_embeddings") or 8192,
            vocab_size=text.vocab_size,
            target_layer_ids=build_target_layer_ids(n, num_taps),
            num_target_layers=n,
            fusion=fusion,
            mask_token_id=mask_token_id,
            target_model_type=text.model_type,
        )
        fields.update(kwargs)
        return cls(**fields)
