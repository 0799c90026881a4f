"""D²SD: boundary scores, token trees, one-forward tree verification, cache compaction, and the decode
loop (greedy identity, lossless sampling, the branches actually recovering rejected drafts)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from hf_dscale import DScaleDrafter
from hf_dscale.engine import accept, loop
from hf_dscale.engine.plan import BRANCH_POLICIES
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.engine.proposers import boundary_scores, own_branches, ranked_branches, throughput_tree, top_prefixes
from hf_dscale.models.dscale.assistant import draft_length
from hf_dscale.engine.tree import TokenTree, walk_tree
from hf_dscale.models.dscale import assistant, compat

from ..conftest import MASK_ID, OracleDrafter, fix_verify_costs, oracle_from, restrict, tiny_drafter, tiny_target
from .test_exactness import _prompt
from .test_sampling_end_to_end import NEW, TEMPERATURE, setup  # noqa: F401  (module fixture)
from .test_acceptance import _pvalue


# ------------------------------------------------------------------------------------------- selection
def test_boundary_scores_worked_example():
    r = boundary_scores(torch.tensor([0.9, 0.5, 0.8]))
    assert torch.allclose(r, torch.tensor([0.1, 0.45, 0.09]))


def test_ranked_branches_spend_branches_where_rejection_is_likely():
    # boundary 0 (r 0.8): the VP drafter puts 0.5 on the spine's token 7, then 0.25 on 3 and 0.15 on 5;
    # boundary 1 (r 0.1): 0.9 on token 2. Scores 0.8*0.5 = 0.4, 0.8*0.3 = 0.24, 0.1*0.9 = 0.09.
    vocab = 10
    probs = torch.full((2, 2, vocab), 1e-4)
    probs[0, 0, 7], probs[0, 0, 3], probs[0, 0, 5] = 0.5, 0.25, 0.15
    probs[1, 1, 2] = 0.9
    spine = torch.tensor([7, 4])
    scores = torch.tensor([0.8, 0.1])
    chosen = ranked_branches(probs.log(), [0, 1], spine, scores, k=3)
    assert chosen == [(0, 0, 3), (0, 0, 5), (1, 1, 2)]  # two branches at the root, one at depth 1
    assert all(token != int(spine[i]) for _, i, token in chosen)  # never the spine's own token
    assert ranked_branches(probs.log(), [0, 1], spine, scores, k=1) == [(0, 0, 3)]


def test_ranked_branches_read_compact_columns_as_the_whole_vocabulary():
    """Compact VP logits (a draft vocabulary's columns, `columns` their token ids) pick the same branches as
    the same logits spread over the whole vocabulary, whether the spine's token is among the columns or not."""
    torch.manual_seed(0)
    columns = torch.tensor([4, 9, 11, 17, 22, 28, 31, 36])
    compact = torch.randn(2, 3, len(columns))
    whole = torch.full((2, 3, 40), float("-inf")).index_copy(-1, columns, compact)
    prefixes, scores = [0, 2], torch.tensor([0.5, 0.2, 0.3])
    for spine in (torch.tensor([17, 9, 22]), torch.tensor([5, 3, 30])):  # among the columns / outside them
        for k in (1, 3, 5):
            chosen = ranked_branches(compact, prefixes, spine, scores, k, columns)
            assert chosen == ranked_branches(whole, prefixes, spine, scores, k)
            assert all(token in columns.tolist() for _, _, token in chosen)


def test_top_prefixes_are_the_k_largest_ascending():
    c = torch.tensor([0.99, 0.2, 0.99, 0.99, 0.1, 0.9, 0.5])
    r = boundary_scores(c)
    picked = top_prefixes(c, 3)
    assert picked == sorted(picked) and len(picked) == 3
    assert set(picked) == set(r.topk(3).indices.tolist())
    assert top_prefixes(c[:2], 4) == [0, 1]  # never more than γ-1 candidates


# ----------------------------------------------------------------------------------------------- trees
def test_token_tree_shares_prefixes():
    tree = TokenTree.from_candidates(42, [[5, 7], [5, 9], [6]])
    assert tree.tokens == [42, 5, 7, 9, 6]
    assert tree.parents == [-1, 0, 1, 1, 0]
    assert tree.depths == [0, 1, 2, 2, 1]
    assert tree.path(3) == [5, 9] and tree.path(0) == []
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)


