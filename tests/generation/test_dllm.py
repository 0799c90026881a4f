"""Diffusion-LM decoding: the threshold rule, NFE accounting, the dual cache, BlockBatch's merge / sync /
refresh on hand-made branch states, and batched branches equal to each branch run alone."""

from __future__ import annotations

import pytest
import torch

from hf_dscale.dllm.decode import _Branches, merge, sync
from hf_dscale.dllm.host import answer_end, threshold_commit
from hf_dscale.generation import blockbatch_generate, dllm_generate, fast_dllm_generate
from hf_dscale.models.dllm import DiffusionLM, DiffusionLMConfig, DiffusionModel

from ..conftest import tiny_target

VOCAB, MASK, EOS = 40, 1, 2


def tiny_dlm(shift: int = 0, layers: int = 2, seed: int = 0) -> DiffusionLM:
    torch.manual_seed(seed)
    config = DiffusionLMConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, mask_token_id=MASK, eos_token_id=EOS, logits_shift=shift)
    return DiffusionLM(config).eval()


def _logits_for(confidences, tokens, vocab=VOCAB):
    """Logits whose softmax has max probability `confidences[k]` at `tokens[k]`."""
    rows = []
    for c, t in zip(confidences, tokens):
        p = torch.full((vocab,), (1 - c) / (vocab - 1), dtype=torch.float64)
        p[t] = c
        rows.append(p.log())
    return torch.stack(rows)


# ------------------------------------------------------------------------------------------ the rules
def test_threshold_rule_worked_examples():
    row = torch.tensor([5, MASK, MASK, MASK, 7])
    positions = torch.tensor([1, 2, 3])
    assert threshold_commit(row, _logits_for([0.95, 0.3, 0.6], [10, 11, 12]), positions, MASK, 0.9) == 1
    assert row.tolist() == [5, 10, MASK, MASK, 7]
    assert threshold_commit(row, _logits_for([0.99, 0.3, 0.6], [13, 11, 12]), positions, MASK, 0.9) == 1
    assert row.tolist() == [5, 10, MASK, 12, 7]  # nothing above 0.9 among masks: the most confident one
    assert threshold_commit(row, _logits_for([0.5, 0.95, 0.99], [0, 14, 15]), positions, MASK, 0.9) == 1
    assert row.tolist() == [5, 10, 14, 12, 7]  # committed positions are never rewritten


def test_stopping_rule():
    assert answer_end(torch.tensor([9, 4, EOS, MASK]), 1, MASK, EOS) == 3
    assert answer_end(torch.tensor([9, MASK, EOS, 4]), 1, MASK, EOS) is None  # a mask before the EOS
    assert answer_end(torch.tensor([9, 4, 5, 6]), 1, MASK, EOS) == 4  # complete without EOS


class _Scripted:
    """A DiffusionModel stand-in that fills a fixed answer, confident on `sure` positions, and counts calls."""

    mask_token_id, eos_token_id, shift, dual_cache = MASK, EOS, 0, False

    def __init__(self, answer, sure):
        self.answer, self.sure, self.calls = torch.tensor(answer), set(sure), 0

    def new_cache(self):
        return None

    def full(self, x, cache=None):
        self.calls += 1
        conf = [0.99 if p in self.sure else 0.5 for p in range(x.shape[1])]
        tokens = self.answer[: x.shape[1]].tolist()
        return _logits_for(conf, tokens).float()[None].expand(x.shape[0], -1, -1)

    def block(self, x, targets, write, cache=None):
        return self.full(x).gather(1, targets[..., None].expand(-1, -1, VOCAB))


def test_fast_dllm_nfe_accounting():
    prompt = torch.tensor([[3, 4]])
    answer = [3, 4] + [5, 6, 7, 8, 9, 10, EOS, EOS]
    model = _Scripted(answer, sure={2, 3, 4, 5})  # block 0 fills at once, block 1 one token per step
    result = fast_dllm_generate(model, prompt, gen_length=8, block_size=4)
    # block 0: 1 full forward; block 1: 1 full (commits position 6) + 2 block steps; EOS at 8 decided
    assert result.sequence.tolist() == answer[:9]
    assert (result.nfe_full, result.nfe_block, result.nfe) == (2, 2, 4) and model.calls == 4


