"""BlockBatch's plan: branches chosen by expected seconds from step costs (a fake cost table or a fake clock), the
plan in JSON, explicit sizes over a plan, refreshes of distinct rows, and `bench-dllm --method both`."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dscale.dllm.decode import (
    _write_distinct,
    blockbatch_generate,
    fast_dllm_generate,
)
from hf_dscale.dllm.plan import (
    BlockBatchPlan,
    CandidateCost,
    _choose,
    measure_step_costs,
    plan_blockbatch,
)
from hf_dscale.generation import dllm_generate
from hf_dscale.models.dllm import DiffusionModel
from hf_dscale.models.dllm.modeling_dllm import DualCache

from .test_dllm import EOS, MASK, VOCAB, _logits_for, tiny_dlm

G = 16
PROMPT = torch.tensor([[3, 4]])
ANSWER = [3, 4] + [5 + i for i in range(G)]  # no EOS: a run ends when the region is full


class _Climbing:
    """A DiffusionModel stand-in whose confidence (0.6 to 0.62, under the threshold, over the merge gate) climbs
    with the position: each branch commits the rightmost mask of its window, so small blocks fill from the left
    while a large one fills from the right, and merge and sync let branches share. Alone, any block size takes
    one forward per token (NFE 16); {4, 16} takes 11, {2, 4, 8, 16} 8."""

    mask_token_id, eos_token_id, shift, dual_cache = MASK, EOS, 0, False

    def new_cache(self):
        return None

    def __init__(self):
        self.logits = _logits_for([0.6 + 0.001 * p for p in range(len(ANSWER))], ANSWER).float()  # [L, V]

    def full(self, x, cache=None):
        return self.logits[: x.shape[1]][None].expand(x.shape[0], -1, -1)

    def block(self, x, targets, write, cache=None):
        return self.full(x).gather(1, targets[..., None].expand(-1, -1, VOCAB))


def _plan(step_seconds, min_branches=1, **kw):
    return plan_blockbatch(_Climbing(), [PROMPT], G, (2, 4, 8, 16), min_branches=min_branches,
                           step_seconds=step_seconds, **kw)


def test_climbing_model_shares_across_branches():
    """The premise of the plan tests below: more branches, fewer forwards, every set the same answer."""
    alone = blockbatch_generate(_Climbing(), PROMPT, G, (16,))
    pair = blockbatch_generate(_Climbing(), PROMPT, G, (4, 16))
    assert alone.nfe == 16 and pair.nfe == 11 and alone.sequence.tolist() == pair.sequence.tolist() == ANSWER
    assert pair.forwards[0] == ("full", (18,)) and set(pair.forwards[1:]) == {("full", (18, 18))}  # no dual cache


def test_plan_keeps_branches_when_a_batched_row_is_free_and_drops_them_when_it_costs_a_row():
    free = _plan(lambda kind, queries: 1.0)  # GPU-like: a forward costs the same at any batch
    assert len(free.block_sizes) >= 3
    chosen = next(c for c in free.candidates if c.block_sizes == free.block_sizes)
    assert chosen.expected_seconds == chosen.nfe < 16 and chosen.agreement == 1.0

    per_row = _plan(lambda kind, queries: float(len(queries)))  # compute-bound: r rows cost r forwards
    assert len(per_row.block_sizes) == 1  # {4, 16}: 1 + 10 x 2 = 21 s > 16 s alone
    pair = next(c for c in per_row.candidates if len(c.block_sizes) == 2)
    assert pair.expected_seconds > 16.0 and "stop" in per_row.reason

    forced = _plan(lambda kind, queries: float(len(queries)), min_branches=2)
    assert len(forced.block_sizes) == 2 and "needed for 2 branches" in forced.reason


def test_plan_falls_back_to_the_reference_when_no_cheaper_set_agrees():
    class Disagreeing(_Climbing):  # a lone branch writes another answer
        def full(self, x, cache=None):
            logits = super().full(x)
            alone = x.shape[0] == 1 and int((x[0] != MASK).sum()) > PROMPT.shape[1]  # a one-branch step
            return logits.roll(1, -1) if alone else logits

    plan = plan_blockbatch(Disagreeing(), [PROMPT], G, (4, 16), min_branches=1,
                           step_seconds=lambda kind, queries: float(len(queries)) ** 3)
    assert plan.block_sizes == (4, 16) and "the reference set" in plan.reason
    # answers worded otherwise that check the same (here: every answer counts as the same) do agree
    lenient = plan_blockbatch(Disagreeing(), [PROMPT], G, (4, 16), min_branches=1,
                              step_seconds=lambda kind, queries: float(len(queries)) ** 3, agree=lambda a, b: True)
    assert len(lenient.block_sizes) == 1 and all(c.agreement == 1.0 for c in lenient.candidates)


def test_with_known_answers_a_set_must_answer_as_many_right_as_fast_dllm():
    """A lone wide branch answers wrongly (far-ahead commits a model is wrongly sure of): a `check` keeps it out,
    whatever it saves, and the plan reports Fast-dLLM on the same prompts as its baseline."""

    class WrongWhenWide(_Climbing):  # a 16-token block commits a wrong first token; narrower ones do not
        def block(self, x, targets, write, cache=None):
            logits = super().block(x, targets, write)
            wide = targets.shape[1] == 16 and bool((x[:, PROMPT.shape[1]] == MASK).any())
            return logits.roll(1, -1) if wide else logits

        def full(self, x, cache=None):
            return super().full(x).roll(1, -1) if x.shape[0] == 1 and bool((x[0] == MASK).all()) else super().full(x)

    def right(i, sequence):
        return sequence.tolist() == ANSWER

    cheap_wide = dict(step_seconds=lambda kind, queries: sum(1.0 if q == 16 else 3.0 for q in queries))
    plan = plan_blockbatch(WrongWhenWide(), [PROMPT], G, (4, 8, 16), min_branches=1, check=right,
                           baseline_block_size=8, **cheap_wide)
    assert plan.baseline is not None and plan.baseline.correct == 1.0
    chosen = next(c for c in plan.candidates if c.block_sizes == plan.block_sizes)
    assert chosen.correct == 1.0 and 16 not in plan.block_sizes
    assert any(c.correct == 0.0 for c in plan.candidates)  # the wide set was tried and answered wrongly
    report = json.loads(json.dumps(plan.to_dict()))
    assert BlockBatchPlan.from_dict(report).to_dict() == report and report["baseline"]["correct"] == 1.0
    # the plan says how the chosen set compares with Fast-dLLM on the same prompts
    assert plan.expected_vs_fast_dllm == pytest.approx(chosen.expected_seconds / plan.baseline.expected_seconds)
    assert report["expected_vs_fast_dllm"] == pytest.approx(plan.expected_vs_fast_dllm, abs=1e-4)
    assert f"Fast-dLLM (block 8) {plan.baseline.expected_seconds * 1e3:.2f} ms" in plan.reason
    with pytest.raises(ValueError, match="baseline_block_size"):
        plan_blockbatch(WrongWhenWide(), [PROMPT], G, (4, 8), check=right, baseline_block_size=5, **cheap_wide)


def test_the_plan_says_whether_its_branches_are_expected_to_beat_fast_dllm():
    """Against Fast-dLLM on the same prompts: where a batched forward costs what one window does (a GPU's launches),
    fewer forwards are less time and the branches pay; where every query costs its share (compute-bound), the same
    branches cost more than the forwards they save, and the plan says so."""
    right = lambda i, seq: True  # noqa: E731
    free = plan_blockbatch(_Climbing(), [PROMPT], G, (4, 8, 16), check=right, baseline_block_size=8,
                           step_seconds=lambda kind, queries: 1.0)
    assert free.baseline.nfe == 16 and free.expected_vs_fast_dllm < 1 and "not expected to pay" not in free.reason
    per_query = plan_blockbatch(_Climbing(), [PROMPT], G, (4, 8, 16), check=right, baseline_block_size=8,
                                step_seconds=lambda kind, queries: float(sum(queries)))
    assert per_query.expected_vs_fast_dllm > 1 and "not expected to pay" in per_query.reason


class _Clocked:
    """A DiffusionModel that advances a fake clock by 1 ms per query token it runs, padding not counted (a spike of
    1 s on every 7th call: the median of interleaved repeats must not see it)."""

    def __init__(self, inner: DiffusionModel):
        self.inner, self.now, self.calls = inner, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _tick(self, tokens: int) -> None:
        self.calls += 1
        self.now += 1e-3 * tokens + (1.0 if self.calls % 7 == 0 else 0.0)

    def full(self, x, cache=None):
        self._tick(x.numel())
        return self.inner.full(x, cache)

    def block(self, x, targets, write, cache=None):
        self._tick(int(write.sum()))
        return self.inner.block(x, targets, write, cache)


def test_step_costs_measured_with_a_fake_clock():
    model = _Clocked(DiffusionModel(tiny_dlm()))
    shapes = [("full", (20,)), ("full", (20,) * 3), ("block", (4, 4)), ("block", (8, 8, 8)), ("block", (8, 4))]
    costs = measure_step_costs(model, torch.randint(3, VOCAB, (1, 4)), G, shapes, repeats=5, clock=lambda: model.now)
    assert costs == pytest.approx({("full", (20,)): 0.020, ("full", (20,) * 3): 0.060, ("block", (4, 4)): 0.008,
                                   ("block", (8, 8, 8)): 0.024, ("block", (8, 4)): 0.012})  # windows 8 and 4, packed


def test_plan_prices_the_forwards_each_run_made():
    """Priced by a fake clock that only model calls advance (no spikes here), a run's expected seconds and its
    measured wall-clock are the same number: the recorded shapes are the calls made, priced at their measured cost."""
    model = _Clocked(DiffusionModel(tiny_dlm(seed=2)))
    model._tick = lambda tokens: setattr(model, "now", model.now + 1e-3 * tokens)
    prompts = [torch.randint(3, VOCAB, (1, 4)) for _ in range(2)]
    plan = plan_blockbatch(model, prompts, G, (4, 8, 16), min_branches=2, clock=lambda: model.now, repeats=3)
    assert len(plan.candidates) >= 1 + 3 + 2
    for c in plan.candidates:
        assert c.expected_seconds == pytest.approx(c.measured_seconds)
    assert plan.seconds("full", (20,) * 3) == pytest.approx(3 * plan.seconds("full", (20,)))
    assert plan.batched_vs_single["full"] == {"2": 2.0, "3": 3.0}
    assert plan.batched_vs_single["block"]["16+8"] == 1.5  # 24 queries packed, against one row of 16
    assert plan.seconds("block", (8, 16)) == plan.seconds("block", (16, 8))


def test_plan_prices_the_host_time_between_model_calls(monkeypatch):
    """With measured step costs the plan adds each run's host time, measured in the run: here the decoders' record of
    every forward (`_book`, one per forward, between the model calls) advances the fake clock by 50 ms, so a set's
    host time is 50 ms per forward and its expected seconds are its wall-clock; with a cost table, or
    price_host=False, nothing is added."""
    from hf_dscale.dllm import decode as dllm

    model = _Clocked(DiffusionModel(tiny_dlm(seed=2)))
    model._tick = lambda tokens: setattr(model, "now", model.now + 1e-3 * tokens)
    book = dllm._book

    def slow_book(*args, **kwargs):
        model.now += 0.05
        return book(*args, **kwargs)

    monkeypatch.setattr(dllm, "_book", slow_book)
    prompts = [torch.randint(3, VOCAB, (1, 4)) for _ in range(2)]
    right = lambda i, seq: True  # noqa: E731
    plan = plan_blockbatch(model, prompts, G, (4, 8, 16), min_branches=2, clock=lambda: model.now, repeats=3,
                           check=right, baseline_block_size=8)
    for c in (*plan.candidates, plan.baseline):
        assert c.host_seconds == pytest.approx(0.05 * c.nfe)
        assert c.expected_seconds == pytest.approx(c.measured_seconds)
    unpriced = plan_blockbatch(model, prompts, G, (4, 8, 16), min_branches=2, clock=lambda: model.now, repeats=3,
                               price_host=False)
    assert all(c.host_seconds == 0.0 and c.expected_seconds < c.measured_seconds for c in unpriced.candidates)


def test_plan_round_trips_through_json():
    plan = _plan(lambda kind, queries: 0.5 * len(queries))
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["block_sizes"] == list(plan.block_sizes) and d["reason"] == plan.reason
    assert {"kind": "full", "rows": 3, "queries": [G + 2] * 3, "seconds": 1.5} in d["step_costs"]
    assert d["batched_vs_single"]["full"]["4"] == 4.0 and d["batched_vs_single"]["block"]["8+4"] == 2.0
    again = BlockBatchPlan.from_dict(d)  # equal up to the microsecond rounding of measured wall-clock
    assert again.to_dict() == d and again.block_sizes == plan.block_sizes and again.step_costs == plan.step_costs


def test_explicit_block_sizes_override_a_plan():
    dlm = DiffusionModel(tiny_dlm(seed=1))
    prompt = torch.randint(3, VOCAB, (1, 5))
    plan = BlockBatchPlan(block_sizes=(4, 8), gen_length=G, seq_len=21, step_costs=(), candidates=(), reason="test")
    planned = blockbatch_generate(dlm, prompt, G, plan=plan)
    assert planned.branch_rows.shape[0] == 2
    same = blockbatch_generate(dlm, prompt, G, (4, 8))
    assert torch.equal(planned.sequence, same.sequence) and planned.nfe == same.nfe
    assert planned.forwards == same.forwards
    out = dlm.model.generate(prompt, max_new_tokens=G, do_sample=False, custom_generate=dllm_generate,
                             dllm_method="blockbatch", blockbatch_plan=plan)
    assert torch.equal(out[0, : same.sequence.numel()], same.sequence)
    explicit = blockbatch_generate(dlm, prompt, G, (16,), plan=plan)
    assert explicit.branch_rows.shape[0] == 1 and explicit.block_size == 16
    with pytest.raises(ValueError, match="plan was made for gen_length 16"):
        blockbatch_generate(dlm, prompt, 32, plan=plan)
    with pytest.raises(ValueError, match="calibration prompts"):
        plan_blockbatch(dlm, [], G, (4, 8))
    with pytest.raises(ValueError, match="min_branches"):
        plan_blockbatch(dlm, [prompt], G, (4, 8), min_branches=3)


def test_a_refresh_runs_each_distinct_row_once():
    """After the hard sync every branch holds the leader's row: the first refresh is one forward of one row (at
    threshold 0 the largest block fills at once and leads); the distinct rows' cache rows go to the rows sharing
    them."""
    dlm = DiffusionModel(tiny_dlm(seed=4))
    prompt = torch.randint(3, VOCAB, (1, 4))
    result = blockbatch_generate(dlm, prompt, G, (2, 4, 8), threshold=0.0, refresh_tokens=1, stop_early=False)
    refreshes = [f for f in result.forwards[1:] if f[0] == "full"]
    assert len(refreshes) == result.events["refreshes"] >= 1 and result.nfe_full == 1 + len(refreshes)
    assert result.forwards[1] == ("full", (4 + G,)) and all(len(queries) <= 3 for _, queries in refreshes)

    cache, fresh = DualCache(1), DualCache(1)
    cache.keys, cache.values = [torch.zeros(4, 1, 3, 2)], [torch.zeros(4, 1, 3, 2)]
    fresh.keys, fresh.values = [torch.arange(12.0).view(2, 1, 3, 2)], [-torch.arange(12.0).view(2, 1, 3, 2)]
    _write_distinct(cache, torch.tensor([0, 2, 3]), fresh, torch.tensor([1, 0, 1]))
    assert torch.equal(cache.keys[0][[0, 1, 2, 3]], torch.stack([fresh.keys[0][1], torch.zeros(1, 3, 2),
                                                                  fresh.keys[0][0], fresh.keys[0][1]]))
    one = DualCache(1)
    one.keys, one.values = [fresh.keys[0][:1]], [fresh.values[0][:1]]
    _write_distinct(cache, torch.tensor([1, 3]), one, torch.tensor([0, 0]))  # one distinct row: broadcast
    assert torch.equal(cache.values[0][1], fresh.values[0][0]) and torch.equal(cache.values[0][3], fresh.values[0][0])


def test_a_leader_refresh_runs_one_row_that_every_branch_takes():
    """refresh_rows="leader": each refresh is a full forward of one row, the leader's, and every live branch holds
    that row afterwards; with every branch's row refreshed (the paper's) some refreshes here run several."""
    dlm = DiffusionModel(tiny_dlm(seed=4))
    kw = dict(threshold=0.5, refresh_tokens=2, stop_early=False)
    for seed in range(20):  # a prompt where the branches' rows differ at some refresh
        prompt = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(seed))
        every = blockbatch_generate(dlm, prompt, G, (2, 4, 8), **kw)
        if any(kind == "full" and len(queries) > 1 for kind, queries in every.forwards):
            break
    else:
        raise AssertionError("no prompt where a refresh runs several distinct rows")
    taken = []
    full = dlm.full

    def spy(x, cache=None):
        taken.append(x.shape[0])
        return full(x, cache)

    dlm.full = spy
    leader = blockbatch_generate(dlm, prompt, G, (2, 4, 8), refresh_rows="leader", **kw)
    refreshes = [queries for kind, queries in leader.forwards[1:] if kind == "full"]
    assert refreshes and all(len(queries) == 1 for queries in refreshes) and set(taken) == {1}
    assert leader.events["refreshes"] == len(refreshes)
    assert MASK not in leader.branch_rows[:, prompt.shape[1]:].tolist()[0]  # decoding went on to the end
    with pytest.raises(ValueError, match="refresh_rows"):
        blockbatch_generate(dlm, prompt, G, (2, 4, 8), refresh_rows="some")


def test_a_plan_carries_its_refresh_rows_into_decoding_and_json():
    """The plan tries every pair with each refresh's rows; where a full forward costs each row it runs (a CPU), the
    leader's row alone is the cheaper refresh and the plan takes it. A plan's refresh_rows is what
    `blockbatch_generate(plan=)` and `generate(blockbatch_plan=)` run, and survives the plan's JSON."""
    import dataclasses

    dlm = DiffusionModel(tiny_dlm(seed=3))
    prompt = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(0))
    per_row = lambda kind, queries: 20.0 * len(queries) if kind == "full" else 1.0  # noqa: E731
    plan = plan_blockbatch(dlm, [prompt], G, (2, 4, 8), min_branches=2, refresh_candidates=(2,),
                           step_seconds=per_row, agree=lambda a, b: True)
    assert {c.refresh_rows for c in plan.candidates if len(c.block_sizes) == 2} == {"all", "leader"}
    assert plan.refresh_rows == "leader"
    every = dataclasses.replace(plan, refresh_rows="all")
    by_hand = blockbatch_generate(dlm, prompt, G, plan.block_sizes, refresh_tokens=2, refresh_rows="leader")
    assert blockbatch_generate(dlm, prompt, G, plan=plan).forwards == by_hand.forwards
    assert by_hand.forwards != blockbatch_generate(dlm, prompt, G, plan=every).forwards  # the refreshes differ
    stats = []
    dlm.model.generate(prompt, max_new_tokens=G, do_sample=False, custom_generate=dllm_generate,
                       dllm_method="blockbatch", dllm_stats=stats, blockbatch_plan=plan)
    assert stats[0].forwards == by_hand.forwards
    assert BlockBatchPlan.from_dict(json.loads(json.dumps(plan.to_dict()))).refresh_rows == "leader"
    assert BlockBatchPlan.from_dict(json.loads(json.dumps(every.to_dict()))).refresh_rows == "all"


