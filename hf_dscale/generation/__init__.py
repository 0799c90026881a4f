"""What decodes: acceptance rules, transformers entry points, diffusion LM decoding (the speculative loop itself is
`hf_dscale.engine`)."""

from .acceptance import greedy_accept, speculative_accept
from .custom_generate import generate as custom_generate
from .dllm import blockbatch_generate, fast_dllm_generate
from .dllm_custom_generate import generate as dllm_generate
from .types import DecodeStats

__all__ = ["DecodeStats", "blockbatch_generate", "custom_generate", "dllm_generate", "fast_dllm_generate", "greedy_accept", "speculative_accept", "speculative_generate", "tree_generate"]


def __getattr__(name: str):
    """`speculative_generate` and `tree_generate` live in `hf_dscale.engine`, which imports this package's helpers."""
    if name in ("speculative_generate", "tree_generate"):
        from .. import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
