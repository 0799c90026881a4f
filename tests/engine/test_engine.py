"""The engine's own contracts: one loop for every method, batched; the plan made in one place and returned."""

from __future__ import annotations

import json

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_dscale.engine import Plan, calibrate, plan_for
from hf_dscale.engine.proposers import Draft, Path, own_tree_paths, select_nodes
from hf_dscale.engine.state import Verify
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.engine import target_forward
from hf_dscale.engine.tree import TokenTree
from hf_dscale.models.dscale import assistant, compat

from ..conftest import cpu_like_costs, tiny_drafter, tiny_target
from ..generation.test_exactness import _oracle, _prompt


# ------------------------------------------------------------------------------------------------- plan
def test_calibrate_chooses_the_sized_own_tree_with_lookup_for_greedy_and_a_chain_for_sampling():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    greedy = calibrate(target, drafter)
    assert (greedy.tree, greedy.prompt_lookup, greedy.draft_confidence) == (True, True, "auto")
    assert greedy.verify_costs == cpu_like_costs(drafter.config.block_size)  # conftest's table, measured once here
    assert greedy.transposed == tuple(range(1, drafter.config.block_size + 1))  # conftest: transposed is faster
    sampling = calibrate(target, drafter, do_sample=True)
    assert (sampling.tree, sampling.prompt_lookup) == (False, False)
    given = calibrate(target, drafter, tree=True, draft_confidence=0.3)
    assert (given.tree, given.prompt_lookup, given.draft_confidence, given.min_drafts) == (True, False, 0.3, 4)
    assert given.verify_costs is None  # a confidence cut needs no costs: none measured
    report = json.loads(json.dumps(greedy.to_dict()))
    assert report["verify_path"] == "split-head" and len(report["reasons"]) >= 3
    with pytest.raises(ValueError, match="prompt_lookup adds a path"):
        calibrate(target, drafter, tree=False, prompt_lookup=True)


def test_plan_for_measures_once_per_target_and_options(monkeypatch):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    calls = []
    real, real_ways = assistant.verify_costs_for, target_forward.verify_costs_ways
    monkeypatch.setattr(assistant, "verify_costs_for", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(target_forward, "verify_costs_ways", lambda *a, **k: calls.append(a) or real_ways(*a, **k))
    first = plan_for(target, drafter, batch_size=1)
    assert plan_for(target, drafter, batch_size=1) is first and len(calls) == 1
    assert plan_for(target, drafter, batch_size=2) is not first and len(calls) == 2  # costs are per batch size
    other = tiny_target("qwen3")
    plan_for(other, drafter, batch_size=1)
    assert len(calls) == 3  # a plan belongs to its target
    target.to(torch.bfloat16)
    assert plan_for(target, drafter, batch_size=1) is not first and len(calls) == 4  # and to its dtype (and device)


def test_a_given_plan_is_used_and_returned_and_excludes_method_options():
    target = tiny_target("llama")
    ids, mask = _prompt(2, 10, 0)
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    drafter = _oracle(target, plain, mask, 0.2)
    plan = Plan(device="cpu", batch_size=2, tree=False, prompt_lookup=False, num_branches=4, branch_policy="ranked",
                draft_confidence=0.0, min_drafts=None, transposed=None)
    stats = DecodeStats()
    spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                           custom_generate=custom_generate, drafter=drafter, plan=plan, dscale_stats=stats)
    assert torch.equal(plain, spec)
    assert stats.plan is plan and set(stats.verified) == {drafter.config.block_size}  # whole chains, as planned
    with pytest.raises(ValueError, match="either a plan or method options"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=custom_generate,
                        drafter=drafter, plan=plan, draft_tree=True)


def test_the_default_method_is_the_plans_choice():
    target = tiny_target("llama")
    ids, mask = _prompt(1, 12, 3)
    plain = target.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
    drafter = _oracle(target, plain, None, 0.3)
    stats = DecodeStats()
    spec = target.generate(input_ids=ids, max_new_tokens=24, do_sample=False, custom_generate=custom_generate,
                           drafter=drafter, dscale_stats=stats)
    assert torch.equal(plain, spec)
    assert stats.plan.tree and stats.plan.prompt_lookup and stats.plan.method() == "dscale-tree+lookup"