@pytest.mark.parametrize("host", ["auto", "torch"])
def test_bench_both_reports_the_two_methods_side_by_side(host):
    from hf_dscale.dllm.host import host_kernel
    from hf_dscale.evaluation import bench_dllm
    from hf_dscale.models.dllm import DiffusionLM, DiffusionLMConfig
    from hf_dscale.training.dllm_tasks import build_tokenizer, make_problems

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = DiffusionLMConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, mask_token_id=tokenizer.mask_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    dlm = DiffusionModel(DiffusionLM(config).eval())
    problems = make_problems("arithmetic", 2, seed=3, heldout=True)
    report = bench_dllm(dlm, tokenizer, problems, "both", G, 8, [4, 8], 0.9, host=host)
    assert report["host"] == ("torch" if host_kernel(host, "cpu") is None else "c")  # who did the bookkeeping
    ff, bb = report["fast-dllm"], report["blockbatch"]
    assert report["n_prompts"] == 2 and ff["nfe"] >= 1 and bb["nfe"] >= 1
    ratios = report["blockbatch_vs_fast_dllm"]
    assert ratios["nfe"] == pytest.approx(bb["nfe"] / ff["nfe"], abs=1e-3)
    assert ratios["seconds_per_answer"] == pytest.approx(bb["seconds_per_answer"] / ff["seconds_per_answer"], rel=0.01)
    assert ratios["accuracy_points"] == pytest.approx(100 * (bb["accuracy"] - ff["accuracy"]))
    for m in (ff, bb):  # an answer's time: its full forwards, its block forwards and the host time between them
        model_s = (m["nfe_full"] * m["ms_per_full_forward"] + m["nfe_block"] * m["ms_per_block_forward"]) / 1000
        assert 0 < m["host_seconds_per_answer"] < m["seconds_per_answer"]
        assert model_s + m["host_seconds_per_answer"] == pytest.approx(m["seconds_per_answer"], abs=3e-5)  # rounding
    assert ratios["block_step"] == pytest.approx(bb["ms_per_block_forward"] / ff["ms_per_block_forward"], rel=1e-3)
    # at block_step_to_tie, BlockBatch's time per answer is Fast-dLLM's
    step = ratios["block_step_to_tie"] * ff["ms_per_block_forward"] / 1000
    tied = bb["nfe_full"] * bb["ms_per_full_forward"] / 1000 + bb["nfe_block"] * step + bb["host_seconds_per_answer"]
    assert tied == pytest.approx(ff["seconds_per_answer"], abs=3e-5)


