"""The draft vocabulary: proposals confined to frequent tokens plus the sequences' own, verification unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_dscale import DScaleDrafter
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.models.dscale import DraftVocab

from ..conftest import OracleDrafter, oracle_from, tiny_drafter, tiny_target
from ..generation.test_exactness import _prompt


def test_logits_are_the_heads_on_the_set_and_minus_inf_elsewhere():
    torch.manual_seed(0)
    head = nn.Linear(16, 3000, bias=True)
    vocab = DraftVocab(head, torch.tensor([5, 9, 3]), 3000)
    vocab.add(torch.tensor([[7, 7, 9], [-1, 3000, 11]]))  # repeats and ids outside the vocabulary are ignored
    assert sorted(vocab.ids.tolist()) == [3, 5, 7, 9, 11]
    vocab.add(torch.arange(100, 2100))  # past the spare room: the weights are copied into a larger buffer
    vocab.add([11, 2100, 2999, 3000, -5])  # host ids: the same rules
    assert vocab.size == 2007 and len(vocab.known) == 2007 and sorted(vocab.ids.tolist()) == sorted(vocab.known)
    hidden = torch.randn(2, 4, 16)
    full, part = head(hidden), vocab.logits(hidden)
    inside = torch.zeros(3000, dtype=torch.bool)
    inside[vocab.ids] = True
    torch.testing.assert_close(part[..., inside], full[..., inside])
    assert bool(torch.isneginf(part[..., ~inside]).all())
    compact = vocab.compact_logits(hidden)  # the set's columns only, in the order of `ids`
    assert compact.shape == (2, 4, 2007)
    torch.testing.assert_close(compact, full[..., vocab.ids])


def test_drafter_proposes_only_from_its_vocab_and_the_context():
    target = tiny_target("llama")
    drafter = tiny_drafter(target).bind_target(target)
    assert drafter.draft_vocab_for(torch.tensor([[1, 2]])) is None  # no draft vocab: the whole head
    drafter.set_draft_vocab([40, 41, 42])
    vocab = drafter.draft_vocab_for(torch.tensor([[7, 8, 7]]))
    assert sorted(vocab.ids.tolist()) == [7, 8, 40, 41, 42]
    from hf_dscale.models.dscale.assistant import TapRecorder

    recorder = TapRecorder(target, drafter.config.target_layer_ids)
    target(torch.tensor([[7, 8, 7]]))
    taps = recorder.taps()
    recorder.remove()
    args = (torch.tensor([[7]]), taps, torch.tensor([2]), torch.arange(3)[None], None)
    full, part = drafter.draft_logits(*args), drafter.draft_logits(*args, vocab=vocab)
    torch.testing.assert_close(part[..., vocab.ids], full[..., vocab.ids])
    assert set(part.argmax(-1).flatten().tolist()) <= {7, 8, 40, 41, 42}
    compact = drafter.draft_logits(*args, vocab=vocab, compact=True)
    torch.testing.assert_close(compact, full[..., vocab.ids])
    assert torch.equal(vocab.ids[compact.argmax(-1)], part.argmax(-1))  # the same greedy proposal


class _NoOp:
    """A logits processor that changes nothing; its presence sends the assistant down the full-vocabulary path."""

    def __call__(self, input_ids, scores):
        return scores


def test_assistant_compact_proposals_equal_the_full_vocabulary_ones(target, monkeypatch):
    """Greedy without processors, `assistant_model=` drafts over the draft vocabulary's columns only and spreads the
    kept drafts' scores back over the whole vocabulary: the same candidates and scores as the full path."""
    from hf_dscale.models.dscale.assistant import DScaleCandidateGenerator

    original = DScaleCandidateGenerator.get_candidates
    calls = {"compact": [], "full": []}
    path = "compact"

    def record(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        calls[path].append(tuple(t.clone() for t in out))
        return out

    monkeypatch.setattr(DScaleCandidateGenerator, "get_candidates", record)
    ids, _ = _prompt(1, 10, 0)
    for path, extra in [("compact", {}), ("full", {"logits_processor": [_NoOp()]})]:
        drafter = tiny_drafter(target)
        drafter.set_draft_vocab(torch.arange(0, target.config.vocab_size, 3))
        drafter.draft_confidence = 0.0  # whole blocks: every draft is compared
        target.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=drafter, **extra)
    assert len(calls["compact"]) == len(calls["full"]) > 2
    for (seq_c, scores_c), (seq_f, scores_f) in zip(calls["compact"], calls["full"]):
        assert torch.equal(seq_c, seq_f)
        assert scores_c.shape == scores_f.shape and scores_c.shape[-1] == target.config.vocab_size
        assert torch.equal(torch.isneginf(scores_c), torch.isneginf(scores_f))
        torch.testing.assert_close(scores_c, scores_f)