def test_walk_tree_follows_matches_and_stops_at_first_miss():
    tree = TokenTree.from_candidates(42, [[5, 7, 8], [5, 9], [6]])
    answers = {0: 5, 1: 9, 4: 3}  # node -> the target's token after it; node 4 is "9" under "5"
    output, path = walk_tree(tree, lambda node: answers[node])
    assert output == [5, 9, 3] and path == [0, 1, 4]
    output, path = walk_tree(tree, lambda node: 2)  # first token already off the tree
    assert output == [2] and path == [0]


def _conditional(vocab: int, prefix: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.softmax(2.0 * torch.randn(vocab, generator=g), -1)


def _walk_samples(walk, n: int, vocab: int = 5, seed: int = 0) -> torch.Tensor:
    """First two tokens from repeated cycles over a fixed tree, under a synthetic target conditional."""
    torch.manual_seed(seed)
    tree = TokenTree.from_candidates(0, [[1, 2, 3], [1, 4], [2, 2], [3]])
    out = torch.empty(n, 2, dtype=torch.long)
    for s in range(n):
        def choose(node):
            return int(torch.multinomial(_conditional(vocab, tuple(tree.path(node))), 1))
        output, _ = walk(tree, choose)
        if len(output) == 1:  # the next cycle would sample after the bonus token
            output.append(int(torch.multinomial(_conditional(vocab, (output[0],)), 1)))
        out[s] = torch.tensor(output[:2])
    return out


def _pair_pvalue(samples: torch.Tensor, vocab: int = 5) -> float:
    exact = torch.stack([_conditional(vocab, ())[a] * _conditional(vocab, (a,)) for a in range(vocab)]).reshape(-1)
    exact = exact.double() / exact.double().sum()
    counts = torch.bincount(samples[:, 0] * vocab + samples[:, 1], minlength=vocab * vocab).double()
    return float(chisquare(counts, exact * counts.sum()).pvalue)


def _lenient_walk(tree, choose):
    """A wrong rule: when the target's sample misses, take a drafted child anyway half the time."""
    node, output, path = 0, [], [0]
    while True:
        token = choose(node)
        if token not in tree.children[node] and tree.children[node] and torch.rand(()) < 0.5:
            token = next(iter(tree.children[node]))
        output.append(token)
        child = tree.children[node].get(token)
        if child is None:
            return output, path
        node = child
        path.append(child)


def test_tree_walk_sampling_is_lossless_and_the_check_has_power():
    assert _pair_pvalue(_walk_samples(walk_tree, 20000)) > 1e-4
    assert _pair_pvalue(_walk_samples(_lenient_walk, 20000)) < 1e-6


# -------------------------------------------------------------------------------- target verification
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tree_forward_and_kept_path_match_plain_forwards(kind):
    target = tiny_target(kind)
    prompt = torch.randint(3, MASK_ID, (1, 11), generator=torch.Generator().manual_seed(4))
    tree = TokenTree.from_candidates(7, [[5, 9, 11], [5, 12], [13, 14]])
    with torch.no_grad():
        cache = compat.position_cache()
        target(input_ids=prompt, use_cache=True, **compat.cache_kwargs(target, cache))
        c = prompt.shape[1]
        allowed = torch.cat((torch.ones(len(tree), c, dtype=torch.bool), tree.ancestor_mask()), dim=1)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        positions = torch.tensor([tree.depths]) + c
        out = target(input_ids=torch.tensor([tree.tokens]), attention_mask=mask[None, None], position_ids=positions,
                     use_cache=True, **compat.cache_kwargs(target, cache)).logits[0]
        for leaf in (3, 4, 6):  # every root-to-leaf path, fed alone
            nodes = [leaf]
            while tree.parents[nodes[-1]] >= 0:
                nodes.append(tree.parents[nodes[-1]])
            nodes = nodes[::-1]
            alone = target(torch.cat((prompt, torch.tensor([[tree.tokens[n] for n in nodes]])), dim=1)).logits[0, c:]
            assert torch.allclose(out[nodes], alone, atol=1e-5)
        # keep the path anchor -> 5 -> 12 and continue: same as feeding it after the prompt
        compat.keep_paths(cache, c, torch.tensor([[0, 1, 4]]))
        compat.crop_to(cache, c + 3)
        assert cache.get_seq_length() == c + 3
        nxt = target(input_ids=torch.tensor([[3]]), position_ids=torch.tensor([[c + 3]]), use_cache=True,
                     **compat.cache_kwargs(target, cache)).logits[0, -1]
        full = target(torch.cat((prompt, torch.tensor([[7, 5, 12, 3]])), dim=1)).logits[0, -1]
        assert torch.allclose(nxt, full, atol=1e-5)


# ---------------------------------------------------------------------------------------- decode loop
class _ConfidentOracle(OracleDrafter):
    """An oracle first drafter whose wrong tokens come with low confidence (as a calibrated drafter's)."""

    def draft_logits(self, anchor_ids, taps, anchor_positions, context_position_ids, cache, context_valid=None,
                     vocab=None, compact=False):
        real = DScaleDrafter.draft_logits(self, anchor_ids, taps, anchor_positions, context_position_ids, cache,
                                          context_valid, vocab)  # the real forward keeps the caches honest
        logits = torch.zeros_like(real)
        seq = self.oracle[0]
        for k in range(real.shape[1]):
            pos = int(anchor_positions[0]) + 1 + k
            right = seq[pos] if pos < len(seq) else 0
            if torch.rand(()) < self.error_rate:
                self.miss(logits[0, k], right)
            else:
                logits[0, k, right] += 30.0
        return restrict(logits, vocab, compact)

    @staticmethod
    def miss(row: torch.Tensor, right: int) -> None:
        row[(right + 1) % (row.shape[-1] - 1)] += 1.0  # wrong and unsure


class _OracleVP(OracleDrafter):
    """An oracle variable-prefix drafter: fills every row's masked positions with the reference."""

    def block_logits(self, block_ids, anchor_positions, taps, context_position_ids, cache, context_valid=None,
                     vocab=None, compact=False):
        real = super().block_logits(block_ids, anchor_positions, taps, context_position_ids, cache, context_valid,
                                    vocab)
        logits = torch.zeros_like(real)
        seq = self.oracle[0]
        for r in range(real.shape[0]):
            for k in range(real.shape[1]):
                pos = int(anchor_positions[0]) + 1 + k
                token = seq[pos] if pos < len(seq) else 0
                if torch.rand(()) < self.error_rate:
                    token = int(torch.randint(0, real.shape[-1], ()))
                logits[r, k, token] += 30.0
        return restrict(logits, vocab, compact)


def _pair(target, reference, error_rate=0.3, vp_error_rate=0.0, block_size=8):
    first = tiny_drafter(target, cls=_ConfidentOracle, block_size=block_size)
    vp = tiny_drafter(target, cls=_OracleVP, block_size=block_size, seed=5)
    first.oracle = vp.oracle = oracle_from(reference)
    first.error_rate, vp.error_rate = error_rate, vp_error_rate
    return first, vp


@pytest.mark.parametrize("policy", BRANCH_POLICIES)
def test_greedy_identity_random_drafters(target, policy):
    drafter, vp = tiny_drafter(target), tiny_drafter(target, seed=7)
    for seed, (length, new) in enumerate([(5, 17), (12, 40)]):
        ids, _ = _prompt(1, length, seed)
        plain = target.generate(ids, max_new_tokens=new, do_sample=False)
        spec = target.generate(ids, max_new_tokens=new, do_sample=False, custom_generate=custom_generate,
                               drafter=drafter, vp_drafter=vp, branch_policy=policy)
        assert torch.equal(plain, spec)


@pytest.mark.parametrize("policy", BRANCH_POLICIES)
def test_branches_recover_rejected_drafts(target, policy):
    """With errors only in the first draft, at low confidence, the branches at those boundaries carry
    the right continuation: D²SD commits far more per forward than the first drafter alone."""
    ids, _ = _prompt(1, 10, seed=3)
    plain = target.generate(ids, max_new_tokens=60, do_sample=False)
    torch.manual_seed(0)
    first, vp = _pair(target, plain)
    block_stats, tree_stats = DecodeStats(), DecodeStats()
    block = target.generate(ids, max_new_tokens=60, do_sample=False, custom_generate=custom_generate,
                            drafter=first, dscale_stats=block_stats)
    tree = target.generate(ids, max_new_tokens=60, do_sample=False, custom_generate=custom_generate,
                           drafter=first, vp_drafter=vp, branch_policy=policy, dscale_stats=tree_stats)
    assert torch.equal(plain, block) and torch.equal(plain, tree)
    assert tree_stats.tau > 1.5 * block_stats.tau
    assert max(tree_stats.verified) <= 8 + 4 * 6  # spine + K branches, shared prefixes stored once


@pytest.mark.parametrize("policy", BRANCH_POLICIES)
def test_vp_rows_are_the_anchor_a_spine_prefix_and_masks(target, policy):
    """The one batched VP pass reads rows `[anchor, t_1..t_i, mask, ...]` with t the first draft."""
    ids, _ = _prompt(1, 10, seed=3)
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    torch.manual_seed(0)
    first, vp = _pair(target, plain)
    spines, calls = [], []
    first_logits, vp_logits = first.draft_logits, vp.block_logits

    def spy_first(*args, **kwargs):
        out = first_logits(*args, **kwargs)
        spines.append((int(args[0][0, 0]), out[0].argmax(-1).tolist()))
        return out

    def spy_vp(block_ids, *args, **kwargs):
        calls.append(block_ids.tolist())
        return vp_logits(block_ids, *args, **kwargs)

    first.draft_logits, vp.block_logits = spy_first, spy_vp
    out = target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=custom_generate,
                          drafter=first, vp_drafter=vp, branch_policy=policy, one_read=True)
    assert torch.equal(plain, out)
    # one VP pass per cycle; with one read a cycle, the last draft is made before the read that ends the generation
    assert len(calls) == len(spines) - 1 > 1
    for (anchor, spine), rows in zip(spines[:-1], calls, strict=True):
        assert 1 <= len(rows) <= 4
        for row in rows:
            i = next((k for k, t in enumerate(row[1:]) if t == MASK_ID), len(row) - 1)
            assert row[0] == anchor and row[1 : i + 1] == spine[:i]
            assert all(t == MASK_ID for t in row[i + 1 :]) and i < len(spine)