def test_query_tokens_count_what_runs_through_the_model():
    """Without a dual cache (hub classes) a block step is a full forward of every row; with it, only the block."""
    prompt = torch.tensor([[3, 4]])
    answer = [3, 4] + [5, 6, 7, 8, 9, 10, EOS, EOS]
    scripted = fast_dllm_generate(_Scripted(answer, sure={2, 3, 4, 5}), prompt, gen_length=8, block_size=4)
    assert scripted.nfe == 4 and scripted.query_tokens == 4 * 10  # four forwards of all 10 positions
    batched = blockbatch_generate(_Scripted(answer, sure=set()), prompt, gen_length=8, block_sizes=(2, 4, 8),
                                  refresh_tokens=None)
    assert batched.query_tokens == 10 + batched.nfe_block * 3 * 10  # the init, then 3 rows x 10 per step
    dlm = tiny_dlm()
    cached = fast_dllm_generate(DiffusionModel(dlm), prompt, gen_length=8, block_size=4)
    assert cached.query_tokens == cached.nfe_full * 10 + cached.nfe_block * 4
    packed = blockbatch_generate(DiffusionModel(dlm), prompt, gen_length=8, block_sizes=(2, 8), refresh_tokens=None,
                                 exchange=False, stop_early=False)
    steps = [queries for kind, queries in packed.forwards if kind == "block"]
    assert steps and all(q in ((8, 2), (8,), (2,)) for q in steps)  # the live windows, 10 queries, not 2 x 8
    assert packed.query_tokens == 10 + sum(map(sum, steps))


class _DreamScripted(_Scripted):
    shift = 1


@pytest.mark.parametrize("style", [_Scripted, _DreamScripted])
def test_fast_dllm_block_opening_by_style(style):
    """LLaDA-style: the full forward that opens a block commits by the threshold rule. Dream-style (Fast-dLLM's
    Dream decoder): it commits the block's first token, however unsure, and the block forwards do the rest."""
    prompt = torch.tensor([[3, 4]])
    answer = [3, 4] + [5, 6, 7, 8, 9, 10, EOS, EOS]
    model = style(answer, sure={3, 4, 5, 6, 7, 8, 9})  # unsure only of the first answer token
    result = fast_dllm_generate(model, prompt, gen_length=8, block_size=4)
    assert result.sequence.tolist() == answer[:9]
    if style is _DreamScripted:
        # block 0: full (commits 5, unsure) + block (6, 7, 8); block 1: full (9) + block (10, EOS, EOS)
        assert (result.nfe_full, result.nfe_block) == (2, 2)
    else:
        # block 0: full (6, 7, 8) + block (5); block 1: full (9, 10, EOS, EOS)
        assert (result.nfe_full, result.nfe_block) == (2, 1)
    explicit = fast_dllm_generate(style(answer, sure={3, 4, 5, 6, 7, 8, 9}), prompt, gen_length=8, block_size=4,
                                  commit_first=style is _Scripted)
    assert explicit.sequence.tolist() == answer[:9] and explicit.nfe_block == (2 if style is _Scripted else 1)


def test_blockbatch_counts_one_batched_forward_as_one_nfe():
    prompt = torch.tensor([[3, 4]])
    answer = [3, 4] + [5, 6, 7, 8, 9, 10, EOS, EOS]
    model = _Scripted(answer, sure=set())
    result = blockbatch_generate(model, prompt, gen_length=8, block_sizes=(2, 4, 8), refresh_tokens=None)
    assert result.nfe == model.calls and result.nfe_full == 1
    assert result.sequence.tolist() == answer[:9]


class _PrefersMask(_Scripted):
    """Its top token at every answer position is the mask id itself; it fails after `limit` forwards, so a
    decoder that commits the mask (and so never finishes) fails the test instead of hanging it."""

    limit = 50

    def full(self, x, cache=None):
        if self.calls >= self.limit:
            raise RuntimeError(f"no end after {self.limit} forwards: the decoder is looping")
        logits = super().full(x, cache).clone()
        logits[..., MASK] = logits.max(-1).values + 1.0  # the mask beats the scripted token everywhere
        return logits


