"""Publishing drafters (what is published): model cards."""

from .card import render_card

__all__ = ["render_card"]
