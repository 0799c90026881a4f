"""Data generation and training on a tiny target: learning happens, resuming is exact."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_dscale import DScaleDrafter
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.training.data import (
    frequent_tokens,
    generate_data,
    iter_samples,
    length_sorted_batches,
    load_meta,
    read_shard,
    shard_names,
    top_up,
)
from hf_dscale.training.losses import weighted_cross_entropy
from hf_dscale.training import trainer
from hf_dscale.training.trainer import TargetTaps, TrainConfig, batch_loss, sequence_loss, train_drafter

from ..conftest import VOCAB, tiny_drafter, tiny_target


def _tokenizer():
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0")


def write_prompts(path, n: int):
    """`n` prompts of six random words of the tiny tokenizer, as JSON lines; returns `path`."""
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB - 1, (6,), generator=g))
            f.write(json.dumps({"id": f"p{i}", "prompt": words}) + "\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    prompts = write_prompts(folder / "prompts.jsonl", 12)
    target = tiny_target("llama")
    layer_ids = [0, 1, 2, 3, 4]
    out = folder / "cache"
    assert generate_data(target, _tokenizer(), [str(prompts)], str(out), layer_ids, max_new_tokens=24,
                         batch_size=5) == 12
    assert generate_data(target, _tokenizer(), [str(prompts)], str(out), layer_ids, max_new_tokens=24) == 0  # resumed
    return target, str(out)


@pytest.fixture(scope="module")
def tapless(data, tmp_path_factory):
    """The same prompts answered again into a folder without cached taps (`layer_ids=None`)."""
    target, folder = data
    out = tmp_path_factory.mktemp("tapless")
    prompts = os.path.join(os.path.dirname(folder), "prompts.jsonl")
    assert generate_data(target, _tokenizer(), [prompts], str(out), None, max_new_tokens=24, batch_size=5) == 12
    with pytest.raises(ValueError, match="holds no taps"):
        generate_data(target, _tokenizer(), [prompts], str(out), [0, 1])
    return str(out)


def test_cached_taps_equal_a_fresh_forward(data):
    from hf_dscale.models.dscale.assistant import TapRecorder

    target, folder = data
    assert load_meta(folder)["layer_ids"] == [0, 1, 2, 3, 4]
    samples = list(iter_samples(folder))
    assert len(samples) == 12 and all(s.loss_mask.any() and not s.loss_mask[0] for s in samples)
    recorder = TapRecorder(target, [0, 1, 2, 3, 4])
    with torch.no_grad():
        target(samples[3].input_ids[None])
    torch.testing.assert_close(samples[3].taps.float(), recorder.taps()[0], atol=2e-3, rtol=1e-2)
    recorder.remove()


def _train(target, folder, out, steps, seed=0, stop_after=None, **kw):
    drafter = tiny_drafter(target, fusion=kw.pop("fusion", "layerwise"), block_size=4, seed=seed)
    cfg = TrainConfig(steps=steps, lr=1e-2, grad_accum=2, num_anchors=16, save_every=4, warmup_ratio=0.1, **kw)
    history = []

    def on_step(step, metrics):
        history.append(metrics["loss"])
        if step == stop_after:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C here

    drafter = train_drafter(drafter, target, folder, str(out), cfg, on_step=on_step)
    return drafter, history


def test_training_learns_and_the_result_decodes_exactly(data, tmp_path):
    target, folder = data
    drafter, history = _train(target, folder, tmp_path / "run", steps=60)
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    # from about chance level (ln 96 = 4.56 over the whole vocabulary; the loss scores the answers' tokens
    # plus each sequence's, fewer) to clearly below it
    assert first > 3.5 and last < first - 0.5
    loaded = DScaleDrafter.from_pretrained(tmp_path / "run")
    assert torch.equal(loaded.draft_vocab, frequent_tokens(folder, TrainConfig().draft_vocab))
    ids = torch.tensor([[5, 9, 11, 4, 7, 30]])
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    stats = DecodeStats()
    spec = target.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=custom_generate,
                           drafter=loaded, dscale_stats=stats)
    assert torch.equal(plain, spec)


def test_a_continued_drafter_keeps_its_draft_vocab_after_the_datas_own(data, tmp_path):
    target, folder = data
    own = frequent_tokens(folder, 10_000)  # every response token of the folder
    unseen = [t for t in range(VOCAB) if t not in set(own.tolist())]
    old = torch.tensor([int(own[0])] + unseen[:3])  # one the data has, three it lacks
    assert len(unseen) >= 3
    size = len(own) + 2
    drafter = tiny_drafter(target, block_size=4, seed=0)
    drafter.set_draft_vocab(old)  # as if loaded with --init-from
    cfg = TrainConfig(steps=1, grad_accum=1, num_anchors=4, draft_vocab=size)
    trained = train_drafter(drafter, target, folder, str(tmp_path / "run"), cfg)
    assert trained.draft_vocab.tolist() == own.tolist() + unseen[:2]  # the data's first, then the old ones, capped
    assert DScaleDrafter.from_pretrained(tmp_path / "run").draft_vocab.tolist() == trained.draft_vocab.tolist()
    assert top_up(own[:3], old, 2).tolist() == own[:2].tolist()  # no room: the data's own only


def test_loss_over_the_draft_vocab_is_the_cross_entropy_restricted_to_what_decoding_proposes(data, monkeypatch):
    """With a draft vocab the softmax runs over it plus the sequence's own tokens, exactly as if every other
    logit were -inf (what `DraftVocab.logits` gives decoding); with a small set the loss is lower than the
    whole vocabulary's, so the restriction did happen."""
    target, folder = data
    drafter = tiny_drafter(target, block_size=4, seed=1).bind_target(target)
    tap_index = [load_meta(folder)["layer_ids"].index(i) for i in drafter.config.target_layer_ids]
    sample = next(iter(iter_samples(folder)))
    sample = type(sample)(sample.input_ids, sample.loss_mask, sample.taps[:, tap_index])
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    vocab = torch.tensor([3, 17, 40])
    cfg = TrainConfig(num_anchors=8)
    captured = {}

    def spy(logits, labels, weights):
        captured.update(logits=logits, labels=labels, weights=weights)
        return weighted_cross_entropy(logits, labels, weights)

    monkeypatch.setattr(trainer, "weighted_cross_entropy", spy)
    full_loss, _ = sequence_loss(drafter, embed, head, sample, cfg, torch.Generator().manual_seed(0))
    full = dict(captured)
    loss, accuracy = sequence_loss(drafter, embed, head, sample, cfg, torch.Generator().manual_seed(0), vocab)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[vocab] = allowed[sample.input_ids] = True
    expected, expected_accuracy = weighted_cross_entropy(full["logits"].masked_fill(~allowed, float("-inf")),
                                                         full["labels"], full["weights"])
    torch.testing.assert_close(loss, expected)
    assert float(accuracy) == float(expected_accuracy)
    assert captured["logits"].shape[1] == int(allowed.sum()) < VOCAB
    assert float(loss.detach()) < float(full_loss.detach())