def _record_trees(monkeypatch) -> list[list[list[int]]]:
    """Every cycle's candidate paths (spine first), as D²SD hands them to TokenTree."""
    trees = []

    class Recording(TokenTree):
        @classmethod
        def from_candidates(cls, anchor, candidates):
            trees.append(candidates)
            return super().from_candidates(anchor, candidates)

    monkeypatch.setattr(loop, "TokenTree", Recording)
    return trees


@pytest.mark.parametrize("policy", BRANCH_POLICIES)
def test_draft_confidence_caps_every_path_at_the_confident_head(target, policy, monkeypatch):
    """With `draft_confidence`, the spine and every branch end at the first drafter's confident head
    (at least the minimum); branches inside it still fix low-confidence errors, and output is unchanged."""
    ids, _ = _prompt(1, 10, seed=3)
    plain = target.generate(ids, max_new_tokens=60, do_sample=False)
    torch.manual_seed(0)
    first, vp = _pair(target, plain)  # 7 drafts per block; wrong drafts come with low confidence
    heads, draft_logits = [], first.draft_logits

    def spy(*args, **kwargs):
        out = draft_logits(*args, **kwargs)
        heads.append(draft_length(out, 0.5))
        return out

    first.draft_logits = spy
    trees = _record_trees(monkeypatch)
    block_stats, tree_stats = DecodeStats(), DecodeStats()
    kw = dict(max_new_tokens=60, do_sample=False, custom_generate=custom_generate, drafter=first, draft_confidence=0.5,
              one_read=True)
    tree = target.generate(ids, **kw, vp_drafter=vp, branch_policy=policy, dscale_stats=tree_stats)
    assert torch.equal(plain, tree)
    heads = heads[:-1]  # one read a cycle: the last draft is made before the read that ends the generation
    assert len(heads) == len(trees) > 1 and min(heads) == 4 and max(heads) > 4
    for head, candidates in zip(heads, trees, strict=True):
        assert all(len(path) == head for path in candidates)
    block = target.generate(ids, **kw, dscale_stats=block_stats)
    assert torch.equal(plain, block)
    assert tree_stats.tau > block_stats.tau  # branches still recover errors inside the head


