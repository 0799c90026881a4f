"""Greedy speculative output equals plain `generate()` token for token, on every entry point."""

from __future__ import annotations

import pytest
import torch
from transformers import TextIteratorStreamer

from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.models.dscale.assistant import AUTO, draft_length, resolve_draft_confidence, throughput_length
from hf_dscale.models.dscale import assistant

from ..conftest import MASK_ID, OracleDrafter, cpu_like_costs, oracle_from, tiny_drafter, tiny_target


def _prompt(batch: int, length: int, seed: int, ragged: bool = True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MASK_ID, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if ragged and batch > 1:
        for b in range(batch):
            pad = int(torch.randint(0, length - 1, (), generator=g))
            mask[b, :pad] = 0
            ids[b, :pad] = 0
    return ids, mask


def _oracle(target, reference, mask, error_rate, seed=0, block_size=8):
    drafter = tiny_drafter(target, cls=OracleDrafter, block_size=block_size)
    drafter.oracle, drafter.error_rate = oracle_from(reference, mask), error_rate
    torch.manual_seed(seed)
    return drafter


@pytest.mark.parametrize("fusion", ["layerwise", "shared"])
def test_assistant_model_greedy_identity_random_drafter(target, fusion):
    drafter = tiny_drafter(target, fusion=fusion)
    for seed, (length, new) in enumerate([(5, 17), (12, 40), (30, 9)]):
        ids, _ = _prompt(1, length, seed)
        plain = target.generate(ids, max_new_tokens=new, do_sample=False)
        spec = target.generate(ids, assistant_model=drafter, max_new_tokens=new, do_sample=False)
        assert torch.equal(plain, spec)


@pytest.mark.parametrize("error_rate", [0.0, 0.1, 0.4])
def test_assistant_model_greedy_identity_long_accepts(target, error_rate):
    for seed in range(4):
        ids, _ = _prompt(1, 6 + 3 * seed, seed)
        new = 20 + 7 * seed
        plain = target.generate(ids, max_new_tokens=new, do_sample=False)
        drafter = _oracle(target, plain, None, error_rate, seed)
        spec = target.generate(ids, assistant_model=drafter, max_new_tokens=new, do_sample=False)
        assert torch.equal(plain, spec), f"seed {seed}"


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("error_rate", [0.0, 0.25])
def test_custom_generate_batched_greedy_identity(target, batch, error_rate):
    for seed in range(3):
        ids, mask = _prompt(batch, 9 + 2 * seed, seed)
        new = 15 + 9 * seed
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        drafter = _oracle(target, plain, mask, error_rate, seed)
        stats = DecodeStats()
        spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                               custom_generate=custom_generate, drafter=drafter, dscale_stats=stats)
        assert torch.equal(plain, spec), f"seed {seed}"
        if error_rate == 0.0:
            assert stats.tau > 3.0  # the oracle is followed: blocks are accepted, not just bonus tokens


def test_eos_inside_a_block_and_rows_finishing_apart():
    probe = tiny_target("llama")
    ids, mask = _prompt(3, 8, seed=5)
    free = probe.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    eos = int(free[0, ids.shape[1] + 10])  # a token row 0 emits mid-way
    target = tiny_target("llama", eos=eos)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert (plain[:, ids.shape[1]:] == eos).any()
    drafter = _oracle(target, plain, mask, error_rate=0.0)
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                           custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(plain, spec)
    one = target.generate(ids[:1], max_new_tokens=30, do_sample=False)
    drafter = _oracle(target, one, None, error_rate=0.0)
    assert torch.equal(one, target.generate(ids[:1], assistant_model=drafter, max_new_tokens=30, do_sample=False))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_assistant_blocks_running_past_eos_stop_at_it(family):
    """The assistant knows what the target would emit after its EOS (a probe that does not stop there), so whole
    blocks past the EOS are accepted: `generate(assistant_model=)` must still end at the EOS, on every supported
    transformers (5.17's assisted loop keeps every accepted token; later ones crop at an EOS themselves)."""
    probe = tiny_target(family)
    ids, _ = _prompt(1, 8, seed=3, ragged=False)
    free = probe.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:].tolist()
    at = next(i for i in range(8, len(free)) if free[i] not in free[:i])  # a token first emitted mid-way
    target = tiny_target(family, eos=free[at])
    plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    assert plain.shape[1] == ids.shape[1] + at + 1
    drafter = _oracle(target, probe.generate(ids, max_new_tokens=30, do_sample=False), None, error_rate=0.0)
    assert torch.equal(plain, target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False))


