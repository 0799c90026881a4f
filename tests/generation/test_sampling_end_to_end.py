"""Sampling through the real entry points leaves the target's distribution unchanged.

A tiny target with an 8-token vocabulary; the exact marginals of the first three sampled tokens are
enumerated (1 + 8 + 64 prefixes) and compared with the empirical marginals of speculative sampling.
"""

from __future__ import annotations


import pytest
import torch
from transformers import NoRepeatNGramLogitsProcessor

from hf_dscale.engine import accept
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.models.dscale import assistant

from ..conftest import tiny_drafter, tiny_target
from .test_acceptance import _broken_recovered_from_p, _pvalue

VOCAB, TEMPERATURE, NEW = 8, 0.7, 3


def _exact_marginals(target, prompt, no_repeat: bool = False):
    marginals = []
    prefixes, weights = [()], torch.ones(1)
    for _ in range(NEW):
        batch = torch.tensor([prompt + list(p) for p in prefixes])
        logits = target(batch).logits[:, -1].float()
        if no_repeat:  # as generate() applies it, before the temperature: no token twice
            logits = NoRepeatNGramLogitsProcessor(1)(batch, logits)
        probs = torch.softmax(logits / TEMPERATURE, -1)  # [n, V]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(0))
        prefixes = [p + (t,) for p in prefixes for t in range(VOCAB)]
        weights = joint.reshape(-1)
    return marginals


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", vocab=VOCAB, seed=3)
    drafter = tiny_drafter(target, block_size=4)
    prompt = [1, 5, 2, 6, 3]
    with torch.no_grad():
        exact = _exact_marginals(target, prompt)
    return target, drafter, prompt, exact


def _custom_samples(target, drafter, prompt, rows=6000, seed=0, **kwargs):
    torch.manual_seed(seed)
    ids = torch.tensor([prompt] * rows)
    out = target.generate(ids, max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE, top_k=None, top_p=None,
                          custom_generate=custom_generate, drafter=drafter, **kwargs)
    return out[:, len(prompt):]


def test_custom_generate_sampling_matches_target(setup):
    target, drafter, prompt, exact = setup
    samples = _custom_samples(target, drafter, prompt)
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"


@pytest.mark.parametrize("cut", [0.2, "auto"])
def test_sampling_with_a_cut_matches_target(setup, monkeypatch, cut):
    """Blocks narrowed by `draft_confidence` (a confidence cut, or the throughput cut over conftest's CPU-like
    verify costs; both decided from q's top probabilities, never from the drawn tokens) keep the target's
    distribution."""
    target, drafter, prompt, exact = setup
    monkeypatch.setattr(assistant, "min_drafts_for", lambda target, forward=None: 1)  # blocks of only 3 drafts
    stats = DecodeStats()
    samples = _custom_samples(target, drafter, prompt, draft_confidence=cut, seed=2, dscale_stats=stats)
    assert min(stats.verified) < drafter.config.block_size  # the cut did narrow the blocks
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"


@pytest.mark.parametrize("tree", [False, True])
def test_sampling_with_the_verify_compiled_matches_target(setup, tree):
    """The compiled verify (`compile=True`): a chain (speculative sampling's rule) and a tree (sample, then match)."""
    target, drafter, prompt, exact = setup
    stats = DecodeStats()
    samples = _custom_samples(target, drafter, prompt, rows=1500, seed=5, compile=True, draft_tree=tree,
                              dscale_stats=stats)
    assert stats.plan.verify_path == "compiled" and stats.plan.tree == tree
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"


def test_sampling_on_a_tree_under_processors_matches_target(setup):
    """A token tree sampled under a logits processor that reads the path (no token twice: `no_repeat_ngram_size=1`),
    then the temperature: each node's logits are processed for its own path and every node is drawn at once; the walk
    keeps the target's distribution under those processors (which a node processed for another path would not)."""
    target, drafter, prompt, _ = setup
    with torch.no_grad():
        exact = _exact_marginals(target, prompt, no_repeat=True)
    stats = DecodeStats()
    samples = _custom_samples(target, drafter, prompt, rows=1500, seed=4, draft_tree=True, no_repeat_ngram_size=1,
                              dscale_stats=stats)
    assert stats.plan.tree and max(stats.verified) > 2  # trees, with nodes the walk may not visit
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"
    assert all(len(set(row)) == NEW and not set(row) & set(prompt) for row in samples.tolist())


def test_custom_generate_check_catches_broken_rule(setup, monkeypatch):
    target, drafter, prompt, exact = setup
    monkeypatch.setattr(accept, "speculative_accept", _broken_recovered_from_p)
    samples = _custom_samples(target, drafter, prompt)
    assert min(_pvalue(samples[:, j], exact[j]) for j in range(1, NEW)) < 1e-6


def test_assistant_model_sampling_matches_target(setup):
    target, drafter, prompt, exact = setup
    torch.manual_seed(1)
    ids = torch.tensor([prompt])
    samples = torch.stack([
        target.generate(ids, assistant_model=drafter, max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE,
                        top_k=None, top_p=None)[0, len(prompt):]
        for _ in range(1500)
    ])
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"


def test_sampling_with_a_draft_vocab_matches_target(setup):
    """q is zero outside the draft vocab; the target's mass there comes back through the residual."""
    target, _, prompt, exact = setup
    drafter = tiny_drafter(target, block_size=4)
    drafter.set_draft_vocab([4])  # with the prompt's tokens 1, 2, 3, 5, 6: tokens 0 and 7 are never drafted
    outside = torch.tensor([0, 7])
    assert all(float(m[outside].sum()) > 0.05 for m in exact)  # the check covers that mass
    samples = _custom_samples(target, drafter, prompt, seed=3)
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"