@pytest.mark.parametrize("vp_error_rate", [0.0, 0.3])
def test_greedy_identity_batched_with_processors_and_eos(vp_error_rate):
    target = tiny_target("llama", eos=5)
    ids, mask = _prompt(3, 9, seed=2)
    kw = dict(max_new_tokens=30, do_sample=False, repetition_penalty=1.3)
    plain = target.generate(input_ids=ids, attention_mask=mask, **kw)
    drafter = tiny_drafter(target, cls=OracleDrafter)
    vp = tiny_drafter(target, cls=OracleDrafter, seed=2)
    for model in (drafter, vp):
        model.oracle, model.error_rate = oracle_from(plain, mask), vp_error_rate
    spec = target.generate(input_ids=ids, attention_mask=mask, **kw, custom_generate=custom_generate,
                           drafter=drafter, vp_drafter=vp)
    assert torch.equal(plain, spec)


def test_rejects_mismatched_block_sizes_and_flash_attention(target, monkeypatch):
    drafter, vp = tiny_drafter(target, block_size=8), tiny_drafter(target, block_size=4)
    ids, _ = _prompt(1, 6, 0)
    with pytest.raises(ValueError, match="block_size"):
        target.generate(ids, max_new_tokens=4, custom_generate=custom_generate, drafter=drafter, vp_drafter=vp)
    with pytest.raises(ValueError, match="branch_policy"):
        target.generate(ids, max_new_tokens=4, custom_generate=custom_generate, drafter=drafter,
                        vp_drafter=tiny_drafter(target), branch_policy="best")
    monkeypatch.setattr(compat, "attention_implementation", lambda model: "flash_attention_2")
    for kw in (dict(vp_drafter=tiny_drafter(target)), dict(draft_tree=True)):
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            target.generate(ids, max_new_tokens=4, custom_generate=custom_generate, drafter=drafter, **kw)