def test_assistant_model_refuses_stops_it_cannot_check_before_generating():
    """transformers' assisted loop checks the stopping criteria once a block: a stop string or a criterion of the
    user's own is refused with a clear error before the target runs; length, time and EOS criteria are fine."""
    from transformers import MaxTimeCriteria, StoppingCriteriaList, StopStringCriteria

    from .test_fuzz import CHARACTERS

    target = tiny_target("llama")
    ids, _ = _prompt(1, 8, seed=3, ragged=False)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    forwards = []
    target.register_forward_pre_hook(lambda *a: forwards.append(1))
    for kw in (dict(stop_strings=["ab"], tokenizer=CHARACTERS),
               dict(stopping_criteria=StoppingCriteriaList([StopStringCriteria(CHARACTERS, ["ab"])]))):
        with pytest.raises(ValueError, match="custom_generate"):
            target.generate(ids, assistant_model=_oracle(target, plain, None, 0.0), max_new_tokens=20,
                            do_sample=False, **kw)
        assert not forwards, kw
    criteria = StoppingCriteriaList([MaxTimeCriteria(60.0)])
    spec = target.generate(ids, assistant_model=_oracle(target, plain, None, 0.0), max_new_tokens=20,
                           do_sample=False, stopping_criteria=criteria)
    assert torch.equal(plain, spec)


@pytest.mark.parametrize("new", [1, 2, 5, 7, 8, 9, 13])
def test_max_new_tokens_inside_a_block(new):
    target = tiny_target("qwen3")
    ids, _ = _prompt(1, 7, seed=new)
    plain = target.generate(ids, max_new_tokens=new, do_sample=False)
    for entry in ("assistant", "custom"):
        drafter = _oracle(target, plain, None, error_rate=0.0)
        kw = (dict(assistant_model=drafter) if entry == "assistant"
              else dict(custom_generate=custom_generate, drafter=drafter))
        assert torch.equal(plain, target.generate(ids, max_new_tokens=new, do_sample=False, **kw)), entry


def test_mask_token_in_output_is_kept():
    target = tiny_target("llama")
    ids, _ = _prompt(1, 6, seed=3)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    emitted = int(plain[0, -5])
    drafter = tiny_drafter(target)
    drafter.config.mask_token_id = emitted  # the drafter fills masks with a token the target really emits
    for kw in (dict(assistant_model=drafter), dict(custom_generate=custom_generate, drafter=drafter)):
        spec = target.generate(ids, max_new_tokens=24, do_sample=False, **kw)
        assert torch.equal(plain, spec)
        assert (spec[0, ids.shape[1]:] == emitted).any()


def test_logits_processors_stop_strings_and_return_dict():
    target = tiny_target("llama")
    ids, _ = _prompt(1, 8, seed=11)
    kw = dict(max_new_tokens=30, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2,
              return_dict_in_generate=True)
    plain = target.generate(ids, **kw)
    for extra in (dict(assistant_model=_oracle(target, plain.sequences, None, 0.2)),
                  dict(custom_generate=custom_generate, drafter=_oracle(target, plain.sequences, None, 0.2))):
        spec = target.generate(ids, **kw, **extra)
        assert torch.equal(plain.sequences, spec.sequences)


def test_streamer_receives_exactly_the_output():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(MASK_ID + 1)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    target = tiny_target("llama")
    ids, _ = _prompt(1, 5, seed=2)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    spec = target.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=custom_generate,
                           drafter=_oracle(target, plain, None, 0.2), streamer_=streamer)
    assert torch.equal(plain, spec)
    streamed = "".join(streamer).split()
    assert streamed == tokenizer.convert_ids_to_tokens(plain[0, ids.shape[1]:].tolist())


def test_hub_style_custom_generate_folder():
    import os

    folder = os.path.join(os.path.dirname(__file__), "..", "..", "model_cards", "hf-dscale-generate")
    target = tiny_target("llama")
    ids, mask = _prompt(2, 7, seed=21)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=18, do_sample=False)
    drafter = _oracle(target, plain, mask, error_rate=0.2)
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=18, do_sample=False,
                           custom_generate=os.path.abspath(folder), trust_remote_code=True, drafter=drafter)
    assert torch.equal(plain, spec)


def test_batched_repetition_penalty_with_left_padding():
    """Processors that keep per-row state (the penalty skips each row's padding) see the whole batch."""
    target = tiny_target("qwen3")
    ids, mask = _prompt(3, 10, seed=5)
    kw = dict(max_new_tokens=25, do_sample=False, repetition_penalty=1.4)
    plain = target.generate(input_ids=ids, attention_mask=mask, **kw)
    drafter = _oracle(target, plain, mask, 0.2)
    spec = target.generate(input_ids=ids, attention_mask=mask, **kw, custom_generate=custom_generate, drafter=drafter)
    assert torch.equal(plain, spec)


