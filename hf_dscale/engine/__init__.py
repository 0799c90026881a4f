"""The speculative decode engine: one loop (`loop.py`) for the chain, the drafter's own tree, D²SD and the prompt
lookup, batch size >= 1, with every measured decision in a `Plan` (`plan.py`)."""

from .loop import Engine, decode
from .plan import BRANCH_POLICIES, Plan, calibrate, plan_for

__all__ = ["BRANCH_POLICIES", "Engine", "Plan", "calibrate", "decode", "plan_for"]