def _tree_samples(target, drafter, vp, prompt, rows=1500, seed=0, **kwargs):
    torch.manual_seed(seed)
    ids = torch.tensor([prompt] * rows)
    out = target.generate(ids, max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE, top_k=None, top_p=None,
                          custom_generate=custom_generate, drafter=drafter, vp_drafter=vp, **kwargs)
    return out[:, len(prompt):]


def test_sampling_through_generate_matches_target(setup):  # noqa: F811
    target, drafter, prompt, exact = setup
    vp = tiny_drafter(target, block_size=4, seed=9)
    samples = _tree_samples(target, drafter, vp, prompt)
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"


def test_sampling_with_a_capped_tree_matches_target(setup, monkeypatch):  # noqa: F811
    target, drafter, prompt, exact = setup
    monkeypatch.setattr(assistant, "min_drafts_for", lambda target, forward=None: 1)  # blocks of only 3 drafts
    vp = tiny_drafter(target, block_size=4, seed=9)
    trees = _record_trees(monkeypatch)
    samples = _tree_samples(target, drafter, vp, prompt, seed=3, draft_confidence=0.2)
    assert min(len(paths[0]) for paths in trees) < 3  # the cap did shorten trees
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"


def _lenient_device_walk(verify, picks, logits):
    """`_lenient_walk`'s wrong rule in the engine's walk on the device: where the target's sample after a node is
    none of its children's tokens, take its first child's token instead, half the time."""
    b, n = verify.ids.shape
    child = verify.parents[:, None, :] == torch.arange(n)[None, :, None]  # [B, node, node's child]
    held = (child & (verify.ids[:, None, :] == picks[:, :, None])).any(-1)
    swap = child.any(-1) & ~held & (torch.rand(b, n) < 0.5)
    picks = torch.where(swap, verify.ids.gather(1, child.int().argmax(-1)), picks)
    return REAL_WALK(verify, picks, logits)