def test_frequent_tokens_rank_the_response_tokens(data):
    _, folder = data
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for sample in iter_samples(folder):
        counts += torch.bincount(sample.input_ids[sample.loss_mask], minlength=VOCAB)
    ranked = frequent_tokens(folder, VOCAB)
    assert set(ranked.tolist()) == set(counts.nonzero()[:, 0].tolist())  # every answer token, no prompt-only one
    assert bool((counts[ranked][:-1] >= counts[ranked][1:]).all())
    assert torch.equal(frequent_tokens(folder, 5), ranked[:5])


def test_resume_continues_exactly_where_it_stopped(data, tmp_path):
    target, folder = data
    straight, _ = _train(target, folder, tmp_path / "a", steps=7)
    with pytest.raises(KeyboardInterrupt):
        _train(target, folder, tmp_path / "b", steps=7, stop_after=6)  # checkpoint at 4, interrupted at 6
    assert (tmp_path / "b" / "checkpoint-6" / "model.safetensors").exists()
    resumed, _ = _train(target, folder, tmp_path / "b", steps=7)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_data_with_other_taps_is_refused(data, tmp_path):
    target, folder = data
    drafter = tiny_drafter(target)
    drafter.config.target_layer_ids = [0, 5]
    with pytest.raises(ValueError, match="caches taps of layers"):
        train_drafter(drafter, target, folder, str(tmp_path), TrainConfig(steps=1))


def _spy_on_the_loss(monkeypatch) -> list[dict]:
    calls = []

    def spy(logits, labels, weights):
        calls.append(dict(logits=logits, labels=labels, weights=weights))
        return weighted_cross_entropy(logits, labels, weights)

    monkeypatch.setattr(trainer, "weighted_cross_entropy", spy)
    return calls


@pytest.mark.parametrize("vp_beta", [None, 0.8])
def test_a_batch_is_its_sequences_side_by_side(data, monkeypatch, vp_beta):
    """Padding to the longest sequence and the most blocks changes nothing: the batched forward gives every
    sequence the logits it gets alone, and the loss weighs all their predicted positions alike."""
    target, folder = data
    drafter = tiny_drafter(target, block_size=4, seed=2).bind_target(target)
    tap_index = [load_meta(folder)["layer_ids"].index(i) for i in drafter.config.target_layer_ids]
    samples = [type(s)(s.input_ids, s.loss_mask, s.taps[:, tap_index]) for s in list(iter_samples(folder))[:3]]
    samples[1] = type(samples[1])(samples[1].input_ids[:-7], samples[1].loss_mask[:-7], samples[1].taps[:-7])
    assert len({s.input_ids.shape[0] for s in samples}) > 1  # padding is exercised
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    cfg = TrainConfig(num_anchors=6, vp_beta=vp_beta)
    calls = _spy_on_the_loss(monkeypatch)
    for i, sample in enumerate(samples):
        sequence_loss(drafter, embed, head, sample, cfg, torch.Generator().manual_seed(i))
    loss, accuracy = batch_loss(drafter, embed, head, samples, cfg, [torch.Generator().manual_seed(i) for i in range(3)])
    alone, batched = calls[:3], calls[3]
    for key in ("logits", "labels", "weights"):
        torch.testing.assert_close(batched[key], torch.cat([c[key] for c in alone]), atol=1e-5, rtol=1e-4)
    expected, expected_accuracy = weighted_cross_entropy(*(torch.cat([c[k] for c in alone])
                                                          for k in ("logits", "labels", "weights")))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert float(accuracy) == float(expected_accuracy)


