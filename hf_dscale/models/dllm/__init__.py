"""Masked-diffusion LMs: hf_dscale's small `DiffusionLM` (dual KV cache) and the decoders' adapter."""

from .adapter import DiffusionModel
from .modeling_dllm import DiffusionLM, DiffusionLMConfig, DualCache

__all__ = ["DiffusionLM", "DiffusionLMConfig", "DiffusionModel", "DualCache"]