REAL_WALK = accept.walk


def test_sampling_check_through_generate_catches_broken_rule(setup, monkeypatch):  # noqa: F811
    target, drafter, prompt, exact = setup
    vp = tiny_drafter(target, block_size=4, seed=9)
    monkeypatch.setattr(accept, "walk", _lenient_device_walk)
    samples = _tree_samples(target, drafter, vp, prompt)
    assert min(_pvalue(samples[:, j], exact[j]) for j in range(NEW)) < 1e-6


def test_hub_style_custom_generate_folder_takes_the_vp_drafter():
    import os

    folder = os.path.join(os.path.dirname(__file__), "..", "..", "model_cards", "hf-dscale-generate")
    target = tiny_target("qwen3")
    ids, mask = _prompt(2, 7, seed=21)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
    stats = DecodeStats()
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=False,
                           custom_generate=os.path.abspath(folder), trust_remote_code=True,
                           drafter=tiny_drafter(target), vp_drafter=tiny_drafter(target, seed=8), dscale_stats=stats)
    assert torch.equal(plain, spec)
    assert stats.verified  # the tree path ran


@pytest.mark.parametrize("policy", BRANCH_POLICIES)
def test_a_vp_draft_vocab_proposes_as_its_whole_vocabulary_logits_masked(target, policy, monkeypatch):
    """A VP drafter with a draft vocabulary scores only its columns and maps them back to token ids: the
    trees are those of the same drafter over the whole vocabulary with the other tokens masked out."""
    ids, _ = _prompt(1, 10, seed=3)
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    # Every token of the output plus some others, so the set does not grow during decoding; small ids are
    # left out, so reading a column index as a token id would propose other tokens.
    allowed = sorted(set(plain[0].tolist()) | set(range(60, 90)) - set(range(12)))
    member = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    member[allowed] = True

    class Masked(DScaleDrafter):
        def block_logits(self, *args, **kwargs):
            return super().block_logits(*args, **kwargs).masked_fill(~member, float("-inf"))

    drafter = tiny_drafter(target)
    with_vocab, masked = tiny_drafter(target, seed=7), tiny_drafter(target, seed=7, cls=Masked)
    with_vocab.set_draft_vocab(allowed)
    runs = []
    for vp in (with_vocab, masked):
        trees = _record_trees(monkeypatch)
        out = target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=custom_generate,
                              drafter=drafter, vp_drafter=vp, branch_policy=policy)
        assert torch.equal(plain, out)
        runs.append(trees)
    assert runs[0] == runs[1] and len(runs[0]) > 1


# ------------------------------------------------------------------- the block drafter's own token tree
def test_own_branches_worked_example():
    # Depth 1: p(7) = 0.5 (the spine), p(3) = 0.3, p(5) = 0.15; depth 2: p(4) = 0.6 (the spine), p(2) = 0.35.
    # Scores (c_1...c_i) p(a): 3 -> 0.3, 5 -> 0.15, at depth 2 2 -> 0.5 * 0.35 = 0.175.
    probs = torch.full((2, 10), 1e-4)
    probs[0, 7], probs[0, 3], probs[0, 5] = 0.5, 0.3, 0.15
    probs[1, 4], probs[1, 2] = 0.6, 0.35
    spine, confidences = torch.tensor([7, 4]), torch.tensor([0.5, 0.6])
    assert own_branches(probs.log(), spine, confidences, k=3) == [(0, 3), (1, 2), (0, 5)]
    assert own_branches(probs.log(), spine, confidences, k=1) == [(0, 3)]