def test_candidate_costs_serialise():
    c = CandidateCost((4, 8), 2.5, 0.01, 0.012, 1.0)
    assert c.to_dict() == {"block_sizes": [4, 8], "refresh_tokens": 32, "refresh_rows": "all", "sync_threshold": 8,
                           "nfe": 2.5,
                           "expected_seconds": 0.01, "host_seconds": 0.0, "measured_seconds": 0.012,
                           "agreement": 1.0, "correct": None, "validated": None}


def test_plan_chooses_the_refresh_interval_and_decoding_uses_it():
    """Where a full forward is dear, the plan keeps the longer refresh interval (fewer refreshes, same answers), and
    `blockbatch_generate(plan=...)` refreshes at that interval."""
    dlm = DiffusionModel(tiny_dlm(seed=3))
    prompt = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(0))
    dear_full = plan_blockbatch(dlm, [prompt], G, (2, 4, 8), min_branches=2, refresh_candidates=(2, 8),
                                step_seconds=lambda kind, queries: 20.0 * len(queries) if kind == "full" else 1.0,
                                agree=lambda a, b: True)
    assert dear_full.refresh_tokens == 8 and f"{{{','.join(map(str, dear_full.block_sizes))}}}/r8" in dear_full.reason
    runs = {c.refresh_tokens: c for c in dear_full.candidates
            if c.block_sizes == dear_full.block_sizes and c.refresh_rows == "all"}
    assert set(runs) == {2, 8} and runs[8].expected_seconds < runs[2].expected_seconds  # every pair at both
    planned = blockbatch_generate(dlm, prompt, G, plan=dear_full)
    rows = dear_full.refresh_rows
    assert planned.forwards == blockbatch_generate(dlm, prompt, G, dear_full.block_sizes, refresh_tokens=8,
                                                   refresh_rows=rows).forwards
    for options in (dict(blockbatch_plan=dear_full),
                    dict(block_sizes=dear_full.block_sizes, refresh_tokens=8, refresh_rows=rows)):
        stats = []  # through generate(): the plan's interval, or the one given
        dlm.model.generate(prompt, max_new_tokens=G, do_sample=False, custom_generate=dllm_generate,
                           dllm_method="blockbatch", dllm_stats=stats, **options)
        assert stats[0].forwards == planned.forwards
    assert BlockBatchPlan.from_dict(json.loads(json.dumps(dear_full.to_dict()))).refresh_tokens == 8


