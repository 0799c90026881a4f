"""What the cuts measure per target on a CPU: the fewest drafts a confidence cut verifies, and the verify costs
the throughput cut weighs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.models.dscale import assistant

from ..conftest import REAL_MIN_DRAFTS_FOR, REAL_VERIFY_COSTS_FOR, tiny_target
from .test_exactness import _oracle, _prompt, record_candidate_widths


@pytest.fixture(autouse=True)
def measured(monkeypatch):
    """Undo conftest's fixed minimum."""
    monkeypatch.setattr(assistant, "min_drafts_for", REAL_MIN_DRAFTS_FOR)


class CostedTarget(nn.Module):
    """A stand-in target whose forward of w new tokens advances a fake clock by `cost[w]` (plus `spikes`)."""

    def __init__(self, cost: dict[int, float], spikes: dict[int, float] | None = None, device: str = "cpu"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, device=device))
        self.cost, self.spikes, self.now, self.calls = cost, dict(spikes or {}), 0.0, []

    def clock(self) -> float:
        return self.now

    def forward(self, input_ids, use_cache=False):
        width = input_ids.shape[1]
        self.calls.append(width)
        self.now += self.cost[width] + self.spikes.pop(width, 0.0)  # a spike hits one forward only


@pytest.mark.parametrize("cost, expected", [
    # Cost grows with width, a jump at 4 (BLAS on one 2-core machine): 3 costs 6% more than 2, within 10%.
    ({1: 42, 2: 47, 3: 50, 4: 69, 5: 71, 6: 76, 7: 90, 8: 97}, 3),
    # Narrow forwards are the dear ones (another machine): 5 is cheapest and 6 within 10% of it.
    ({1: 42, 2: 65, 3: 80, 4: 62, 5: 58, 6: 61, 7: 70, 8: 64}, 6),
    # Flat, as on a GPU: the widest measured.
    ({w: 20 for w in range(1, 9)}, 8),
])
def test_cheap_verify_width_is_the_widest_within_tolerance_of_the_cheapest(cost, expected):
    target = CostedTarget(cost, spikes={3: 500, 5: 500, 8: 500})  # one slow forward each: the median ignores it
    assert assistant.cheap_verify_width(target, clock=target.clock) == expected
    assert target.calls[0] == 1 and sorted(target.calls[1:]) == sorted(list(range(2, 9)) * 3)  # warm-up, interleaved


def test_min_drafts_for_is_one_less_than_the_cheap_width(monkeypatch):
    widths = iter([3, 6])
    monkeypatch.setattr(assistant, "cheap_verify_width", lambda target, forward=None: next(widths))
    first = tiny_target("llama")
    assert assistant.min_drafts_for(first) == 2  # one less than the width: the anchor is verified too
    assert assistant.min_drafts_for(first) == 5  # measured again: keeping it is the caller's (the plan's) business


def test_cheap_verify_width_times_the_forward_it_is_given():
    target = CostedTarget({w: 10 * w for w in range(1, 9)})  # its own forward: any call would show in target.calls
    path = CostedTarget({1: 42, 2: 65, 3: 80, 4: 62, 5: 58, 6: 61, 7: 70, 8: 64})  # the verifies' path
    assert assistant.cheap_verify_width(target, clock=path.clock, forward=path) == 6
    assert target.calls == [] and len(path.calls) == 1 + 7 * 3


def test_min_drafts_is_measured_on_the_verify_path(monkeypatch):
    """A confidence cut's minimum is timed on the forward the verifies run (the split head or the target's own)."""
    seen = []

    def width(target, forward=None):
        seen.append(forward)
        return {"model": 3, "split-head": 6}[getattr(forward, "kind", "model")]

    monkeypatch.setattr(assistant, "cheap_verify_width", width)
    target, split = tiny_target("llama"), type("Split", (), {"kind": "split-head"})()
    assert assistant.min_drafts_for(target) == 2
    assert assistant.min_drafts_for(target, split) == 5
    assert assistant.DraftCut.for_target(target, 0.1, 16, 1, split).minimum == 5  # the cut passes its forward on
    assert seen == [None, split, split]


def test_cut_minimum_measures_only_when_there_is_a_cut(monkeypatch):
    widths = iter([4])
    monkeypatch.setattr(assistant, "cheap_verify_width", lambda target, forward=None: next(widths))
    target = tiny_target("llama")
    assert assistant.cut_minimum(target, 0.0) is None  # whole blocks: nothing measured (the width was not drawn)
    assert assistant.cut_minimum(target, 0.1) == 3