# ------------------------------------------------------------------------------------------ trees, batched
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("vp", [False, True])
def test_trees_decode_batched_with_uneven_padding(kind, vp):
    """Own trees and D²SD decode every row in one verify per cycle (no row-by-row loop), exactly."""
    target = tiny_target(kind)
    for seed in range(2):
        ids, mask = _prompt(4, 14, seed)
        plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=26, do_sample=False)
        drafter = _oracle(target, plain, mask, 0.3, seed)
        kw = dict(vp_drafter=tiny_drafter(target, seed=5)) if vp else dict(draft_tree=True, prompt_lookup=True)
        stats = DecodeStats()
        spec = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=26, do_sample=False,
                               custom_generate=custom_generate, drafter=drafter, dscale_stats=stats, **kw)
        assert torch.equal(plain, spec), f"seed {seed}"
        assert len(stats.committed) > stats.cycles  # several rows committed per cycle: one verify for the batch
        assert stats.plan.batch_size == 4


@pytest.mark.parametrize("how", ["tree", "chain", "d2sd"])
def test_rows_that_stop_leave_the_batch(monkeypatch, how):
    """A row that meets EOS leaves the batch: the verifies after it run only the rows still decoding, which keep
    their own caches, processors (the repetition penalty's per-row state) and outputs, identical to plain decoding."""
    from hf_dscale.engine import loop

    target = tiny_target("llama")
    ids, mask = _prompt(4, 12, 7)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, repetition_penalty=1.3)
    free = target.generate(**kw)[:, ids.shape[1] :]
    eos = int(free[1, 4])  # row 1 stops at its 5th token; the others where (if) they meet it
    target.generation_config.eos_token_id = eos
    try:
        plain = target.generate(**kw)
        stops = [(row == eos).nonzero()[0, 0].item() + 1 if (row == eos).any() else 30 for row in free]
        assert len(set(stops)) > 1, stops
        sizes, verify = [], loop.Engine.verify
        monkeypatch.setattr(loop.Engine, "verify", lambda self, v: sizes.append(v.ids.shape[0]) or verify(self, v))
        drafter = _oracle(target, plain, mask, 0.3)
        options = {"tree": dict(draft_tree=True, prompt_lookup=True), "chain": dict(draft_tree=False),
                   "d2sd": dict(vp_drafter=tiny_drafter(target, seed=5))}[how]
        spec = target.generate(**kw, custom_generate=custom_generate, drafter=drafter, **options)
    finally:
        target.generation_config.eos_token_id = None
    assert torch.equal(plain, spec)
    assert sizes[0] == 4 and sizes == sorted(sizes, reverse=True) and sizes[-1] < 4, sizes


def test_keep_paths_packs_each_rows_path():
    cache = compat.position_cache(16)
    keys = torch.arange(2 * 1 * 7 * 1, dtype=torch.float).view(2, 1, 7, 1)
    cache.update(keys.clone(), keys.clone(), 0)
    compat.keep_paths(cache, 3, torch.tensor([[0, 2, 3], [0, 1, 0]]))  # row 0: nodes 0, 2, 3; row 1: 0, 1 (+ a hole)
    compat.crop_to(cache, 6)
    got = cache.layers[0].keys[:, 0, :, 0]
    assert got.tolist() == [[0, 1, 2, 3, 5, 6], [7, 8, 9, 10, 11, 10]]


def test_position_cache_writes_in_place_overwrites_what_a_crop_dropped_and_grows():
    cache = compat.position_cache(8)
    first = torch.arange(5.0).view(1, 1, 5, 1)
    cache.update(first, first + 100, 0)
    layer = cache.layers[0]
    buffer = layer.key_buffer.data_ptr()
    assert layer.key_buffer.shape[-2] == 10  # twice the first write, above the capacity of 8
    compat.crop_to(cache, 3)  # a rejected draft: the view shrinks, the buffer stays
    assert cache.get_seq_length() == 3 and layer.key_buffer.data_ptr() == buffer
    keys, values = cache.update(torch.full((1, 1, 4, 1), -1.0), torch.full((1, 1, 4, 1), -2.0), 0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, -1, -1, -1, -1] and values[0, 0, 3:, 0].tolist() == [-2] * 4
    assert layer.key_buffer.data_ptr() == buffer  # written in place over the cropped entries
    keys, _ = cache.update(torch.full((1, 1, 6, 1), 7.0), torch.zeros(1, 1, 6, 1), 0)  # past the buffer: it grows
    assert keys.shape[-2] == 13 and keys[0, 0, :4, 0].tolist() == [0, 1, 2, -1] and layer.key_buffer.shape[-2] == 26
    two = compat.position_cache(4)
    two.update(torch.arange(6.0).view(2, 1, 3, 1), torch.zeros(2, 1, 3, 1), 0)
    two.layers[0].batch_select_indices(torch.tensor([1]))  # a reorder replaces the views with copies ...
    keys, _ = two.update(torch.full((1, 1, 1, 1), 9.0), torch.zeros(1, 1, 1, 1), 0)  # ... which a write keeps
    assert keys[0, 0, :, 0].tolist() == [3, 4, 5, 9]


