"""The plain `assistant_model=` path leaves nothing on the target once `generate()` returns."""

from __future__ import annotations

import torch

from ..conftest import tiny_drafter, tiny_target


def _hooks(target) -> list[list[int]]:
    return [list(layer._forward_hooks) for layer in target.model.layers]


def test_tap_hooks_removed_when_generate_returns():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    before = _hooks(target)
    for seed in range(3):  # consecutive generations each find their target and clean up after themselves
        ids = torch.randint(3, 90, (1, 6 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(ids, max_new_tokens=20, do_sample=False)
        spec = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
        assert torch.equal(plain, spec)
        assert _hooks(target) == before
        assert drafter._assist is None


def test_tap_hooks_removed_after_a_failed_generate():
    """A generation that raises midway (here: a logits processor that fails) leaves no hooks once its
    traceback is gone."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    before = _hooks(target)

    class Fails:
        calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls > 2:
                raise KeyError("stop")
            return scores

    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(0))
    try:
        target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, logits_processor=[Fails()])
    except KeyError:
        pass
    else:
        raise AssertionError("the logits processor should have raised")
    assert _hooks(target) == before
