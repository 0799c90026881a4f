"""The training objective on hand-checked examples."""

from __future__ import annotations

import math

import torch

from hf_dscale.training.losses import block_attention_mask, build_blocks, sample_anchors, sample_prefix_lengths, weighted_cross_entropy

MASK = 99


def test_anchors_are_response_tokens_with_a_successor():
    mask = torch.tensor([0, 0, 1, 1, 1, 1]).bool()
    anchors = sample_anchors(mask, 10)
    assert anchors.tolist() == [2, 3, 4]
    assert sample_anchors(mask, 2, torch.Generator().manual_seed(0)).numel() == 2
    assert sample_anchors(torch.tensor([1, 0, 0]).bool(), 4).tolist() == [0]


def test_blocks_mask_visibility_and_decay():
    ids = torch.arange(10, 20)  # S = 10
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1]).bool()
    blocks = build_blocks(ids, mask, torch.tensor([3, 5]), block_size=4, mask_token_id=MASK, decay=2.0)
    assert blocks.input_ids.tolist() == [[13, MASK, MASK, MASK], [15, MASK, MASK, MASK]]
    assert blocks.labels.tolist() == [[0, 14, 15, 16], [0, 16, 17, 18]]
    assert blocks.position_ids.tolist() == [[3, 4, 5, 6], [5, 6, 7, 8]]
    w = blocks.weights
    assert w[:, 0].tolist() == [0, 0] and math.isclose(float(w[0, 1]), 1.0)
    assert math.isclose(float(w[0, 3]), math.exp(-1.0), rel_tol=1e-6)
    assert blocks.anchors.tolist() == [3, 5]
    m = block_attention_mask([blocks.anchors], 10, 4)[0]  # [8, 10 + 8]
    assert m.shape == (8, 18)
    assert m[0, :10].tolist() == [True] * 3 + [False] * 7  # block 0 sees context strictly before anchor 3
    assert m[4, :10].tolist() == [True] * 5 + [False] * 5  # block 1: before anchor 5 (not "before block 1")
    assert m[:4, 10:14].all() and not m[:4, 14:].any()  # bidirectional inside, blocks isolated
    assert m[4:, 14:].all() and not m[4:, 10:14].any()


def test_a_batch_mask_pads_each_sequence_with_blocks_that_see_only_themselves():
    alone = [block_attention_mask([a], s, 4)[0] for a, s in ((torch.tensor([3, 5]), 10), (torch.tensor([2]), 7))]
    m = block_attention_mask([torch.tensor([3, 5]), torch.tensor([2])], 10, 4)  # width 10 = the longer context
    assert m.shape == (2, 8, 18)
    assert torch.equal(m[0], alone[0])
    assert torch.equal(m[1, :4, :7], alone[1][:, :7]) and not m[1, :, 7:10].any()  # past its context: nothing
    assert torch.equal(m[1, :4, 10:], torch.cat((alone[1][:, 7:], torch.zeros(4, 4, dtype=torch.bool)), 1))
    assert not m[1, 4:, :14].any() and m[1, 4:, 14:].all()  # the padded block sees only itself


def test_blocks_running_past_the_end_are_not_labelled():
    ids, mask = torch.arange(6), torch.ones(6).bool()
    blocks = build_blocks(ids, mask, torch.tensor([4]), block_size=4, mask_token_id=MASK, decay=7.0)
    assert blocks.weights[0].gt(0).tolist() == [False, True, False, False]


def test_variable_prefix_blocks_show_ground_truth_and_decay_from_first_mask():
    ids, mask = torch.arange(20), torch.ones(20).bool()
    blocks = build_blocks(ids, mask, torch.tensor([2]), 6, MASK, 7.0, prefix_lengths=torch.tensor([2]))
    assert blocks.input_ids.tolist() == [[2, 3, 4, MASK, MASK, MASK]]
    assert blocks.weights[0, :3].tolist() == [0, 0, 0] and math.isclose(float(blocks.weights[0, 3]), 1.0)
    lengths = sample_prefix_lengths(20_000, 16, 0.9, torch.Generator().manual_seed(0))
    assert lengths.min() == 0 and lengths.max() <= 14
    assert (lengths == 0).float().mean() > (lengths == 5).float().mean()


def test_weighted_cross_entropy():
    logits = torch.tensor([[4.0, 0.0], [0.0, 4.0]])
    labels = torch.tensor([0, 0])
    loss, accuracy = weighted_cross_entropy(logits, labels, torch.tensor([1.0, 0.0]))
    assert math.isclose(float(loss), float(torch.nn.functional.cross_entropy(logits[:1], labels[:1])), rel_tol=1e-5)
    assert float(accuracy) == 0.5