def test_verify_pads_trees_with_nodes_that_see_only_themselves():
    chain = TokenTree.from_candidates(4, [[5, 6]])
    tree = TokenTree.from_candidates(4, [[5], [7, 8]])
    batch = Verify.of([chain, tree], torch.tensor([10, 3]))
    assert batch.ids.tolist() == [[4, 5, 6, 4], [4, 5, 7, 8]]
    assert batch.positions.tolist() == [[10, 11, 12, 10], [3, 4, 4, 5]]
    assert batch.allowed[0, 3].tolist() == [False, False, False, True]
    assert batch.allowed[1].tolist() == tree.ancestor_mask().tolist()
    plain = Verify.of([chain, TokenTree.from_candidates(9, [[1, 2]])], torch.tensor([10, 3]))
    assert plain.allowed is None  # equal chains take a padding mask


# --------------------------------------------------------------------------------------------- proposers
def test_select_nodes_is_the_chain_where_no_branch_pays_and_counts_shared_nodes_once():
    spine = Path([5, 6], [0.9, 0.45])
    branch = Path([7], [0.08])
    assert select_nodes([spine, branch], {1: 9, 2: 10, 3: 11, 4: 16}) == [[5], [5, 6]]
    assert select_nodes([spine, branch], None) == [[5, 6], [7]]  # unsized: every path whole
    lookup = Path([5, 6, 2], [0.95, 0.9, 0.8])  # shares the spine's nodes, with better chances
    chosen = select_nodes([spine, lookup], {w: 10.0 for w in range(1, 6)})
    assert chosen == [[5], [5, 6], [5, 6, 2]]


def test_own_tree_paths_swap_one_runner_up_and_keep_the_spines_later_drafts():
    logits = torch.tensor([[[3.0, 2.0, -9.0], [-9.0, 3.0, 2.5]]])  # [B=1, K=2, V=3]
    confidences, spine = logits.softmax(-1).max(-1)
    paths = own_tree_paths(Draft(spine, confidences, logits), 0, 2, 1)
    assert [p.tokens for p in paths] == [[0, 1], [0, 2]]  # the best swap: depth 2's runner-up (token 2)
    c1 = float(confidences[0, 0])
    assert paths[1].chances == pytest.approx([c1, c1 * float(logits[0, 1].softmax(-1)[2])])


def test_draft_context_cache_keeps_the_context_in_place_and_returns_context_then_block():
    from hf_dscale.models.dscale import DraftContextCache

    def kv(rows, n, value):
        return torch.full((rows, 1, n, 2), float(value))

    cache = DraftContextCache(1, capacity=6)
    k, v = cache.extend(0, kv(2, 3, 1), kv(2, 3, -1), kv(2, 2, 9), kv(2, 2, -9))
    assert k[:, 0, :, 0].tolist() == [[1, 1, 1, 9, 9]] * 2 and v[0, 0, :, 0].tolist() == [-1, -1, -1, -9, -9]
    buffer = cache.buffers[0][0].data_ptr()
    k, _ = cache.extend(0, kv(2, 1, 2), kv(2, 1, -2), kv(2, 2, 8), kv(2, 2, -8))  # the old block is written over
    assert k[0, 0, :, 0].tolist() == [1, 1, 1, 2, 8, 8] and len(cache) == 4 and cache.buffers[0][0].data_ptr() == buffer
    k, _ = cache.extend(0, kv(2, 0, 0), kv(2, 0, 0), kv(4, 2, 7), kv(4, 2, -7))  # 2 context rows serve 4 block rows
    assert k.shape == (4, 1, 6, 2) and k[3, 0, :, 0].tolist() == [1, 1, 1, 2, 7, 7]
    k, _ = cache.extend(0, kv(2, 5, 3), kv(2, 5, -3), kv(2, 2, 6), kv(2, 2, -6))  # past the buffer: it grows
    assert k[0, 0, :, 0].tolist() == [1, 1, 1, 2] + [3] * 5 + [6, 6] and len(cache) == 9
    cache.select_rows(torch.tensor([1]))
    k, _ = cache.extend(0, kv(1, 1, 4), kv(1, 1, -4), kv(1, 1, 5), kv(1, 1, -5))
    assert k[0, 0, :, 0].tolist() == [1, 1, 1, 2] + [3] * 5 + [4, 5]


