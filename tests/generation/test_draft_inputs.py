"""The drafter sees exactly the context a from-scratch computation would give it.

Each block the drafter proposes during decoding (incremental context cache, hooks on the target,
columns with holes in a batch) is recomputed from scratch: one target forward over the committed
prefix, its taps, and a drafter call without cache. Both must agree.
"""

from __future__ import annotations

import pytest
import torch

from hf_dscale import DScaleDrafter
from hf_dscale.generation import custom_generate
from hf_dscale.models.dscale.assistant import TapRecorder

from ..conftest import tiny_drafter, tiny_target
from .test_exactness import _prompt


class RecordingDrafter(DScaleDrafter):
    calls: list

    def draft_logits(self, anchor_ids, taps, anchor_positions, context_position_ids, cache, context_valid=None,
                     vocab=None, compact=False):
        logits = super().draft_logits(anchor_ids, taps, anchor_positions, context_position_ids, cache, context_valid,
                                      vocab, compact)
        self.calls.append((anchor_ids[:, 0].clone(), anchor_positions.clone(), logits.clone()))
        return logits


@torch.no_grad()
def _from_scratch(target, drafter, row: list[int], position: int) -> torch.Tensor:
    recorder = TapRecorder(target, drafter.config.target_layer_ids)
    try:
        target(torch.tensor([row[:position]]))
        taps = recorder.taps()
    finally:
        recorder.remove()
    return DScaleDrafter.draft_logits(drafter, torch.tensor([[row[position]]]), taps, torch.tensor([position]),
                                torch.arange(position)[None], None)[0]


def _check(target, drafter, rows: list[list[int]]):
    assert len(drafter.calls) > 2
    for anchors, positions, logits in drafter.calls:
        for b, row in enumerate(rows):
            a = int(positions[b])
            if a >= len(row):
                continue  # a finished row still rides along in the batch
            assert int(anchors[b]) == row[a]
            torch.testing.assert_close(logits[b], _from_scratch(target, drafter, row, a), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_assistant_model_path_feeds_the_right_context(kind):
    target = tiny_target(kind)
    drafter = tiny_drafter(target, cls=RecordingDrafter)
    drafter.calls = []
    ids, _ = _prompt(1, 9, seed=4)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False)
    _check(target, drafter, out.tolist())


def test_custom_generate_batch_with_holes_feeds_the_right_context():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, cls=RecordingDrafter)
    drafter.calls = []
    ids, mask = _prompt(3, 10, seed=8)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=25, do_sample=False,
                          custom_generate=custom_generate, drafter=drafter)
    rows = [out[b][torch.cat((mask[b].bool(), torch.ones(25, dtype=torch.bool)))].tolist() for b in range(3)]
    _check(target, drafter, rows)


class NativeRecordingDrafter(DScaleDrafter):
    calls: list

    def _native_forward(self, noise_embeds, context_hidden_states, position_ids, **kw):
        out = super()._native_forward(noise_embeds, context_hidden_states, position_ids, **kw)
        self.calls.append((noise_embeds.clone(), position_ids[:, -noise_embeds.shape[1]:].clone(),
                           out.last_hidden_state.clone()))
        return out


def test_native_speculation_type_dflash():
    from hf_dscale.models.dscale.compat import native_dflash_reads_layer_outputs

    target = tiny_target("llama")
    drafter = tiny_drafter(target, cls=NativeRecordingDrafter)
    drafter.calls = []
    ids, _ = _prompt(1, 9, seed=6)
    plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    if not native_dflash_reads_layer_outputs():
        with pytest.raises(ValueError, match="one layer off"):
            target.generate(ids, assistant_model=drafter, speculation_type="dflash", max_new_tokens=30)
        return
    out = target.generate(ids, assistant_model=drafter, speculation_type="dflash", max_new_tokens=30,
                          do_sample=False)
    assert torch.equal(plain, out)
    assert len(drafter.calls) > 2
    recorder = TapRecorder(target, drafter.config.target_layer_ids)
    for noise_embeds, block_positions, hidden in drafter.calls:
        a = int(block_positions[0, 0])
        with torch.no_grad():
            target(out[:, :a])
            expected = DScaleDrafter.forward(drafter, noise_embeds, recorder.taps(), block_positions,
                                             torch.arange(a)[None])
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    recorder.remove()