def test_draft_length_is_the_confident_head_of_the_widest_active_row():
    def logits(*confidences):  # two-token vocabulary: top probability c >= 0.5 -> logits [log c, log(1-c)]
        c = torch.tensor(confidences)
        return torch.stack((c.log(), (1 - c).log()), -1)

    rows = torch.stack((logits(0.9, 0.8, 0.6, 0.9, 0.9), logits(0.95, 0.95, 0.95, 0.95, 0.95)))
    assert draft_length(rows[:1], 0.5, minimum=1) == 2  # cumulative 0.9, 0.72, 0.43 -> the third falls below
    assert draft_length(rows[:1], 0.5) == assistant.FALLBACK_MIN_DRAFTS == 4  # no minimum given: the fallback
    assert draft_length(rows, 0.5, minimum=1) == 5  # the second row keeps all five, and rows share the block
    assert draft_length(rows, 0.5, active=[True, False], minimum=1) == 2  # a finished row does not widen it
    assert draft_length(rows[:1], 0.95, minimum=0) == 1  # at least one draft
    assert draft_length(rows[:, :2], 0.5) == 2  # the minimum is capped by the block
    assert draft_length(rows, 0.0) == 5  # 0 = the whole block


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind, cut, boost", [
    ("llama", 0.5, 7.0),  # confidences spread over (0, 1), so the confidence cut lands anywhere in the block
    ("qwen3", "auto", 6.0),  # top probabilities about 0.7: whether the cost's jump at 4 tokens pays off varies
])
def test_cuts_keep_greedy_identity_and_vary_the_blocks(batch, kind, cut, boost):
    target = tiny_target(kind)
    for seed in range(2):
        ids, mask = _prompt(batch, 8 + 3 * seed, seed)
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
        drafter = _oracle(target, plain, mask, 0.25, seed)
        drafter.boost = boost
        stats = DecodeStats()
        spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                               custom_generate=custom_generate, drafter=drafter, draft_confidence=cut,
                               draft_tree=False, dscale_stats=stats)
        assert torch.equal(plain, spec), f"seed {seed}"
        assert len(set(stats.verified)) > 1 and max(stats.verified) <= drafter.config.block_size
        if cut == "auto":
            assert min(stats.verified) < 4  # below the confidence cut's minimum: the costs jump at 4 tokens


def test_custom_generate_reads_the_drafters_draft_confidence():
    """Without the keyword, custom_generate takes `drafter.draft_confidence`, and without that the CPU's cut."""
    target = tiny_target("llama")
    ids, mask = _prompt(2, 9, 0)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    drafter = _oracle(target, plain, mask, 0.25)
    drafter.boost = 5.0  # confidences low enough for the CPU's default to cut
    verified = {}
    for setting in (0.0, None):
        drafter.draft_confidence, stats = setting, DecodeStats()
        spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                               custom_generate=custom_generate, drafter=drafter, draft_tree=False, dscale_stats=stats)
        assert torch.equal(plain, spec)
        verified[setting] = set(stats.verified)
    assert verified[0.0] == {drafter.config.block_size}  # whole blocks, though the target is on the CPU
    assert min(verified[None]) < drafter.config.block_size


def test_draft_confidence_defaults_to_the_throughput_cut_on_the_cpu_only():
    assert resolve_draft_confidence(None, "cpu") == AUTO == "auto"  # wide verifies cost more there
    assert resolve_draft_confidence(None, torch.device("cuda", 0)) == 0.0  # the whole block costs about one step
    assert resolve_draft_confidence(0.0, "cpu") == 0.0 and resolve_draft_confidence(0.3, "cuda") == 0.3
    assert resolve_draft_confidence("Auto", "cuda") == AUTO  # asked for by name anywhere
    for bad in (-0.1, 1.0, "fast"):
        with pytest.raises(ValueError, match="draft_confidence must be 'auto' or a number"):
            resolve_draft_confidence(bad, "cpu")


def _confidences(*rows):
    """Logits over a two-token vocabulary whose top probabilities are the given confidences (each >= 0.5)."""
    c = torch.tensor(rows)
    return torch.stack((c.log(), (1 - c).log()), -1)


