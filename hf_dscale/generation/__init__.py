"""The transformers-facing entry points: `custom_generate` (the speculative engine, `hf_dscale.engine`), the
diffusion-LM decoders and `dllm_generate`."""

from ..engine.acceptance import greedy_accept, speculative_accept
from ..engine.types import DecodeStats
from .custom_generate import generate as custom_generate
from .dllm import blockbatch_generate, fast_dllm_generate
from .dllm_custom_generate import generate as dllm_generate

__all__ = ["DecodeStats", "blockbatch_generate", "custom_generate", "dllm_generate", "fast_dllm_generate", "greedy_accept", "speculative_accept", "speculative_generate", "tree_generate"]


def __getattr__(name: str):
    """`speculative_generate` and `tree_generate` live in `hf_dscale.engine`, which imports this package's helpers."""
    if name in ("speculative_generate", "tree_generate"):
        from .. import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