def test_bench_batched_measures_both_plans_before_timing(monkeypatch):
    """A plan is measured once per batch size (and compiled, with compile=True): the one-prompt-at-a-time runs must
    not carry theirs in their timed seconds."""
    from hf_dscale import evaluation
    from hf_dscale.engine import plan as plan_module

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    events = []
    real_calibrate, real_timed = plan_module.calibrate, evaluation._timed
    monkeypatch.setattr(plan_module, "calibrate",
                        lambda *a, **k: events.append(("plan", k["batch_size"])) or real_calibrate(*a, **k))
    monkeypatch.setattr(evaluation, "_timed", lambda fn: events.append("timed") or real_timed(fn))
    prompts = [(str(i), _prompt(1, 6 + i, i)[0]) for i in range(2)]
    report = evaluation.bench_batched(target, drafter, prompts, batch_size=2, max_new_tokens=6)
    assert report["identical"] and sorted(e for e in events if e != "timed") == [("plan", 1), ("plan", 2)]
    assert events.index("timed") > max(events.index(("plan", 1)), events.index(("plan", 2)))


class _HostReads(TorchFunctionMode):
    """Counts the calls that make the host wait for the device: reading values back, and indexing by a bool mask
    (its result's size depends on the values)."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name in ("__getitem__", "__setitem__", "index_put_") and len(args) > 1 and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in (args[1] if isinstance(args[1], (tuple, list)) else (args[1],)))
        self.count += name in self.READS or masked
        return func(*args, **(kwargs or {}))


class _Never(StoppingCriteria):
    """A criterion of the user's own: the engine cannot answer it on the host."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("own_criterion", [False, True])
@pytest.mark.parametrize("method", ["tree", "tree cut", "tree processed", "chain", "sampled chain", "d2sd"])
@pytest.mark.parametrize("one_read", [True, False])
def test_a_cycle_reads_the_device_once(monkeypatch, batch, own_criterion, method, one_read):
    """With `one_read` (a GPU's default) a cycle waits for the device once: every row's accepted path (the walk runs
    on the device: a sampled chain's rejection rule too, and a tree's walk under logits processors) comes back with
    the next draft, for every row and path (the chain's cut and D²SD's boundaries read it); D²SD's VP pass is read
    once more, for every row and branch. Without it (a CPU's default) the draft follows the read and is read apart:
    one more. Length and EOS stops are answered on the host, a criterion of the user's own is read once per row. No
    other stage waits for the device (a GPU would stall on each read)."""
    from hf_dscale.engine import loop

    target = tiny_target("llama", eos=5)
    drafter = tiny_drafter(target, block_size=8)
    drafter.set_draft_vocab(list(range(3, 40)))  # its set grows with every committed token: on the host
    ids, mask = _prompt(batch, 12, 3)
    reads, cycle = _HostReads(), loop.Engine.cycle

    def counted(engine):
        with reads:
            cycle(engine)

    monkeypatch.setattr(loop.Engine, "cycle", counted)
    stats = DecodeStats()
    own = {"stopping_criteria": StoppingCriteriaList([_Never()])} if own_criterion else {}
    how = {"tree": {"do_sample": False}, "tree cut": {"do_sample": False, "draft_tree": True, "draft_confidence": 0.3},
           "tree processed": {"do_sample": True, "draft_tree": True, "repetition_penalty": 1.2, "top_k": 20},
           "chain": {"do_sample": False, "draft_tree": False},
           "sampled chain": {"do_sample": True, "temperature": 0.7, "top_k": 20},
           "d2sd": {"do_sample": False, "vp_drafter": tiny_drafter(target, block_size=8, seed=7)}}[method]
    torch.manual_seed(0)
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, custom_generate=custom_generate,
                    drafter=drafter, dscale_stats=stats, one_read=one_read, **how, **own)
    assert stats.plan.tree == (method in ("tree", "tree cut", "tree processed", "d2sd"))
    assert stats.plan.prompt_lookup == (method == "tree")
    assert stats.cycles > 3
    reads_per_cycle = (2 if method == "d2sd" else 1) + (not one_read)
    assert stats.plan.one_read == one_read
    assert reads.count <= (reads_per_cycle + (batch if own_criterion else 0)) * stats.cycles


def test_a_right_padded_batch_is_refused_by_name():
    """The engine appends each row's tokens after its last column, so a row padded on the right would continue
    from its padding: refused before any forward, naming the rows and the fix."""
    target = tiny_target()
    ids = torch.randint(3, 90, (3, 8))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # right padding
    forwards = []
    target.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match=r"Rows \[1\].*right-padded.*padding_side = 'left'"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=custom_generate,
                        drafter=tiny_drafter(target))
    assert not forwards