def test_set_draft_vocab_checks_and_round_trips(tmp_path):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    for bad in ([], [3, 3], [-1], [target.config.vocab_size]):
        with pytest.raises(ValueError, match="draft_vocab"):
            drafter.set_draft_vocab(bad)
    drafter.set_draft_vocab([30, 10, 20])
    drafter.save_pretrained(tmp_path / "with")
    loaded = DScaleDrafter.from_pretrained(tmp_path / "with")
    assert loaded.config.draft_vocab_size == 3 and loaded.draft_vocab.tolist() == [30, 10, 20]
    loaded.set_draft_vocab(None)
    loaded.save_pretrained(tmp_path / "without")
    again = DScaleDrafter.from_pretrained(tmp_path / "without")
    assert again.config.draft_vocab_size is None and again.draft_vocab is None
    with pytest.raises(ValueError, match="draft_vocab_size"):
        type(drafter.config)(**{**drafter.config.to_dict(), "draft_vocab_size": 10**6}).validate()


def _half_vocab_oracle(target, plain, seed=0):
    """An error-free oracle whose draft vocab holds only the even tokens (the odd ones come from the context)."""
    drafter = tiny_drafter(target, cls=OracleDrafter)
    drafter.oracle, drafter.error_rate = oracle_from(plain), 0.0
    drafter.set_draft_vocab(torch.arange(0, target.config.vocab_size, 2))
    torch.manual_seed(seed)
    return drafter


@pytest.mark.parametrize("entry", ["custom_generate", "assistant_model", "d2sd"])
def test_greedy_identity_with_a_draft_vocab(target, entry):
    for seed in range(3):
        ids, _ = _prompt(1, 8 + 3 * seed, seed)
        plain = target.generate(ids, max_new_tokens=30, do_sample=False)
        drafter = _half_vocab_oracle(target, plain, seed)
        kwargs = {"assistant_model": drafter}
        stats = DecodeStats()
        if entry != "assistant_model":
            kwargs = {"custom_generate": custom_generate, "drafter": drafter, "dscale_stats": stats}
        if entry == "d2sd":
            kwargs["vp_drafter"] = _half_vocab_oracle(target, plain, seed)
        spec = target.generate(ids, max_new_tokens=30, do_sample=False, **kwargs)
        assert torch.equal(plain, spec), f"seed {seed}"
        if entry != "assistant_model":
            assert stats.tau > 2.0  # the oracle is still followed where its tokens are in the set


def _block_ends(stats: DecodeStats) -> set[int]:
    """Indices of generated tokens the target chose itself (a correction or a bonus): the prefill's, each cycle's last."""
    ends, length = {0}, 1
    for committed in stats.committed:
        length += committed
        ends.add(length - 1)
    return ends


def test_a_token_outside_the_set_is_never_proposed_until_it_appears(target):
    """Excluded tokens are left to the target the first time they occur (each first occurrence ends a block);
    once in the sequence they join the set. The output stays the target's."""
    for seed in range(20):  # a prompt whose answer brings new tokens after its first one
        ids, _ = _prompt(1, 8, seed)
        plain = target.generate(ids, max_new_tokens=30, do_sample=False)
        generated = plain[0, ids.shape[1]:].tolist()
        excluded = set(generated) - set(ids[0].tolist())
        first = {generated.index(t) for t in excluded} - {0}
        if first:
            break
    stats = {}
    for name, vocab in [("whole", None), ("excluding", [t for t in range(target.config.vocab_size) if t not in excluded])]:
        drafter = _half_vocab_oracle(target, plain)
        drafter.set_draft_vocab(vocab)
        stats[name] = DecodeStats()
        spec = target.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=custom_generate,
                               drafter=drafter, dscale_stats=stats[name])
        assert torch.equal(plain, spec)
    assert first <= _block_ends(stats["excluding"])
    assert not first <= _block_ends(stats["whole"])  # with the whole vocabulary the oracle drafts them