def test_a_tie_in_seconds_goes_to_the_fewer_forwards():
    """Pairs priced within `tie` of the cheapest are a tie, decided by NFE; with tie=0 the cheapest wins."""
    priced = {(2, 4): (1.00, 10.0), (2, 8): (1.01, 6.0), (4, 8): (1.30, 6.0)}

    def evaluate(combo, refresh=32, rows="all"):
        seconds, nfe = priced.get(combo, (2.0, 12.0) if len(combo) > 1 else (1.5, 16.0))
        return CandidateCost(combo, nfe, seconds, seconds, 1.0, None, refresh, refresh_rows=rows)

    def choose(tie):
        return _choose(evaluate, (2, 4, 8), (32,), 2, 0.05, tie, lambda c: True, lambda c: "")[0].block_sizes

    assert choose(0.02) == (2, 8)
    assert choose(0.0) == (2, 4)


def test_a_branch_that_saves_forwards_at_a_tied_cost_is_added():
    """The greedy search adds a branch that saves `min_gain` of the seconds, or as much of the forwards at a cost
    within `tie`: more time than that, or fewer forwards saved, and it stops."""
    def choose(triple_seconds, triple_nfe):
        priced = {(2, 4): (1.00, 10.0), (2, 4, 8): (triple_seconds, triple_nfe)}

        def evaluate(combo, refresh=32, rows="all"):
            seconds, nfe = priced.get(combo, (2.0, 12.0) if len(combo) > 1 else (1.5, 16.0))
            return CandidateCost(combo, nfe, seconds, seconds, 1.0, None, refresh, refresh_rows=rows)

        chosen, steps = _choose(evaluate, (2, 4, 8), (32,), 2, 0.05, 0.02, lambda c: True, lambda c: "")
        return chosen.block_sizes, steps[-1]

    sizes, step = choose(1.015, 8.0)  # 20% fewer forwards at 1.5% more time
    assert sizes == (2, 4, 8) and "20.0% fewer forwards at 1.5% more time" in step
    assert choose(1.03, 8.0)[0] == (2, 4)  # 3% more time: beyond the tie
    assert choose(1.01, 9.8)[0] == (2, 4)  # 2% fewer forwards: not enough