@pytest.mark.parametrize("decode", ["fast-dllm", "blockbatch"])
def test_a_model_that_prefers_the_mask_token_still_finishes(decode):
    prompt = torch.tensor([[3, 4]])
    answer = [3, 4] + [5, 6, 7, 8, 9, 10, EOS, EOS]
    model = _PrefersMask(answer, sure={2, 3, 4, 5, 6, 7, 8, 9})
    if decode == "fast-dllm":
        result = fast_dllm_generate(model, prompt, gen_length=8, block_size=4)
    else:
        result = blockbatch_generate(model, prompt, gen_length=8, block_sizes=(2, 4, 8), refresh_tokens=None)
    assert MASK not in result.sequence.tolist()
    assert result.sequence.tolist() == answer[:9]  # the runner-up, the scripted token, is committed


# ---------------------------------------------------------------------------------------- dual cache
@pytest.mark.parametrize("shift", [0, 1])
def test_block_forward_on_a_fresh_cache_equals_full_forward(shift):
    dlm = DiffusionModel(tiny_dlm(shift))
    x = torch.randint(3, VOCAB, (2, 20))
    cache = dlm.new_cache()
    full = dlm.full(x, cache)
    targets = torch.tensor([[8, 9, 10, 11], [12, 13, 14, 14]])
    write = torch.tensor([[True] * 4, [True, True, True, False]])  # padding repeats the last position
    block = dlm.block(x, targets, write, cache)
    expected = full.gather(1, targets[..., None].expand(-1, -1, VOCAB))
    assert torch.allclose(block[write], expected[write], atol=1e-5)
    assert not block[~write].any()  # padding is not run: zero logits


