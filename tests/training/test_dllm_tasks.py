"""The dLLM tasks: checkable answers, a held-out split, and (for `stories`) wording the prompt does not decide."""

from __future__ import annotations

import random
import re

import pytest

from hf_dscale.training.dllm_tasks import TASKS, build_tokenizer, draw_numbers, final_answer, make_problems, tell_story


@pytest.mark.parametrize("task", sorted(TASKS))
def test_solutions_are_checkable_and_fit_the_answer_region(task):
    tokenizer = build_tokenizer(task)
    for p in make_problems(task, 300, seed=0, heldout=False):
        ids = tokenizer(p.prompt + " " + p.solution)["input_ids"]
        assert tokenizer.pad_token_id not in ids  # every word is in the vocabulary (PAD is the unknown token)
        assert len(tokenizer(p.solution)["input_ids"]) < 128
        assert final_answer(tokenizer.decode(tokenizer(p.solution)["input_ids"])) == p.answer


def test_the_heldout_split_is_disjoint_from_training():
    train = {draw_numbers(random.Random(s), heldout=False) for s in range(3000)}
    heldout = {draw_numbers(random.Random(s), heldout=True) for s in range(3000)}
    assert len(heldout) > 500 and not train & heldout


def test_every_task_vocabulary_extends_the_arithmetic_one():
    base = build_tokenizer().get_vocab()
    for task in TASKS:
        vocab = build_tokenizer(task).get_vocab()
        assert all(vocab[t] == i for t, i in base.items())
    with pytest.raises(ValueError, match="Unknown task"):
        build_tokenizer("poetry")


def test_stories_word_the_same_numbers_many_ways():
    """What the prompt does not decide (order, operand order, a dozen word choices) varies; the answer does not."""
    rng = random.Random(0)
    tellings = [tell_story(rng, 34, 5, 2, 5) for _ in range(200)]
    assert {p.answer for p in tellings} == {39}
    assert len({p.solution for p in tellings}) > 190
    second = {p.solution.split(" . ")[1].split()[0] for p in tellings}  # a product or a subtraction first
    assert second == {"Each", "Every", "Take", "Give"}
    assert any("2 * 5" in p.solution for p in tellings) and any("5 * 2" in p.solution for p in tellings)
    assert len({re.sub(r"\d", "", p.prompt) for p in tellings}) > 3  # three templates, three containers