def test_throughput_length_picks_the_most_tokens_per_second():
    costs = {1: 35.0, 2: 40.0, 3: 42.0, 4: 54.0, 5: 55.0, 6: 56.0}
    # The docstring's example: 1.9 / 50, 2.62 / 52, 2.98 / 64, 3.16 / 65, 3.25 / 66 -> 2 drafts.
    assert throughput_length(_confidences([0.9, 0.8, 0.5, 0.5, 0.5]), costs, overhead=10.0) == 2
    # Confident all the way: the extra tokens pay for the wider verify.
    assert throughput_length(_confidences([0.99] * 5), costs, overhead=10.0) == 5
    # Unsure from the start: two drafts (1.75 / 52 beats 1.5 / 50 and 1.875 / 64).
    assert throughput_length(_confidences([0.5] * 5), costs, overhead=10.0) == 2
    # ... unless the second draft's verify costs as much as the jump: then one.
    assert throughput_length(_confidences([0.5] * 5), costs | {3: 54.0}, overhead=10.0) == 1
    # A large overhead makes width cheap relatively: same confidences, more drafts.
    assert throughput_length(_confidences([0.9, 0.8, 0.5, 0.5, 0.5]), costs, overhead=1000.0) == 5
    # Flat costs (a GPU): every draft adds expected tokens for free, so the whole block.
    assert throughput_length(_confidences([0.6, 0.5, 0.5, 0.5, 0.5]), {w: 20.0 for w in range(1, 7)}) == 5
    # Rows share the width and their expectations add up; a finished row counts for nothing.
    rows = torch.cat((_confidences([0.5] * 5), _confidences([0.99] * 5)))
    assert throughput_length(rows, costs, 10.0) == 5
    assert throughput_length(rows, costs, 10.0, active=[True, False]) == 2


def test_draft_cut_for_target_dispatches_on_the_setting():
    target = tiny_target("llama")
    auto = assistant.DraftCut.for_target(target, AUTO, block_size=6)
    assert auto.costs == cpu_like_costs(6)  # conftest's table, one cost per verify width 1..6
    confident = _confidences([0.9, 0.8, 0.6, 0.9, 0.9])
    assert auto.length(confident) == throughput_length(confident, cpu_like_costs(6))
    threshold = assistant.DraftCut.for_target(target, 0.5, block_size=6)
    assert (threshold.costs, threshold.threshold, threshold.minimum) == (None, 0.5, 4)  # MIN_DRAFTS in conftest
    assert threshold.length(confident) == 4 and assistant.DraftCut.for_target(target, 0.0, 6).length(confident) == 5


def record_candidate_widths(monkeypatch) -> list[int]:
    """A list that fills with the number of drafts each `assistant_model=` call proposes."""
    widths = []
    get_candidates = assistant.DScaleCandidateGenerator.get_candidates

    def spy(self, input_ids, **kwargs):
        sequences, scores = get_candidates(self, input_ids, **kwargs)
        widths.append(sequences.shape[1] - input_ids.shape[1])
        return sequences, scores

    monkeypatch.setattr(assistant.DScaleCandidateGenerator, "get_candidates", spy)
    return widths


@pytest.mark.parametrize("confidence, boost", [(None, 6.0), (0.5, 7.0)])
def test_assistant_model_proposes_the_head_of_each_block(confidence, boost, monkeypatch):
    """`generate(assistant_model=drafter)` cuts blocks like custom_generate (by default on the CPU), exactly."""
    target = tiny_target("llama")
    widths = record_candidate_widths(monkeypatch)
    for seed in range(2):
        ids, _ = _prompt(1, 8 + 3 * seed, seed)
        plain = target.generate(ids, max_new_tokens=30, do_sample=False)
        drafter = _oracle(target, plain, None, 0.25, seed)
        drafter.boost, drafter.draft_confidence = boost, confidence  # confidences spread over (0, 1)
        assert torch.equal(plain, target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False))
    if confidence is None:  # the throughput cut: narrow blocks where unsure (the costs jump at 4 tokens), wide ones
        assert min(widths[1:]) <= 2 and max(widths) > 4
    else:  # blocks cut to the minimum, more often than the two ends of the generations could, and not all alike
        assert widths.count(4) > 2 and 4 < max(widths)
    assert max(widths) <= drafter.config.block_size - 1


def test_draft_confidence_is_checked():
    target = tiny_target("llama")
    ids, _ = _prompt(1, 6, 0)
    with pytest.raises(ValueError, match="draft_confidence"):
        target.generate(ids, max_new_tokens=4, custom_generate=custom_generate, drafter=tiny_drafter(target),
                        draft_confidence=1.0)
