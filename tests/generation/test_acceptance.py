"""Acceptance rules: worked examples, and losslessness measured statistically.

The statistical tests draw many independent rows in one call and compare the empirical distribution of
the committed tokens with the target's p by a chi-square test. Each test also runs a deliberately
broken rule through the same check and requires it to be rejected, so the check has teeth.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from hf_dscale.engine import acceptance
from hf_dscale.engine.acceptance import greedy_accept, speculative_accept


def test_greedy_accept_worked_example():
    draft = torch.tensor([[5, 7, 9], [5, 7, 9], [1, 7, 9]])
    target = torch.nn.functional.one_hot(torch.tensor([[5, 7, 2, 4], [5, 7, 9, 4], [5, 7, 9, 4]]), 12).float()
    num_accepted, output = greedy_accept(draft, target)
    assert num_accepted.tolist() == [2, 3, 0]
    assert output[0, :3].tolist() == [5, 7, 2]  # two accepted, then the recovered token
    assert output[1].tolist() == [5, 7, 9, 4]  # all accepted, then the bonus token
    assert output[2, :1].tolist() == [5]


def _case(seed: int, vocab: int = 6, k: int = 2):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    return p, q


def _committed_first_tokens(rule, p, q, rows: int, seed: int) -> torch.Tensor:
    """First committed token of each of `rows` independent draws (drafts sampled from q)."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=g) for j in range(q.shape[0])], 1)
    num_accepted, output = rule(draft, q.expand(rows, -1, -1), p.expand(rows, -1, -1), generator=g)
    return output[:, 0], output, num_accepted


def _pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of `samples` against `probs` (0 if an impossible token shows up)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    keep = expected > 0
    if counts[~keep].sum() > 0:
        return 0.0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def _broken_recovered_from_p(draft_ids, q_probs, p_probs, generator=None):
    """Wrong: at a rejection it resamples from p instead of norm(max(p - q, 0))."""
    num_accepted, output = speculative_accept(draft_ids, q_probs, p_probs, generator)
    rows = torch.arange(draft_ids.shape[0])
    resample = torch.multinomial(p_probs[rows, num_accepted], 1, generator=generator).squeeze(1)
    rejected = num_accepted < draft_ids.shape[1]
    output[rows[rejected], num_accepted[rejected]] = resample[rejected]
    return num_accepted, output


def _broken_sample_then_match_with_q_ratio(draft_ids, q_probs, p_probs, generator=None):
    """Wrong: accepts with probability min(1, q/p) (ratio inverted)."""
    return speculative_accept(draft_ids, p_probs[:, : q_probs.shape[1]], torch.cat((q_probs, p_probs[:, -1:]), 1),
                              generator)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_accept_is_lossless(seed):
    p, q = _case(seed)
    first, output, num_accepted = _committed_first_tokens(speculative_accept, p, q, 200_000, seed)
    assert _pvalue(first, p[0]) > 1e-4
    # Second position: given the first draft was accepted, the next committed token is ~ p[1]
    # (p here does not depend on the prefix, as for a context-free toy target).
    second = output[num_accepted >= 1, 1]
    assert _pvalue(second, p[1]) > 1e-4
    assert 0 < (num_accepted == 0).float().mean() < 1  # rejections and acceptances both happen


@pytest.mark.parametrize("broken", [_broken_recovered_from_p, _broken_sample_then_match_with_q_ratio])
def test_statistical_check_catches_a_broken_rule(broken):
    p, q = _case(0)
    first, _, _ = _committed_first_tokens(broken, p, q, 200_000, 0)
    assert _pvalue(first, p[0]) < 1e-6


def test_all_accepted_gives_bonus_from_last_target_distribution():
    p, _ = _case(4)
    q = p[:2].clone()  # q == p: every draft is accepted
    _, output, num_accepted = _committed_first_tokens(speculative_accept, p, q, 100_000, 4)
    assert bool((num_accepted == 2).all())
    assert _pvalue(output[:, 2], p[2]) > 1e-4


def test_module_exports_the_rules():
    assert acceptance.speculative_accept is speculative_accept
