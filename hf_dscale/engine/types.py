"""Data contracts between drafting, verification and the decode loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecodeStats:
    """Per-call counters of a speculative decode.

    `committed[i]` is the number of tokens committed by target forward i of a row (accepted drafts
    plus the recovered/bonus token), so tau = mean(committed). Stage times are wall-clock seconds.
    """

    committed: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)  # tokens verified per target forward: block width or tree size
    cycles: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    compile_s: float = 0.0  # compiling the verify for a shape first met in this call (not in verify_s)
    plan: Any = None  # the engine's `Plan` (hf_dscale.engine), what was measured and chosen for the call
    state_bytes: int = 0  # the most a verify kept of recurrent states and conv windows to roll rows back (0: none)

    @property
    def compile_total_s(self) -> float:
        """Compiling, all of it: in this call (`compile_s`) and when its plan was made (`Plan.compile_s`)."""
        return self.compile_s + getattr(self.plan, "compile_s", 0.0)

    @property
    def tau(self) -> float:
        return sum(self.committed) / max(1, len(self.committed))

    def merge(self, other: "DecodeStats") -> None:
        self.committed += other.committed
        self.verified += other.verified
        self.cycles += other.cycles
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.other_s += other.other_s
        self.compile_s += other.compile_s
        self.plan = other.plan if other.plan is not None else self.plan
        self.state_bytes = max(self.state_bytes, other.state_bytes)
