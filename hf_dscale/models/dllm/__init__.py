"""Masked-diffusion LMs: hf_dscale's small `DiffusionLM`, LLaDA and Dream (dual KV cache), and the decoders' adapter."""

from .adapter import DiffusionModel
from .families import DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM
from .modeling_dllm import DiffusionLM, DiffusionLMConfig, DualCache

__all__ = ["DiffusionLM", "DiffusionLMConfig", "DiffusionModel", "DreamConfig", "DreamModel", "DualCache",
           "LLaDAConfig", "LLaDAModelLM"]
