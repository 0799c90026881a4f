"""Speculative decoding (what decodes): acceptance rules, the decode loop, transformers entry points."""

from .acceptance import greedy_accept, speculative_accept
from .custom_generate import generate as custom_generate
from .d2sd import tree_generate
from .dllm import blockbatch_generate, fast_dllm_generate
from .dllm_custom_generate import generate as dllm_generate
from .decode import speculative_generate
from .types import DecodeStats

__all__ = ["DecodeStats", "blockbatch_generate", "custom_generate", "dllm_generate", "fast_dllm_generate", "greedy_accept", "speculative_accept", "speculative_generate", "tree_generate"]
