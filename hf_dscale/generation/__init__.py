"""The transformers-facing entry points: `custom_generate` (the speculative engine, `hf_dscale.engine`), and the
diffusion-LM decoders (`hf_dscale.dllm`) with their `dllm_generate`."""

from ..dllm import blockbatch_generate, dllm_generate, fast_dllm_generate
from ..engine.acceptance import greedy_accept, speculative_accept
from ..engine.types import DecodeStats
from .custom_generate import generate as custom_generate

__all__ = ["DecodeStats", "blockbatch_generate", "custom_generate", "dllm_generate", "fast_dllm_generate",
           "greedy_accept", "speculative_accept"]