def test_own_branches_read_compact_columns_as_the_whole_vocabulary():
    torch.manual_seed(1)
    columns = torch.tensor([4, 9, 11, 17, 22, 28])
    compact = torch.randn(3, len(columns))
    whole = torch.full((3, 30), float("-inf")).index_copy(-1, columns, compact)
    confidences, picked = compact.softmax(-1).max(-1)
    spine = columns[picked]
    for k in (1, 4, 9):
        chosen = own_branches(compact, spine, confidences, k, columns)
        assert chosen == own_branches(whole, spine, confidences, k)
        assert len(chosen) == min(k, 3 * (len(columns) - 1))
        assert all(token in columns.tolist() and token != int(spine[i]) for i, token in chosen)


def test_throughput_tree_worked_example():
    # c = [0.9, 0.5]; the root's runner-up (token 3) at p 0.08 beats depth 2's (0.9 * 0.06): nodes 0.9, 0.45, 0.08,
    # 0.04. Costs {2: 10, 3: 11, 4: 16}: 1.9/10, 2.35/11, 2.43/16 tokens per ms -> the spine's two drafts.
    probs = torch.tensor([[0.0025] * 10, [0.055] * 10])
    probs[0, 7], probs[0, 3] = 0.9, 0.08
    probs[1, 4], probs[1, 2] = 0.5, 0.06
    logits, spine, confidences = probs.log(), torch.tensor([7, 4]), torch.tensor([0.9, 0.5])
    costs = {1: 9.0, 2: 10.0, 3: 11.0, 4: 16.0}
    assert throughput_tree(logits, spine, confidences, 1, costs) == [[7], [7, 4]]
    # A third node nearly free (2.43/11.2 > 2.35/11): the branch joins, without its child (the costs stop at 4).
    assert throughput_tree(logits, spine, confidences, 1, costs | {4: 11.2}) == [[7], [7, 4], [3]]
    # A cycle overhead makes width relatively cheaper, not enough here: 2.35/41 > 2.43/46.
    assert throughput_tree(logits, spine, confidences, 1, costs, overhead=30.0) == [[7], [7, 4]]
    # A width that costs as much as the next step verifies only the first draft.
    assert throughput_tree(logits, spine, confidences, 1, {1: 9.0, 2: 10.0, 3: 20.0, 4: 30.0}) == [[7]]
    # Compact logits: columns map back to token ids.
    columns = torch.arange(100, 110)
    assert throughput_tree(logits, columns[spine], confidences, 1, costs | {4: 11.2}, columns=columns) == \
        [[107], [107, 104], [103]]


def test_throughput_tree_is_a_tree_of_the_likeliest_nodes():
    """Flat costs take as many nodes as the costs cover, the likeliest first by the drafter's beliefs along each
    path; every node's parent is in, and every branch swaps exactly one spine token."""
    torch.manual_seed(3)
    logits = torch.randn(7, 12) * 2
    probs = logits.softmax(-1)
    confidences, spine = probs.max(-1)
    for width in (3, 8, 12):
        paths = throughput_tree(logits, spine, confidences, 4, {w: 1.0 for w in range(1, width + 1)})
        assert len(paths) == width - 1 and len({tuple(p) for p in paths}) == len(paths)
        assert all(tuple(p[:-1]) in {tuple(q) for q in paths} for p in paths if len(p) > 1)
        chances = [float(torch.tensor([probs[i, t] for i, t in enumerate(p)]).prod()) for p in paths]
        assert all(a >= b - 1e-6 for a, b in zip(chances, chances[1:]))  # likeliest first
        spine_paths = [spine[:d].tolist() for d in range(1, 8)]
        assert all(sum(x != y for x, y in zip(p, spine.tolist())) == 1 for p in paths if p not in spine_paths)


class _RunnerUpOracle(_ConfidentOracle):
    """An oracle block drafter that, when wrong, ranks the right token a close second (as a good drafter does)."""

    @staticmethod
    def miss(row: torch.Tensor, right: int) -> None:
        row[(right + 1) % (row.shape[-1] - 1)] += 3.0
        row[right] += 2.5


