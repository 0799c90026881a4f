"""The target forward that a verify runs, with the LM head applied in the faster matrix layout on a CPU.

A verify feeds the target a few new tokens. On a CPU the LM head of a small model is a large part of that:
SmolLM2-135M's tied head is 49,152 x 576, and `F.linear(h, W)` over 2-16 tokens runs MKL's
SGEMM(T, N, 49152, w, 576), which on a 2-core AVX2 EPYC took 19-29 ms against 6-16 ms for the very same
product laid out the other way round, `(W @ h.T).T` (SGEMM(T, N, w, 49152, 576)); one token: 10 ms both
ways. The verify then runs `target.base_model` and applies the head itself, in whichever layout a one-time
timing found faster at that width.

Whether to, and at which widths, is measured once by the engine's `calibrate` (its `Plan.transposed`). It does so
only where a probe shows the target's logits *are* its head over the base model's last hidden
states (no soft-capping, scaling or bias the probe would miss): the target's own logits must equal
`F.linear` over those hidden states bit for bit. The two layouts compute the same sums in another order, as
the target's own forward already does at other widths, so greedy decoding keeps its identity with plain
`generate()` on the same terms as before (the benches check it: `identical`).

At the widths in `Plan.cpu_linear_widths` every float32 product of the verify, the head's included, runs the CPU
kernel of `kernels/cpu_linear.py` instead, which reads each weight once for all the verify's tokens, and at the
widths in `Plan.direct_widths` the forward runs the target's weights without its modules (`direct_forward.py`);
`calibrate` measures the ways per width (`verify_costs_ways`) and keeps the cheapest.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_linear
from ..models.dscale import compat
from ..timing import median_seconds
from .direct_forward import DirectForward


class TargetForward:
    """`forward(cache=None, **kwargs)` -> the target's logits [B, T, V] for a verify's forward kwargs, with
    `cache` passed under the name the called module takes (`compat.cache_kwargs`).

    `transposed` None: the target's own forward; else the split head (base model, then the head, transposed at
    the widths in `transposed`). `cpu_linear_widths`: the widths T whose products run the CPU kernel (hooks on the
    target's `nn.Linear` modules while such a forward runs; `close()` takes them off). `direct_widths`: the widths
    run by `direct_forward.DirectForward` instead of the target's modules; such a forward also returns the outputs
    of the layers `tap_ids` in `taps` ([B, T, L, H]; None after a forward through the modules, whose hooks record
    them).
    """

    def __init__(self, target: nn.Module, transposed: frozenset[int] | None = None,
                 cpu_linear_widths: frozenset[int] | None = None, direct_widths: frozenset[int] | None = None,
                 tap_ids=()):
        self.target = target
        self.transposed = transposed
        self.cpu_linear_widths = cpu_linear_widths or frozenset()
        self.direct_widths = direct_widths or frozenset()
        self.tap_ids = tuple(tap_ids)
        self.taps = None
        hooked = self.cpu_linear_widths - self.direct_widths  # the direct forward calls the kernel itself
        self._linears = cpu_linear.CpuLinears(target) if hooked else None
        self._direct = DirectForward(target) if self.direct_widths else None

    @property
    def kind(self) -> str:
        """The path's name for cost tables and reports."""
        return "model" if self.transposed is None else "split-head"

    def __call__(self, cache=None, **kwargs) -> torch.Tensor:
        width = kwargs["input_ids"].shape[1]
        kernel = width in self.cpu_linear_widths
        if width in self.direct_widths:
            logits, self.taps = self._direct(
                kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids"),
                cache if kwargs.get("use_cache", True) else None, kernel=kernel,
                transposed=self.transposed is not None and width in self.transposed, tap_ids=self.tap_ids)
            return logits
        self.taps = None
        module = self.target if self.transposed is None else self.target.base_model
        if cache is not None:
            kwargs.update(compat.cache_kwargs(module, cache))
        with self._linears.active() if kernel else contextlib.nullcontext():
            if self.transposed is None:
                return module(**kwargs).logits
            hidden = module(**kwargs).last_hidden_state  # [B, T, H]
            head = self.target.get_output_embeddings()
            if kernel and cpu_linear.supports(hidden, head.weight, head.bias):
                return cpu_linear.linear(hidden, head.weight, head.bias)
            return apply_head(head, hidden, width in self.transposed)

    def close(self) -> None:
        """Take the kernel's hooks off the target."""
        if self._linears is not None:
            self._linears.remove()
            self._linears = None
        self.cpu_linear_widths = self.direct_widths = frozenset()


def apply_head(head: nn.Linear, hidden: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`head(hidden)` [B, T, V]; `transposed`: computed as `(W @ h.T).T`, the same sums in another layout."""
    if not transposed:
        return F.linear(hidden, head.weight, head.bias)
    b, t, h = hidden.shape
    logits = (head.weight @ hidden.reshape(b * t, h).T).T  # [B*T, V]
    if head.bias is not None:
        logits = logits + head.bias
    return logits.reshape(b, t, -1)


@torch.no_grad()
def splittable(target: nn.Module, width: int = 3) -> bool:
    """Whether the target's logits are `F.linear` of its head over `target.base_model`'s last hidden states,
    bit for bit, on a CPU (probed with one short forward each)."""
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    base = getattr(target, "base_model", target)
    if not isinstance(head, nn.Linear) or base is target or head.weight.device.type != "cpu":
        return False
    ids = torch.arange(1, width + 1, device=head.weight.device)[None] % head.weight.shape[0]
    try:
        logits = target(input_ids=ids, use_cache=False).logits
        hidden = base(input_ids=ids, use_cache=False).last_hidden_state
    except (TypeError, AttributeError):  # a base model that takes other inputs or returns no hidden states
        return False
    return torch.equal(logits, F.linear(hidden, head.weight, head.bias))


@torch.no_grad()
def faster_transposed(head: nn.Linear, widths, batch_size: int = 1, repeats: int = 3,
                      clock=time.perf_counter) -> set[int]:
    """The widths whose head product is faster transposed (`median_seconds` of `repeats`, on random hidden
    states of `batch_size` rows)."""
    w = head.weight
    hidden = torch.randn(batch_size, max(widths), w.shape[1], dtype=w.dtype, device=w.device)
    apply_head(head, hidden[:, :1], False)  # warm-up
    jobs = {(width, t): (lambda width=width, t=t: apply_head(head, hidden[:, :width], t))
            for width in widths for t in (False, True)}
    median = median_seconds(jobs, repeats, clock)
    return {width for width in widths if median[(width, True)] < median[(width, False)]}


@dataclass(frozen=True)
class Way:
    """How a verify forward runs: through `DirectForward` or the target's modules; products by the CPU kernel or
    torch."""

    direct: bool
    kernel: bool

    def __str__(self) -> str:
        return f"{'direct forward' if self.direct else 'model forward'}, " \
               f"{'CPU kernel' if self.kernel else 'torch'} products"


@torch.no_grad()
def verify_costs_ways(target: nn.Module, transposed: frozenset[int] | None, ways, widths, batch_size: int = 1,
                      repeats: int = 3, clock=time.perf_counter) -> dict[Way, dict[int, float]]:
    """Seconds of a verify forward of each of `widths` tokens by each of `ways`, as `verify_costs` measures them,
    interleaved so that a slow spell of the machine hits every way alike."""
    forwards = {way: TargetForward(target, transposed, frozenset(widths) if way.kernel else None,
                                   frozenset(widths) if way.direct else None) for way in ways}
    try:
        ids = torch.zeros(batch_size, max(widths), dtype=torch.long, device=next(target.parameters()).device)
        for forward in forwards.values():  # warm-up
            forward(input_ids=ids[:, :2], use_cache=False)
        jobs = {(w, way): (lambda w=w, forward=forward: forward(input_ids=ids[:, :w], use_cache=False))
                for w in widths for way, forward in forwards.items()}
        median = median_seconds(jobs, repeats, clock)
    finally:
        for forward in forwards.values():
            forward.close()
    return {way: {w: median[(w, way)] for w in widths} for way in ways}