def ragged_block_equals_rows_alone(dlm: DiffusionModel, vocab: int, length: int = 20) -> None:
    """A block call of windows of 6 and 3 positions (the second padded) gives each row the logits and the cache
    entries of that row's call alone: the packed queries attend to their own cache row only."""
    device = next(dlm.model.parameters()).device
    gen = torch.Generator().manual_seed(5)
    before = torch.randint(3, vocab, (2, length), generator=gen)
    after = before.clone()
    after[:, 8:14] = torch.randint(3, vocab, (2, 6), generator=gen)  # the windows change after the full forward
    targets = torch.tensor([[8, 9, 10, 11, 12, 13], [11, 12, 13, 13, 13, 13]])
    write = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    before, after, targets, write = (t.to(device) for t in (before, after, targets, write))
    batched = dlm.new_cache()
    dlm.full(before, batched)
    logits = dlm.block(after, targets, write, batched)
    assert not logits[1, 3:].any()
    for r, n in ((0, 6), (1, 3)):
        alone = dlm.new_cache()
        dlm.full(before[r : r + 1], alone)
        window = targets[r : r + 1, :n]
        expected = dlm.block(after[r : r + 1], window, torch.ones_like(window, dtype=torch.bool), alone)
        torch.testing.assert_close(logits[r, :n], expected[0], atol=1e-5, rtol=1e-4)
        for mine, theirs in ((batched.keys, alone.keys), (batched.values, alone.values)):
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a[r], b[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shift", [0, 1])
def test_ragged_block_call_equals_each_row_alone(shift):
    ragged_block_equals_rows_alone(DiffusionModel(tiny_dlm(shift)), VOCAB)


@pytest.mark.parametrize("widths", [(4, 4), (4, 0, 2), (0, 3)])
def test_block_call_of_several_rows_equals_each_row_alone(widths):
    """Rows of equal windows (no padding), and a row that runs nothing (its cache row untouched, zero logits): the
    rows' queries attend in one call, each to its own cache row, as each row's call alone does."""
    dlm = DiffusionModel(tiny_dlm(0))
    gen = torch.Generator().manual_seed(len(widths))
    before = torch.randint(3, VOCAB, (len(widths), 16), generator=gen)
    after = before.clone()
    after[:, 6:10] = torch.randint(3, VOCAB, (len(widths), 4), generator=gen)
    width = max(widths)
    targets = torch.arange(6, 6 + width).expand(len(widths), width).clone()
    write = torch.tensor([[k < n for k in range(width)] for n in widths])
    batched = dlm.new_cache()
    dlm.full(before, batched)
    kept = [k.clone() for k in batched.keys]
    logits = dlm.block(after, targets, write, batched)
    for r, n in enumerate(widths):
        if n == 0:
            assert not logits[r].any()
            assert all(torch.equal(a[r], b[r]) for a, b in zip(batched.keys, kept))
            continue
        alone = dlm.new_cache()
        dlm.full(before[r : r + 1], alone)
        expected = dlm.block(after[r : r + 1], targets[r : r + 1, :n], write[r : r + 1, :n], alone)
        torch.testing.assert_close(logits[r, :n], expected[0], atol=1e-5, rtol=1e-4)
        for a, b in zip(batched.keys, alone.keys):
            torch.testing.assert_close(a[r], b[0], atol=1e-5, rtol=1e-4)


def test_dual_cache_rows_copy_and_refill_as_views_of_one_tensor():
    """Expanded, the cache keeps every layer's keys and values in one tensor: a row copied, or every row refilled
    from a one-row cache, changes each layer's keys and values as a copy per tensor would, and a block call after
    that writes into the same storage."""
    dlm = DiffusionModel(tiny_dlm(0))
    x = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = dlm.new_cache()
    dlm.full(x, cache)
    one = [t.clone() for t in (*cache.keys, *cache.values)]
    cache.expand(3)
    assert cache.storage is not None and cache.storage.shape[:2] == (2 * len(cache.keys), 3)
    for t in (*cache.keys, *cache.values):
        t[1].normal_()  # row 1 diverges
    expected = [t[1].clone() for t in (*cache.keys, *cache.values)]
    cache.copy_row(2, 1)
    assert all(torch.equal(t[2], e) for t, e in zip((*cache.keys, *cache.values), expected))
    assert all(torch.equal(t[0], o[0]) for t, o in zip((*cache.keys, *cache.values), one))
    other = dlm.new_cache()
    dlm.full(x.flip(1), other)
    cache.fill(other)
    assert all(torch.equal(t[r], u[0]) for t, u in zip((*cache.keys, *cache.values), (*other.keys, *other.values))
               for r in range(3))
    window = torch.arange(4, 8).expand(3, 4)
    dlm.block(x.expand(3, -1), window, torch.ones_like(window, dtype=torch.bool), cache)
    assert cache.keys[0].data_ptr() == cache.storage[0].data_ptr()  # still a view: the block call wrote into it
    assert torch.equal(cache.storage[0], cache.keys[0])


def test_dual_cache_replaces_the_block_in_place():
    """With one layer, cached K/V depend only on their own token, so the dual cache is exact."""
    dlm = DiffusionModel(tiny_dlm(0, layers=1))
    x = torch.randint(3, VOCAB, (1, 16))
    cache = dlm.new_cache()
    dlm.full(x, cache)
    x[0, 5:9] = torch.tensor([7, 8, 9, 10])  # the block changes
    window = torch.arange(5, 9)[None]
    block = dlm.block(x, window, torch.ones_like(window, dtype=torch.bool), cache)
    assert torch.allclose(block[0], dlm.full(x)[0, 5:9], atol=1e-5)
    fresh = dlm.new_cache()
    dlm.full(x, fresh)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(cache.keys, fresh.keys))


# -------------------------------------------------------------------------------- BlockBatch policies
def _state(rows, sizes, prompt_len=2):
    dlm = DiffusionModel(tiny_dlm())
    x = torch.tensor(rows)
    state = _Branches(dlm, x, prompt_len, list(sizes))
    state.cache = dlm.new_cache()
    dlm.full(x[:1], state.cache)
    state.cache.expand(len(rows))
    for i in range(len(rows)):
        state.snap(i)
    return state


