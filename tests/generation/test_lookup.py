"""Prompt lookup as a token-tree branch: the lookup itself, its learnt chances, the tree it joins, and decoding
with it (greedy identity, lossless sampling, more tokens per forward where the output repeats its context)."""

from __future__ import annotations

import pytest
import torch

from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.engine.proposers import throughput_tree
from hf_dscale.engine.lookup import PromptLookup

from ..conftest import fix_verify_costs, oracle_from, tiny_drafter
from .test_acceptance import _pvalue
from .test_d2sd import _RunnerUpOracle, _tree_samples
from .test_exactness import _prompt
from .test_sampling_end_to_end import NEW, setup  # noqa: F401  (module fixture)


def test_lookup_worked_example():
    lookup = PromptLookup([5, 6, 7, 9, 5, 6])
    assert lookup.propose(4) == ([7, 9, 5, 6], 2)  # the docstring's example
    assert lookup.propose(6) == ([7, 9, 5, 6, 7, 9], 2)  # the copy goes on with what it copied: a loop
    assert lookup.propose(2) == ([7, 9], 2)
    lookup.extend([8])  # [.., 5, 6, 8]: no earlier [6, 8] or [8]
    assert lookup.propose(4) == ([], 0)
    lookup.extend([9])  # [.., 8, 9]: only the 1-gram [9] was seen before (position 3)
    assert lookup.propose(4) == ([5, 6, 8, 9], 1)
    assert PromptLookup([3, 3]).propose(3) == ([3, 3, 3], 1)  # a token repeated


def test_lookup_prefers_the_longest_and_the_latest_match():
    # [1, 2] occurs twice (continued by 3, then by 4); the suffix [0, 1, 2] only once (continued by 4).
    lookup = PromptLookup([1, 2, 3, 0, 1, 2, 4, 0, 1, 2], max_ngram=3)
    assert lookup.propose(1) == ([4], 3)
    shorter = PromptLookup([1, 2, 3, 0, 1, 2, 4, 9, 1, 2], max_ngram=3)  # [9, 1, 2] unseen: the latest [1, 2]
    assert shorter.propose(1) == ([4], 2)
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookup([1], max_ngram=0)


def test_lookup_chances_start_at_the_prior_and_learn_from_the_target():
    lookup = PromptLookup([1, 2, 3], prior_rate=0.5, prior_weight=2.0)
    assert lookup.chances(2, 3) == pytest.approx([0.5, 0.25, 0.125])
    # Right at depth 1, wrong at depth 2; depth 3 is then not a trial.
    lookup.record([7, 8, 9], 2, [7, 5, 9])
    assert lookup.chances(2, 3) == pytest.approx([2 / 3, 2 / 3 * 1 / 3, 2 / 3 * 1 / 3 * 0.5])
    # The target decided only two tokens (the walk stopped): depth 3 is not counted either way.
    lookup.record([7, 8, 9], 2, [7, 8])
    assert lookup.chances(2, 3) == pytest.approx([3 / 4, 3 / 4 * 2 / 4, 3 / 4 * 2 / 4 * 0.5])
    assert lookup.chances(1, 1) == pytest.approx([0.5])  # learnt per match length
    assert all(a >= b for a, b in zip(lookup.chances(2, 3), lookup.chances(2, 3)[1:]))


def test_throughput_tree_takes_a_likely_lookup_path_and_merges_shared_nodes():
    # The drafter: spine [7, 4, 4, 4] with confidences 0.9, 0.5, 0.5, 0.5. A lookup path [7, 4, 6, 2] believed at
    # 0.95, 0.9, 0.8, 0.7: its first two nodes are the spine's (counted once, at the better chance) and its last
    # two join the tree ahead of the spine's deeper nodes.
    probs = torch.tensor([[0.0025] * 10] + [[0.055] * 10] * 3)
    probs[0, 7], probs[0, 3] = 0.9, 0.08
    probs[1:, 4], probs[1:, 2] = 0.5, 0.06
    logits, spine, confidences = probs.log(), torch.tensor([7, 4, 4, 4]), torch.tensor([0.9, 0.5, 0.5, 0.5])
    flat = {w: 1.0 for w in range(1, 6)}
    extra = (([7, 4, 6, 2], [0.95, 0.9, 0.8, 0.7]),)
    paths = throughput_tree(logits, spine, confidences, 1, flat, extra=extra)
    assert paths == [[7], [7, 4], [7, 4, 6], [7, 4, 6, 2]]  # by chance, each node once
    # Without the lookup the same width holds the spine: 0.9, 0.45, 0.225, 0.1125 (the runner-up [3] is 0.08).
    assert throughput_tree(logits, spine, confidences, 1, flat) == [[7], [7, 4], [7, 4, 4], [7, 4, 4, 4]]
    # An unlikely lookup path is weighed like any node: steep costs leave it out.
    steep = {1: 1.0, 2: 1.1, 3: 3.0, 4: 4.0, 5: 5.0}
    assert throughput_tree(logits, spine, confidences, 1, steep, extra=(([5, 5], [0.01, 0.001]),)) == [[7]]


def test_prompt_lookup_greedy_identity_random_drafter(target):
    drafter, vp = tiny_drafter(target), tiny_drafter(target, seed=7)
    for seed, (length, new) in enumerate([(5, 17), (12, 40)]):
        ids, _ = _prompt(1, length, seed)
        plain = target.generate(ids, max_new_tokens=new, do_sample=False)
        kw = dict(max_new_tokens=new, do_sample=False, custom_generate=custom_generate, drafter=drafter,
                  prompt_lookup=True)
        for extra in (dict(draft_tree=True), dict(draft_tree=True, draft_confidence=0), dict(vp_drafter=vp)):
            assert torch.equal(plain, target.generate(ids, **kw, **extra)), extra


def test_prompt_lookup_commits_more_where_the_output_repeats_itself(target, monkeypatch):
    """The tiny targets' greedy outputs fall into loops (as small models' do): the lookup proposes the loop, and
    with a drafter that is wrong more often than right the tree with it commits far more per forward."""
    ids, _ = _prompt(1, 6, seed=2)
    plain = target.generate(ids, max_new_tokens=60, do_sample=False)
    drafter = tiny_drafter(target, cls=_RunnerUpOracle)
    drafter.oracle, drafter.error_rate = oracle_from(plain), 0.6
    flat = {w: 1.0 for w in range(1, drafter.config.block_size + 1)}
    fix_verify_costs(monkeypatch, flat)
    stats = {}
    for lookup in (False, True):
        torch.manual_seed(0)
        stats[lookup] = DecodeStats()
        out = target.generate(ids, max_new_tokens=60, do_sample=False, custom_generate=custom_generate,
                              drafter=drafter, draft_tree=True, draft_confidence="auto", prompt_lookup=lookup,
                              dscale_stats=stats[lookup])
        assert torch.equal(plain, out)
    assert stats[True].tau > 1.3 * stats[False].tau


def test_prompt_lookup_needs_a_tree(target):
    ids, _ = _prompt(1, 5, seed=0)
    with pytest.raises(ValueError, match="drop draft_tree=False"):
        target.generate(ids, max_new_tokens=4, custom_generate=custom_generate, drafter=tiny_drafter(target),
                        prompt_lookup=True, draft_tree=False)


def test_prompt_lookup_sampling_through_generate_matches_target(setup):  # noqa: F811
    target, drafter, prompt, exact = setup
    samples = _tree_samples(target, drafter, None, prompt, seed=6, draft_tree=True, prompt_lookup=True)
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"