def test_taps_computed_by_the_target_give_the_cached_loss(data, tapless):
    target, folder = data
    assert load_meta(tapless)["layer_ids"] is None
    cached, bare = list(iter_samples(folder)), list(iter_samples(tapless))
    assert all(s.taps is None for s in bare)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(cached, bare))  # the same answers
    drafter = tiny_drafter(target, block_size=4, seed=3).bind_target(target)
    layers = list(drafter.config.target_layer_ids)
    tap_index = [load_meta(folder)["layer_ids"].index(i) for i in layers]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    cfg = TrainConfig(num_anchors=8)
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(4)]  # noqa: E731
    with_cache, _ = batch_loss(drafter, embed, head, [type(s)(s.input_ids, s.loss_mask, s.taps[:, tap_index])
                                                      for s in cached[:4]], cfg, gens())
    taps = TargetTaps(target, layers)
    on_the_fly, _ = batch_loss(drafter, embed, head, bare[:4], cfg, gens(), target_taps=taps)
    taps.remove()
    torch.testing.assert_close(on_the_fly, with_cache, atol=2e-3, rtol=1e-3)  # the cache holds float16
    with pytest.raises(ValueError, match="no cached taps"):
        batch_loss(drafter, embed, head, bare[:1], cfg, gens()[:1])


def test_training_without_cached_taps_learns_and_resumes_exactly(data, tapless, tmp_path):
    target, _ = data
    drafter, history = _train(target, tapless, tmp_path / "run", steps=40, batch_size=3)
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 0.5
    assert not any(layer._forward_hooks for layer in target.model.layers)  # the tap hooks were removed
    straight, _ = _train(target, tapless, tmp_path / "a", steps=7, batch_size=3)
    with pytest.raises(KeyboardInterrupt):
        _train(target, tapless, tmp_path / "b", steps=7, stop_after=6, batch_size=3)
    resumed, _ = _train(target, tapless, tmp_path / "b", steps=7, batch_size=3)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_target_elsewhere_than_the_training_device_is_refused(data, tmp_path):
    target = tiny_target("llama").to("meta")
    with pytest.raises(ValueError, match="The target is on meta"):
        train_drafter(tiny_drafter(target), target, data[1], str(tmp_path), TrainConfig(steps=1))


def test_length_sorted_batches_cover_every_prompt_once_and_pad_less():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 500, (101,), generator=g).tolist()
    batches = length_sorted_batches(lengths, batch_size=4, window=3)
    assert sorted(i for b in batches for i in b) == list(range(101))
    assert all(len(b) == 4 for b in batches[:-1])
    for b in batches:  # a batch never mixes windows of 12 prompts, and runs short to long inside one
        assert len({i // 12 for i in b}) == 1
        assert [lengths[i] for i in b] == sorted(lengths[i] for i in b)

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    in_order = length_sorted_batches(lengths, batch_size=4, window=1)
    assert in_order == [list(range(s, min(s + 4, 101))) for s in range(0, 101, 4)]
    assert padded(batches) < padded(in_order)


def test_answers_sorted_by_length_are_those_of_the_file_order(tmp_path):
    g = torch.Generator().manual_seed(2)
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(10):  # prompts of 1 to 14 words
            n = int(torch.randint(1, 15, (1,), generator=g))
            words = " ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB - 1, (n,), generator=g))
            f.write(json.dumps({"id": f"p{i}", "prompt": words}) + "\n")
    target = tiny_target("llama")

    def answers(folder, window):
        assert generate_data(target, _tokenizer(), [str(path)], str(folder), None, max_new_tokens=12, batch_size=3,
                             sort_window=window) == 10
        out = {}
        for name in shard_names(str(folder)):
            with open(os.path.join(folder, name + ".json")) as f:
                ids = json.load(f)
            out.update((i, s.input_ids[s.loss_mask].tolist()) for i, s in zip(ids, read_shard(str(folder), name)))
        return out

    sorted_answers = answers(tmp_path / "sorted", 4)
    assert sorted_answers == answers(tmp_path / "in_order", 1)
    assert len(sorted_answers) == 10
