"""Targets whose layers keep a conv window or a recurrent state (Gated DeltaNet, Mamba-2, short convolutions).

After the prefill the engine's cache keeps every verified token's state (`compat.record_states`), and each row is
rolled back to its own accepted length (`compat.keep_states`). Here the rolled-back states are compared with those of
a cache that was only ever fed the kept tokens, row by row, and the whole decode with plain `generate()`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from hf_dscale import DScaleConfig, DScaleDrafter
from hf_dscale.engine.state import PathRows, Verify
from hf_dscale.generation import custom_generate
from hf_dscale.engine import structure
from hf_dscale.engine.tree import TokenTree
from hf_dscale.engine.types import DecodeStats
from hf_dscale.models.dscale import compat
from hf_dscale.sweep import OracleDrafter, oracle_from, restrict, tiny_config

from ..conftest import unevenly_padded

HYBRIDS = ("qwen3_5_text", "lfm2", "bamba")  # Gated DeltaNet + attention, short conv + attention, Mamba-2 + attention
pytestmark = pytest.mark.skipif(not compat.records_recurrent_steps(),
                                reason="this transformers cannot keep a recurrent state per token (5.25+ can)")


def _target(kind: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind)).float().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


def _states(cache) -> list[torch.Tensor]:
    out = []
    for i in compat.stateful_layers(cache):
        layer = cache.layers[i]
        for s in range(layer.number_of_states):
            if layer.is_conv_states_initialized[s]:
                out.append(layer.conv_states[s][..., -layer.conv_kernel_size[s]:])
            if layer.is_recurrent_states_initialized[s]:
                out.append(layer.recurrent_states[s])
    return out


def _feed(model, cache, ids, start: int):
    positions = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
    model(input_ids=ids, position_ids=positions, use_cache=True, **compat.cache_kwargs(model, cache))


@pytest.mark.parametrize("kind", HYBRIDS)
def test_each_row_rolls_back_to_its_own_length(kind):
    model = _target(kind)
    assert structure.of(model).stateful, kind
    ids = torch.randint(3, 120, (3, 16), generator=torch.Generator().manual_seed(1))
    kept = torch.tensor([0, 3, 6])
    cache = compat.hybrid_cache(model.config, 32)
    _feed(model, cache, ids[:, :10], 0)
    compat.record_states(cache, 16)
    _feed(model, cache, ids[:, 10:16], 10)
    compat.keep_states(cache, kept)
    rolled = _states(cache)
    for b, k in enumerate(kept.tolist()):
        alone = compat.hybrid_cache(model.config, 32)
        _feed(model, alone, ids[b : b + 1, :10], 0)
        compat.record_states(alone, 16)
        if k:
            _feed(model, alone, ids[b : b + 1, 10 : 10 + k], 10)
            compat.keep_states(alone, torch.tensor([k]))
        for got, want in zip(rolled, _states(alone), strict=True):
            torch.testing.assert_close(got[b : b + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", HYBRIDS)
def test_batched_chain_is_identical(kind):
    """Uneven left padding, a processor, rows that accept different lengths and stop at different times."""
    model = _target(kind)
    ids, mask = unevenly_padded(3, length=10)
    penalty = [RepetitionPenaltyLogitsProcessor(1.3)]
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                           logits_processor=penalty)
    torch.manual_seed(1)
    drafter = OracleDrafter(DScaleConfig.from_target(model.config, num_hidden_layers=1, mask_token_id=127,
                                                     block_size=6)).eval()
    drafter.oracle, drafter.error_rate = oracle_from(plain, mask), 0.3
    stats = DecodeStats()
    spec = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                          logits_processor=penalty, custom_generate=custom_generate, drafter=drafter,
                          draft_confidence=0.0, dscale_stats=stats)
    assert torch.equal(plain, spec), kind
    assert stats.tau > 1.5  # drafts were accepted: rows rolled back to different lengths
    assert stats.state_bytes > 0  # what a verify kept to roll rows back, reported

def _rows(args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return (kwargs["inputs_embeds"] if ids is None else ids).shape[0]


class RunnerUpOracle(OracleDrafter):
    """An oracle drafter whose first choice is, at rate `error_rate`, a random token with the right one second: the
    own tree's runner-up branches then hold the continuation the target accepts, off the tree's first path."""

    def draft_logits(self, anchor_ids, taps, anchor_positions, context_position_ids, cache, context_valid=None,
                     vocab=None, compact=False):
        real = DScaleDrafter.draft_logits(self, anchor_ids, taps, anchor_positions, context_position_ids, cache,
                                          context_valid, vocab)
        logits = torch.randn_like(real)
        for b in range(real.shape[0]):
            seq = self.oracle[b]
            for k in range(real.shape[1]):
                pos = int(anchor_positions[b]) + 1 + k
                logits[b, k, seq[pos] if pos < len(seq) else 0] += self.boost
                if torch.rand(()) < self.error_rate:
                    logits[b, k, int(torch.randint(0, real.shape[-1], ()))] += self.boost + 5
        return restrict(logits, vocab, compact)


class OracleVP(DScaleDrafter):
    """A variable-prefix drafter that re-drafts each branch with the known continuation."""

    oracle: list[list[int]] | None = None

    def block_logits(self, block_ids, anchor_positions, taps, context_position_ids, cache, context_valid=None,
                     vocab=None, compact=False):
        real = super().block_logits(block_ids, anchor_positions, taps, context_position_ids, cache, context_valid,
                                    vocab)
        logits = torch.randn_like(real)
        per_row = block_ids.shape[0] // len(self.oracle)
        for r in range(block_ids.shape[0]):
            seq = self.oracle[r // per_row]
            for k in range(real.shape[1]):
                pos = int(anchor_positions[r]) + 1 + k
                logits[r, k, seq[pos] if pos < len(seq) else 0] += 30.0
        return restrict(logits, vocab, compact)


@pytest.mark.parametrize("kind", HYBRIDS)
@pytest.mark.parametrize("how", ["tree+lookup", "d2sd"])
def test_batched_trees_are_identical(kind, how, monkeypatch):
    """Each path of a row's tree is verified as a row of its own (`PathRows`) and the row keeps the states of the
    path it accepted: with runner-up branches that hold the right token, accepted paths leave the first one."""
    off_first = []
    rows_of = PathRows.rows_of

    def spy(paths, last):
        kept = rows_of(paths, last)
        off_first.append(bool((kept != paths.where[:, 0] // paths.width).any()))
        return kept

    monkeypatch.setattr(PathRows, "rows_of", spy)
    model = _target(kind)
    ids, mask = unevenly_padded(3, length=10)
    ids[0, 5:] = ids[0, :5]  # a repeat: the prompt lookup proposes a path too
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    torch.manual_seed(2)
    config = DScaleConfig.from_target(model.config, num_hidden_layers=1, mask_token_id=127, block_size=6)
    drafter = RunnerUpOracle(config).eval()
    drafter.oracle, drafter.error_rate = oracle_from(plain, mask), 0.3
    vp = OracleVP(config).eval()
    vp.oracle = drafter.oracle
    options = dict(draft_tree=True, prompt_lookup=True) if how == "tree+lookup" else dict(vp_drafter=vp)
    widths = []
    hook = model.base_model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(_rows(args, kwargs)),
                                           with_kwargs=True)
    stats = DecodeStats()
    try:
        spec = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              custom_generate=custom_generate, drafter=drafter, draft_confidence=0.0,
                              dscale_stats=stats, **options)
    finally:
        hook.remove()
    assert torch.equal(plain, spec), (kind, how)
    assert max(widths) > 3  # some verify ran more paths than rows
    assert any(off_first)  # and some row kept a path other than its tree's first
    assert stats.tau > 1.5 and not stats.plan.single_path


def test_path_rows_lay_each_tree_path_out_as_a_chain():
    trees = [TokenTree.from_candidates(7, [[1, 2, 3], [1, 4], [5]]), TokenTree.from_candidates(9, [[6, 6]])]
    verify = Verify.of(trees, torch.tensor([10, 4]))
    paths = PathRows.of(verify)
    assert paths.source.tolist() == [0, 0, 0, 1]
    assert paths.ids.tolist() == [[7, 1, 2, 3], [7, 1, 4, 4], [7, 5, 5, 5], [9, 6, 6, 6]]
    assert paths.positions.tolist() == [[10, 11, 12, 13]] * 3 + [[4, 5, 6, 7]]
    per_path = torch.arange(4 * 4).view(4, 4)  # path row * width + depth
    # row 0's nodes: anchor, 1, 2, 3, 4, 5 (trie order); row 1's: anchor, 6, 6, then padding (its anchor)
    assert paths.nodes(per_path).tolist() == [[0, 1, 2, 3, 6, 9], [12, 13, 14, 12, 12, 12]]
    assert paths.rows_of(torch.tensor([4, 2])).tolist() == [1, 3]


def test_the_prompt_lookup_path_carries_a_hybrid_where_the_drafter_fails():
    """The default on such a target verifies one path a row: the drafter's chain or the prompt lookup's, the
    likelier. With a drafter that proposes noise (and knows it: a flat distribution), the lookup's accepted tokens
    are what raise tau above 1."""
    model = _target("qwen3_5_text")
    ids, mask = unevenly_padded(2, length=12)
    ids[:, 6:] = ids[:, :6]  # a repeat: the lookup finds matches
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    drafter = OracleDrafter(DScaleConfig.from_target(model.config, num_hidden_layers=1, mask_token_id=127,
                                                     block_size=6)).eval()
    drafter.oracle, drafter.error_rate, drafter.boost = oracle_from(plain, mask), 1.0, 0.0
    stats = DecodeStats()
    spec = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                          custom_generate=custom_generate, drafter=drafter, dscale_stats=stats)
    assert torch.equal(plain, spec)
    assert stats.plan.single_path and stats.plan.prompt_lookup
    assert stats.tau > 1.2, stats.tau
