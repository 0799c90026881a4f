"""Publishing drafters and diffusion LMs (what is published): model cards."""

from .card import render_card, render_dllm_card

__all__ = ["render_card", "render_dllm_card"]
