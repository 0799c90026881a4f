"""The diffusion LM's training masks: uniform (LLaDA) rows and block rows shaped like block-wise decoding."""

from __future__ import annotations

import torch

from hf_dscale.training.dllm_trainer import BLOCK_SIZES, noise_mask

PROMPT, G = 6, 128


def _answer_mask(rows: int) -> torch.Tensor:
    mask = torch.zeros(rows, PROMPT + G, dtype=torch.bool)
    mask[:, PROMPT:] = True
    return mask


def test_uniform_rows_mask_answer_tokens_at_rate_t():
    answer = _answer_mask(400)
    t = torch.full((400, 1), 0.3)
    noise, weights = noise_mask(answer, t, torch.Generator().manual_seed(0))
    assert not noise[:, :PROMPT].any()  # the prompt is never masked
    assert abs(noise[:, PROMPT:].float().mean().item() - 0.3) < 0.01
    assert torch.allclose(weights[noise], torch.tensor(1 / 0.3))


def _block_layouts(noise: torch.Tensor, weights: torch.Tensor, t: float) -> list[tuple[int, int]]:
    """The (block size, cut) pairs that explain one answer row: kept before the cut, masked with weight
    1 after the block, and weight 1/t on the masked tokens inside it."""
    found = []
    for size in BLOCK_SIZES:
        for cut in range(0, G, size):
            end = cut + size
            inside = noise[cut:end]
            if (not noise[:cut].any() and noise[end:].all() and torch.all(weights[end:] == 1.0)
                    and torch.allclose(weights[cut:end][inside], torch.tensor(1 / t))):
                found.append((size, cut))
    return found


def test_block_rows_keep_a_prefix_mask_one_aligned_block_partly_and_the_rest_fully():
    rows, t = 300, 0.5
    answer = _answer_mask(rows)
    noise, weights = noise_mask(answer, torch.full((rows, 1), t), torch.Generator().manual_seed(1), block_fraction=1.0)
    assert not noise[:, :PROMPT].any()
    tails = set()
    for row in range(rows):
        assert _block_layouts(noise[row, PROMPT:], weights[row, PROMPT:], t), row
        tails.add(int(noise[row, PROMPT:].flip(0).cumprod(0).sum()))  # length of the fully masked tail
    assert len(tails) > 10  # cuts and block sizes vary
    uniform, uniform_weights = noise_mask(answer, torch.full((rows, 1), t), torch.Generator().manual_seed(1))
    # the check has power: a uniform row fits only the trivial layout (one block over the whole answer)
    for r in range(20):
        assert _block_layouts(uniform[r, PROMPT:], uniform_weights[r, PROMPT:], t) == [(G, 0)]


def test_block_fraction_mixes_both_kinds_and_zero_keeps_the_uniform_draws():
    answer = _answer_mask(64)
    t = torch.full((64, 1), 0.5)
    plain, _ = noise_mask(answer, t, torch.Generator().manual_seed(3))
    again, _ = noise_mask(answer, t, torch.Generator().manual_seed(3), block_fraction=0.0)
    assert torch.equal(plain, again)  # runs without block rows resume on the same draws
    mixed, _ = noise_mask(answer, t, torch.Generator().manual_seed(3), block_fraction=0.5)
    changed = int((mixed != plain).any(1).sum())
    assert 10 < changed < 54  # about half the rows became block rows