def test_merge_adopts_only_confident_compatible_tokens():
    """The branch furthest ahead adopts what branches behind it hold in their windows, when its own
    stored probability for the token clears the gate."""
    m = MASK
    state = _state([[3, 4, 10, 11, 12, 13, 14, 15, m, m],   # branch 0 (block 2), window [6, 8)
                    [3, 4, 10, 11, 12, 13, m, m, m, m]], sizes=[2, 8])  # branch 1 (block 8), window [2, 10)
    state.start = [6, 2]
    state.best[1, 6], state.prob[1, 6] = 14, 0.8  # branch 1's own beliefs
    state.best[1, 7], state.prob[1, 7] = 15, 0.3
    assert merge(state, gate=0.5) == 1
    assert int(state.x[1, 6]) == 14 and int(state.x[1, 7]) == MASK
    with pytest.raises(ValueError, match="merge_gate must be at least 0.5"):  # the map holds the top token only
        blockbatch_generate(DiffusionModel(tiny_dlm()), torch.tensor([[3, 4]]), gen_length=8, block_sizes=(4, 8),
                            merge_gate=0.3)
    # an incompatible source (disagrees where both are filled) gives nothing
    state.x[1, 6], state.x[0, 3], state.start = MASK, 20, [6, 2]
    assert merge(state, gate=0.5) == 0


def _merge_by_the_rule(x, starts, sizes, best, prob, gate, live=None):
    """The merge as the paper states it, one destination and one source at a time, among the `live` branches (all
    when None): a reference for `merge`."""
    x = x.clone()
    live = range(len(sizes)) if live is None else live
    order = sorted(live, key=lambda i: starts[i] + sizes[i], reverse=True)
    before = x.clone()
    for rank, dst in enumerate(order):
        for pos in range(x.shape[1]):
            if before[dst, pos] != MASK or prob[dst, pos] <= gate:
                continue
            for src in order[rank + 1 :]:
                both = (before[dst] != MASK) & (before[src] != MASK)
                compatible = bool((before[dst][both] == before[src][both]).all())
                inside = starts[src] <= pos < starts[src] + sizes[src]
                if compatible and inside and before[src, pos] == best[dst, pos]:
                    x[dst, pos] = best[dst, pos]
    return x


@pytest.mark.parametrize("seed", range(40))
def test_merge_equals_the_rule_one_pair_at_a_time(seed):
    """The one-pass merge equals the rule applied destination by destination on random branch states (3-4 branches,
    overlapping windows, compatible and clashing rows; in half of them a branch is done, and a probability floor
    above the gate in a quarter: the paper's map holds no probability at or below it)."""
    g = torch.Generator().manual_seed(seed)
    n, length, p = int(torch.randint(3, 5, (1,), generator=g)), 18, 2
    truth = torch.randint(3, 8, (length,), generator=g)
    rows = truth.repeat(n, 1)
    rows[torch.rand(n, length, generator=g) < 0.5] = MASK
    clash = torch.rand(n, length, generator=g) < 0.08
    rows[clash] = 9  # a token another branch may disagree with
    sizes = [2, 4, 8, 16][:n]
    state = _state(rows.tolist(), sizes=sizes, prompt_len=p)
    state.x[:, :p] = truth[:p]
    state.done = [False] * n
    state.start = [p + int(torch.randint(0, length - p - s + 1, (1,), generator=g)) for s in sizes]
    state.best[:] = torch.where(torch.rand(n, length, generator=g) < 0.8, truth, truth + 1)
    state.prob[:] = torch.rand(n, length, generator=g)
    state.floor = 0.7 if seed % 4 == 3 else 0.1
    if seed % 2:
        state.done[int(torch.randint(0, n, (1,), generator=g))] = True
    live = [i for i in range(n) if not state.done[i]]
    before = state.x.clone()
    held = torch.where(state.prob > state.floor, state.prob, 0.0)  # the paper's map
    want = _merge_by_the_rule(before, state.start, sizes, state.best, held, 0.5, live)
    adopted = merge(state, gate=0.5)
    assert torch.equal(state.x, want)
    assert adopted == int((want != before).sum())