def test_min_drafts_off_the_cpu_is_the_fallback_without_measuring():
    target = CostedTarget({}, device="meta")  # any forward would raise KeyError
    assert assistant.min_drafts_for(target) == assistant.FALLBACK_MIN_DRAFTS
    assert target.calls == []


def test_draft_length_without_a_minimum_uses_the_fallback():
    confident = torch.tensor([[[4.0, 0.0]] * 6])  # top probability 0.98 at every draft
    unsure = torch.tensor([[[0.0, 0.0]] * 6])  # 0.5: the cumulative product falls below 0.3 at the second draft
    assert assistant.draft_length(unsure, 0.3) == assistant.FALLBACK_MIN_DRAFTS == 4
    assert assistant.draft_length(confident, 0.3) == 6
    assert assistant.draft_length(unsure, 0.3, minimum=2) == 2


def test_min_drafts_measured_on_the_real_tiny_target():
    """No fake clock: a real measurement returns a width in range."""
    assert 1 <= assistant.min_drafts_for(tiny_target("llama")) <= 7


@pytest.mark.parametrize("path", ["custom_generate", "assistant_model"])
def test_both_entry_points_cut_to_the_measured_minimum(path, monkeypatch):
    """With a cut, decoding measures the minimum once (the plan's, the assistant session's) and never verifies fewer
    drafts; output is exact."""
    measured = []
    monkeypatch.setattr(assistant, "cheap_verify_width",
                        lambda target, forward=None: measured.append((target, getattr(forward, "kind", None))) or 3)
    target = tiny_target("llama")
    ids, _ = _prompt(1, 9, seed=1)
    plain = target.generate(ids, max_new_tokens=60, do_sample=False)
    drafter = _oracle(target, plain, None, 0.25, seed=1)
    drafter.boost = 7.0  # confidences spread over (0, 1), so the cut often falls below the minimum
    if path == "custom_generate":
        stats = DecodeStats()
        target.generate(ids, max_new_tokens=4, custom_generate=custom_generate, drafter=drafter,
                        draft_confidence=0.5, draft_tree=False)  # a second call: the plan is kept, not measured again
        out = target.generate(ids, max_new_tokens=60, do_sample=False, custom_generate=custom_generate,
                              drafter=drafter, draft_confidence=0.5, draft_tree=False, dscale_stats=stats)
        widths = [v - 1 for v in stats.verified[:-1]]  # drafts per forward; the last block may be cut by the budget
    else:
        widths = record_candidate_widths(monkeypatch)
        drafter.draft_confidence = 0.5
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, do_sample=False)  # the cut is kept, too
        widths.clear()
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=60, do_sample=False)
        widths = widths[1:-1]  # the first call proposes one token (no target features yet); the last is budget-cut
    assert torch.equal(plain, out)
    # Timed once, on the forward the verifies run: custom_generate's split head (conftest: at every width),
    # transformers' assisted loop's own target forward.
    assert measured == [(target, "split-head" if path == "custom_generate" else None)]
    assert min(widths) == 2 and widths.count(2) >= 2 and max(widths) > 3  # never the fallback 4 drafts here


def test_verify_costs_are_medians_of_interleaved_forwards():
    cost = {1: 42, 2: 47, 3: 50, 4: 69}
    target = CostedTarget(cost, spikes={2: 500, 4: 500})
    assert assistant.verify_costs(target, range(1, 5), clock=target.clock) == cost  # the spikes are outvoted
    assert target.calls == [1] + [1, 2, 3, 4] * 3  # warm-up, then the widths in turn


def test_verify_costs_for_measures_widths_one_to_max_at_the_batch_size(monkeypatch):
    calls = []

    def fake(target, widths, repeats=3, batch_size=1, clock=None, forward=None):
        calls.append((batch_size, list(widths)))
        return {w: float(w * batch_size) for w in widths}

    monkeypatch.setattr(assistant, "verify_costs", fake)
    target = tiny_target("llama")
    assert REAL_VERIFY_COSTS_FOR(target, 4) == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    assert REAL_VERIFY_COSTS_FOR(target, 3, batch_size=2) == {1: 2.0, 2: 4.0, 3: 6.0}
    assert calls == [(1, [1, 2, 3, 4]), (2, [1, 2, 3])]


def test_verify_costs_measured_on_the_real_tiny_target():
    """No fake clock: one positive cost per width."""
    costs = REAL_VERIFY_COSTS_FOR(tiny_target("llama"), 5)
    assert sorted(costs) == [1, 2, 3, 4, 5] and all(0 < s < 10 for s in costs.values())