def test_the_plan_tries_the_sync_thresholds_and_decoding_uses_its_choice():
    """After the search the chosen set runs at each other sync threshold; the cheaper (within the tie: the fewer
    forwards) is kept, and the plan's threshold is what decoding with the plan runs and what its JSON keeps."""
    def evaluate(combo, refresh=32, rows="all", synced=8):
        seconds, nfe = (1.0, 10.0) if len(combo) == 2 else (2.0, 12.0) if len(combo) > 2 else (1.5, 16.0)
        if synced == 4 and len(combo) == 2:
            nfe -= 1.0  # the same time, fewer forwards
        return CandidateCost(combo, nfe, seconds, seconds, 1.0, None, refresh, refresh_rows=rows,
                             sync_threshold=synced)

    chosen, steps = _choose(evaluate, (2, 4, 8), (32,), 2, 0.05, 0.02, lambda c: True, lambda c: "", (8, 4))
    assert chosen.sync_threshold == 4 and "a sync threshold of 4 tokens" in steps[-1]
    assert _choose(evaluate, (2, 4, 8), (32,), 2, 0.05, 0.02, lambda c: True, lambda c: "")[0].sync_threshold == 8

    dlm = DiffusionModel(tiny_dlm(seed=3))
    prompt = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(0))
    plan = plan_blockbatch(dlm, [prompt], G, (2, 4, 8), min_branches=2, refresh_candidates=(4,),
                           sync_candidates=(8, 0), step_seconds=lambda kind, queries: 1.0, agree=lambda a, b: True)
    tried = {c.sync_threshold for c in plan.candidates if c.block_sizes == plan.block_sizes}
    assert tried == {8, 0} and plan.chosen is not None and plan.chosen.sync_threshold == plan.sync_threshold
    by_hand = blockbatch_generate(dlm, prompt, G, plan.block_sizes, refresh_tokens=plan.refresh_tokens,
                                  refresh_rows=plan.refresh_rows, sync_threshold=plan.sync_threshold)
    assert blockbatch_generate(dlm, prompt, G, plan=plan).forwards == by_hand.forwards
    again = BlockBatchPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.sync_threshold == plan.sync_threshold and again.chosen.key == plan.chosen.key