def test_sync_copies_the_leader_row_and_cache_and_keeps_its_grid():
    m = MASK
    state = _state([[3, 4] + [5] * 12 + [m] * 2,
                    [3, 4, 5] + [m] * 13], sizes=[4, 8])
    state.cache.keys[0][0, :, 5] += 1.0  # make the leader's cache row recognisable
    state.since_refresh = [5, 0]  # the leader's row has advanced 5 tokens since the last refresh
    assert sync(state, threshold=8) == 1
    assert torch.equal(state.x[1], state.x[0])
    assert torch.equal(state.cache.keys[0][1], state.cache.keys[0][0])
    assert state.start[1] == 2 + 8  # its own 8-grid at the first mask (position 14 -> block [10, 18))
    assert state.since_refresh[1] == 5  # its cache row is the leader's: as stale, not 8 tokens staler
    assert sync(state, threshold=8) == 0


def test_periodic_refresh_runs_one_batched_full_forward():
    prompt = torch.randint(3, VOCAB, (1, 4))
    result = blockbatch_generate(DiffusionModel(tiny_dlm()), prompt, gen_length=16, block_sizes=(4, 8),
                                 refresh_tokens=4, stop_early=False)
    assert result.events["refreshes"] >= 1
    assert result.nfe_full == 1 + result.events["refreshes"]
    assert result.nfe == result.nfe_full + result.nfe_block


@pytest.mark.parametrize("shift", [0, 1])
def test_batched_branches_equal_each_branch_alone_without_exchange(shift):
    dlm = DiffusionModel(tiny_dlm(shift, seed=3))
    prompt = torch.randint(3, VOCAB, (1, 5))
    kw = dict(gen_length=16, refresh_tokens=None, exchange=False, stop_early=False, threshold=0.05)
    together = blockbatch_generate(dlm, prompt, block_sizes=(2, 4, 8), **kw)
    for i, b in enumerate((2, 4, 8)):
        alone = blockbatch_generate(dlm, prompt, block_sizes=(b,), **kw)
        assert torch.equal(together.branch_rows[i], alone.branch_rows[0]), f"block size {b}"


# -------------------------------------------------------------------------------- entry points, errors
def test_generate_with_custom_generate_and_clear_errors():
    model = tiny_dlm()
    prompt = torch.randint(3, VOCAB, (2, 6))
    stats = []
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, custom_generate=dllm_generate,
                         dllm_method="blockbatch", block_sizes=(4, 8), dllm_stats=stats)
    direct = blockbatch_generate(DiffusionModel(model), prompt[:1], 16, (4, 8))
    assert torch.equal(out[0, : direct.sequence.numel()], direct.sequence) and len(stats) == 2
    with pytest.raises(ValueError, match="dllm_method"):
        model.generate(prompt, max_new_tokens=16, custom_generate=dllm_generate, dllm_method="beam")
    with pytest.raises(ValueError, match="Unsupported model class"):
        DiffusionModel(tiny_target("llama"))
    with pytest.raises(ValueError, match="multiple of"):
        fast_dllm_generate(DiffusionModel(model), prompt[:1], gen_length=20, block_size=8)
    with pytest.raises(ValueError, match="mask_token_id"):
        DiffusionLM(DiffusionLMConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4))


@pytest.mark.parametrize("options, message", [
    (dict(dllm_method="blockbatch", block_sizes=(0, 8)), r"block size must be a whole number.*\[0\] are not"),
    (dict(dllm_method="blockbatch", block_sizes=(8, 8)), "repeat"),
    (dict(dllm_method="blockbatch", block_sizes=()), "none given"),
    (dict(dllm_method="blockbatch", block_sizes=(4, 8), threshold=-0.5), r"threshold must be a probability"),
    (dict(dllm_method="blockbatch", block_sizes=(4, 8), refresh_tokens=0), "refresh_tokens"),
    (dict(dllm_method="blockbatch", block_sizes=(4, 8), sync_threshold=-1), "sync_threshold"),
    (dict(dllm_method="fast-dllm", block_size=0), "whole number"),
    (dict(dllm_method="fast-dllm", block_size=8, threshold=float("nan")), "threshold"),
])
def test_bad_dllm_options_are_refused_before_decoding(options, message):
    model = tiny_dlm()
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        model.generate(torch.randint(3, VOCAB, (1, 6)), max_new_tokens=16, custom_generate=dllm_generate, **options)
    assert not calls
