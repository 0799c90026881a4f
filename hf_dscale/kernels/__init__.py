"""Triton kernels (tree attention for D²SD verification) and their torch references."""

from .tree_attention import tree_attention, tree_attention_reference, tree_attention_triton, triton_usable

__all__ = ["tree_attention", "tree_attention_reference", "tree_attention_triton", "triton_usable"]