def test_a_bad_sync_threshold_is_refused():
    prompt = torch.randint(3, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="sync_threshold"):
        blockbatch_generate(DiffusionModel(tiny_dlm()), prompt, G, (2, 4), sync_threshold=-1)


def test_the_chosen_set_must_also_answer_the_validation_prompts_as_well_as_fast_dllm():
    """With validation prompts the chosen set is decoded on them too: kept where it answers as many right as
    Fast-dLLM; otherwise the next sets by expected seconds are tried, up to max_validations, and where none does as
    well, the one that answered the most right is taken."""
    dlm = DiffusionModel(tiny_dlm(seed=4))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (1, 4), generator=gen) for _ in range(2)]
    validation = [torch.randint(3, VOCAB, (1, 4), generator=gen) for _ in range(3)]
    fast = [fast_dllm_generate(dlm, q, G, 8, 0.9).sequence for q in validation]
    per_row = lambda kind, queries: float(len(queries))  # noqa: E731

    def plan_with(check, max_validations=3):
        return plan_blockbatch(dlm, prompts, G, (2, 4, 8), min_branches=2, refresh_candidates=(8,),
                               step_seconds=per_row,
                               check=check, baseline_block_size=8, validation=validation,
                               max_validations=max_validations)

    with pytest.raises(ValueError, match="check="):  # validation is by the answers
        plan_blockbatch(dlm, prompts, G, (2, 4, 8), step_seconds=per_row, validation=validation)
    everything_right = plan_with(lambda i, seq: True)
    first = min((c for c in everything_right.candidates if len(c.block_sizes) >= 2 and c.validated is not None),
                key=lambda c: c.expected_seconds)
    assert everything_right.baseline.validated == 1.0 and everything_right.chosen.validated == 1.0
    assert [c for c in everything_right.candidates if c.validated is not None] == [everything_right.chosen]
    assert "kept" in everything_right.reason and first.key == everything_right.chosen.key

    # right on a validation prompt only where the answer is Fast-dLLM's own: the sets that answer otherwise fail
    like_fast = plan_with(lambda i, seq: i < len(prompts) or torch.equal(seq, fast[i - len(prompts)]))
    checked = [c for c in like_fast.candidates if c.validated is not None]
    assert 1 <= len(checked) <= 3 and like_fast.baseline.validated == 1.0
    assert "validated on 3 more prompts" in like_fast.reason
    passing = [c for c in checked if c.validated == 1.0]
    if passing:
        assert like_fast.chosen.key == passing[0].key and len(passing) == 1  # the search stops at the first
    else:
        assert len(checked) == 3 and like_fast.chosen.validated == max(c.validated for c in checked)
