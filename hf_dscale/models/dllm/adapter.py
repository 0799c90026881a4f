"""`DiffusionModel`: the one view of a masked-diffusion LM that the dLLM decoders use.

It returns logits *aligned to targets* (row p predicts the token at p) for both styles: LLaDA-style
models predict position p at p, Dream-style models at p - 1. With hf_dscale's own `DiffusionLM` block
forwards use the dual cache; hub LLaDA/Dream classes (remote code) get a full forward per call, which
is exact and counts as the same one NFE.
"""

from __future__ import annotations

import torch

from .families import DreamModel, LLaDAModelLM
from .modeling_dllm import DiffusionLM, DualCache

_HUB_STYLES = {"llada": 0, "dream": 1}  # model_type (lower-case) -> logits shift


class DiffusionModel:
    """`dual_cache=False` runs every block call as a full forward even where the model has the dual cache (exact
    logits for every step, at a full forward's cost)."""

    def __init__(self, model, mask_token_id: int | None = None, eos_token_id: int | None = None,
                 dual_cache: bool = True):
        config = model.config
        kind = str(getattr(config, "model_type", "")).lower()
        if isinstance(model, DiffusionLM):
            self.shift, self.dual_cache = config.logits_shift, dual_cache
        elif isinstance(model, (LLaDAModelLM, DreamModel)):
            self.shift, self.dual_cache = _HUB_STYLES[kind], dual_cache
        elif kind in _HUB_STYLES:  # the published remote code: no in-place block cache
            self.shift, self.dual_cache = _HUB_STYLES[kind], False
        elif kind.startswith("diffusion_gemma"):
            raise ValueError(
                f"{type(model).__name__} denoises a canvas of random tokens (it has no mask token) with its own "
                "entropy-bound sampler, while Fast-dLLM and BlockBatch commit masked positions: decode it with its "
                "own model.generate()."
            )
        else:
            raise ValueError(
                f"Unsupported model class {type(model).__name__} (model_type {kind!r}): the dLLM decoders take "
                "hf_dscale's DiffusionLM, LLaDA and Dream checkpoints (loaded with `import hf_dscale` and "
                "AutoModel.from_pretrained, no remote code needed)."
            )
        self.model = model
        self.mask_token_id = mask_token_id if mask_token_id is not None else getattr(config, "mask_token_id", None)
        if self.mask_token_id is None:
            raise ValueError(f"{type(model).__name__} has no mask_token_id in its config: pass mask_token_id=.")
        eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos

    def new_cache(self) -> DualCache | None:
        return DualCache(self.model.config.num_hidden_layers) if self.dual_cache else None

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.shift == 0 else torch.cat((logits[:, :1], logits[:, :-1]), dim=1)

    @torch.no_grad()
    def full(self, x: torch.Tensor, cache: DualCache | None = None) -> torch.Tensor:
        """The whole sequence [B, L] -> aligned logits [B, L, V]; refills `cache` for all positions."""
        if cache is not None:
            cache.clear()
            logits = self.model(x, cache=cache).logits
        else:
            logits = self.model(input_ids=x).logits
        return self._align(logits.float())

    @torch.no_grad()
    def block(self, x: torch.Tensor, targets: torch.Tensor, write: torch.Tensor,
              cache: DualCache | None = None) -> torch.Tensor:
        """Aligned logits [B, Q, V] for target positions `targets` [B, Q] of every row of x [B, L].

        With the dual cache only the inputs that predict those targets run (positions targets - shift),
        and their K/V replace the cached ones where `write` [B, Q] is True.
        """
        if cache is None or not self.dual_cache:
            logits = self.full(x)
            return logits.gather(1, targets[..., None].expand(-1, -1, logits.shape[-1]))
        inputs = (targets - self.shift).clamp_min(0)
        logits = self.model(x.gather(1, inputs), position_ids=inputs, cache=cache, write=write).logits
        return logits.float()