def test_own_tree_greedy_identity_random_drafter(target):
    drafter = tiny_drafter(target)
    for seed, (length, new) in enumerate([(5, 17), (12, 40)]):
        ids, _ = _prompt(1, length, seed)
        plain = target.generate(ids, max_new_tokens=new, do_sample=False)
        for k in (1, 4):
            spec = target.generate(ids, max_new_tokens=new, do_sample=False, custom_generate=custom_generate,
                                   drafter=drafter, draft_tree=True, num_branches=k)
            assert torch.equal(plain, spec)


@pytest.mark.parametrize("prompt_lookup", [False, True])
def test_own_tree_greedy_identity_batched_with_processors_and_eos(prompt_lookup):
    target = tiny_target("llama", eos=5)
    ids, mask = _prompt(3, 9, seed=2)
    kw = dict(max_new_tokens=30, do_sample=False, repetition_penalty=1.3)
    plain = target.generate(input_ids=ids, attention_mask=mask, **kw)
    drafter = tiny_drafter(target, cls=OracleDrafter)
    drafter.oracle, drafter.error_rate = oracle_from(plain, mask), 0.3
    spec = target.generate(input_ids=ids, attention_mask=mask, **kw, custom_generate=custom_generate,
                           drafter=drafter, draft_tree=True, prompt_lookup=prompt_lookup)
    assert torch.equal(plain, spec)


def test_own_tree_recovers_runner_up_drafts(target, monkeypatch):
    """Where the drafter's runner-up is the target's token, a branch carries it and the spine's later drafts:
    the own tree commits far more per forward than the chain, and every branch swaps exactly one spine token."""
    ids, _ = _prompt(1, 10, seed=3)
    plain = target.generate(ids, max_new_tokens=60, do_sample=False)
    torch.manual_seed(0)
    drafter = tiny_drafter(target, cls=_RunnerUpOracle)
    drafter.oracle, drafter.error_rate = oracle_from(plain), 0.3
    chain_stats, tree_stats = DecodeStats(), DecodeStats()
    kw = dict(max_new_tokens=60, do_sample=False, custom_generate=custom_generate, drafter=drafter, draft_confidence=0)
    chain = target.generate(ids, **kw, draft_tree=False, dscale_stats=chain_stats)
    trees = _record_trees(monkeypatch)
    tree = target.generate(ids, **kw, draft_tree=True, num_branches=4, dscale_stats=tree_stats)
    assert torch.equal(plain, chain) and torch.equal(plain, tree)
    assert tree_stats.tau > 1.25 * chain_stats.tau  # 4.5 against 3.3 here
    for spine, *branches in trees:
        assert len(branches) == 4
        assert all(len(b) == len(spine) and sum(x != y for x, y in zip(b, spine)) == 1 for b in branches)


def test_own_tree_auto_stays_within_the_measured_widths(target, monkeypatch):
    """draft_confidence="auto": each cycle's tree is the likeliest nodes within the block's measured widths, branches
    included where the costs allow, and output is unchanged."""
    ids, _ = _prompt(1, 10, seed=3)
    plain = target.generate(ids, max_new_tokens=60, do_sample=False)
    torch.manual_seed(0)
    drafter = tiny_drafter(target, cls=_RunnerUpOracle)
    drafter.oracle, drafter.error_rate = oracle_from(plain), 0.3
    block = drafter.config.block_size
    flat = {w: 1.0 for w in range(1, block + 1)}  # every width costs the same: the tree fills the block's width
    fix_verify_costs(monkeypatch, flat)
    trees, stats = _record_trees(monkeypatch), DecodeStats()
    out = target.generate(ids, max_new_tokens=60, do_sample=False, custom_generate=custom_generate, drafter=drafter,
                          draft_tree=True, draft_confidence="auto", dscale_stats=stats)
    assert torch.equal(plain, out)
    assert all(v == block for v in stats.verified)  # anchor + block - 1 nodes
    assert any(len(set(map(len, paths))) < len(paths) for paths in trees)  # some tree has two nodes at a depth


def test_own_tree_sampling_through_generate_matches_target(setup):  # noqa: F811
    target, drafter, prompt, exact = setup
    samples = _tree_samples(target, drafter, None, prompt, seed=5, draft_tree=True)
    for j in range(NEW):
        assert _pvalue(samples[:, j], exact[j]) > 1e-4, f"token {j + 1}"
