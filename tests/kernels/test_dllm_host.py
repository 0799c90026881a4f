"""The dLLM decoders' bookkeeping in C (`hf_dscale.kernels.dllm_host`) against the torch functions it replaces on
the CPU: the threshold commit with BlockBatch's beliefs, the stopping rule's scan, the merge, whole decodes, and the
choice of who does the bookkeeping (`host_kernel`)."""

from __future__ import annotations

import pytest
import torch

from hf_dscale.dllm import decode as dllm
from hf_dscale.dllm import host as dllm_host_options
from hf_dscale.dllm.decode import (
    _Branches,
    _merge,
    blockbatch_generate,
    fast_dllm_generate,
)
from hf_dscale.dllm.host import (
    _beliefs,
    commit_windows,
    confidences,
    host_kernel,
    scan,
    windows_at,
)
from hf_dscale.kernels import dllm_host
from hf_dscale.models.dllm import DiffusionModel

from ..generation.test_dllm import EOS, MASK, VOCAB, tiny_dlm

WHY_NOT = dllm_host.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"the C bookkeeping cannot run here: {WHY_NOT}")


def _windows(g: torch.Generator, n: int, length: int, p: int):
    """Windows of random widths at random starts in rows 0..n-1 (some rows left out), padded to the widest."""
    rows = sorted(torch.randperm(n, generator=g)[: int(torch.randint(1, n + 1, (1,), generator=g))].tolist())
    sizes = [int(torch.randint(1, 9, (1,), generator=g)) for _ in rows]
    q = max(sizes)
    starts = [p + int(torch.randint(0, length - p - s + 1, (1,), generator=g)) for s in sizes]
    offsets = torch.arange(q)
    size = torch.tensor(sizes)[:, None]
    targets = torch.tensor(starts)[:, None] + torch.minimum(offsets, size - 1)
    return windows_at(rows, targets, offsets < size)


def _logits(g: torch.Generator, shape: tuple) -> torch.Tensor:
    """Random logits on a coarse grid (tokens tie for the top of a slot) with the mask token often on top."""
    logits = (torch.randn(*shape, VOCAB, generator=g) * 4).round() / 2
    logits[..., MASK] += 3 * (torch.rand(shape, generator=g) < 0.3)
    return logits


def test_slots_of_equal_confidence_go_to_the_first():
    """Two masked slots whose logits are the same values in another order have the same confidence in exact
    arithmetic; the library sums them so that they do, and the first slot is committed (torch's float sums may
    break such a tie either way by a rounding)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        first = (torch.randn(VOCAB, generator=g) * 4).round() / 2
        first[MASK] = -10.0
        top = int(first.argmax())
        second = first.clone()
        other = VOCAB - 1 if top != VOCAB - 1 else VOCAB - 2
        second[top], second[other] = first[other], first[top]  # the same confidence for another token
        x = torch.full((1, 4), MASK)
        w = windows_at([0], torch.tensor([[1, 2]]))
        assert dllm_host.commit(x, w.rows, w.targets, w.valid, torch.stack((first, second))[None], MASK, EOS,
                                2.0) == [1]
        assert x.tolist() == [[MASK, top, MASK, MASK]]


@pytest.mark.parametrize("seed", range(30))
def test_commit_equals_torch_with_beliefs(seed):
    g = torch.Generator().manual_seed(seed)
    n, length, p = 4, 24, 3
    x = torch.randint(3, VOCAB, (n, length), generator=g)
    x[torch.rand(n, length, generator=g) < 0.6] = MASK
    x[:, :p] = 5
    w = _windows(g, n, length, p)
    logits = _logits(g, tuple(w.targets.shape))
    threshold = [0.3, 0.9, 2.0][seed % 3]  # 2.0: only the most confident masked slot of each window
    beliefs = torch.rand(2, n, length, generator=g), torch.randint(0, VOCAB, (n, length), generator=g)

    want_x, want_prob, want_best = x.clone(), beliefs[0].clone(), beliefs[1].clone()
    conf, tokens, probs = confidences(logits, MASK)
    both, best = _beliefs(conf, tokens, probs, EOS, w.real)
    want_prob[:, w.at[0], w.at[1]], want_best[w.at] = both, best
    chosen = commit_windows(want_x, w, conf, tokens, MASK, threshold)

    got_x, got_prob, got_best = x.clone(), beliefs[0].clone(), beliefs[1].clone()
    counts = dllm_host.commit(got_x, w.rows, w.targets, w.valid, logits, MASK, EOS, threshold,
                              (got_prob[0], got_prob[1], got_best))
    assert torch.equal(got_x, want_x)
    assert counts == chosen.sum(-1).tolist()
    scanned = dllm_host.commit(x.clone(), w.rows, w.targets, w.valid, logits, MASK, EOS, threshold, prompt_len=p)
    assert scanned == scan(want_x[w.rows], p, MASK, EOS, counts=True)  # the same call scans the rows after
    assert torch.equal(got_best, want_best)
    torch.testing.assert_close(got_prob, want_prob, rtol=1e-6, atol=0)


@pytest.mark.parametrize("seed", range(20))
def test_scan_equals_torch(seed):
    g = torch.Generator().manual_seed(seed)
    n, length, p = 5, 16, 4
    x = torch.randint(3, 8, (n, length), generator=g)
    x[torch.rand(n, length, generator=g) < [0.0, 0.1, 0.3, 0.6, 0.9][seed % 5]] = MASK
    x[torch.rand(n, length, generator=g) < 0.1] = EOS
    rows = torch.tensor([4, 0, 2])
    for eos in (EOS, None):
        assert dllm_host.scan(x, rows, p, MASK, eos) == scan(x[rows], p, MASK, eos, counts=True)


@pytest.mark.parametrize("seed", range(40))
def test_merge_equals_torch(seed):
    g = torch.Generator().manual_seed(seed)
    n, length, p = int(torch.randint(2, 5, (1,), generator=g)), 18, 2
    truth = torch.randint(3, 8, (length,), generator=g)
    rows = truth.repeat(n, 1)
    rows[torch.rand(n, length, generator=g) < 0.5] = MASK
    rows[torch.rand(n, length, generator=g) < 0.08] = 9  # a token another branch may disagree with
    sizes = [2, 4, 8, 16][:n]
    states = []
    for kernel in (None, dllm_host):
        state = _Branches(DiffusionModel(tiny_dlm()), rows.clone(), p, sizes, floor=0.7 if seed % 4 == 3 else 0.1,
                          kernel=kernel)
        state.x[:, :p] = truth[:p]
        state.start = [p + int(torch.randint(0, length - p - s + 1, (1,), generator=torch.Generator().manual_seed(
            seed * 10 + i))) for i, s in enumerate(sizes)]
        state.best[:] = torch.where(torch.rand(n, length, generator=torch.Generator().manual_seed(seed)) < 0.8,
                                    truth, truth + 1)
        state.prob[:] = torch.rand(n, length, generator=torch.Generator().manual_seed(seed + 1))
        if seed % 2:
            state.done[seed % n] = True
        live = state.live()
        counts = dict(zip(live, state.decoded(live)))
        states.append((state, _merge(state, 0.5, counts)))
    (torch_state, torch_out), (c_state, c_out) = states
    assert c_out == torch_out
    assert torch.equal(c_state.x, torch_state.x)
    assert c_state.start == torch_state.start and c_state.done == torch_state.done


@pytest.mark.parametrize("seed", range(40))
def test_commit_then_merge_equals_torch(seed):
    """A BlockBatch step's commit and the merge after it, which the C library makes in one call: the same rows,
    windows, beliefs, tokens adopted and counts as torch's commit, `place` and merge. Windows of 4 and 8 often end
    at the same position, where the merge's order keeps the branches' order."""
    g = torch.Generator().manual_seed(seed)
    n, length, p = int(torch.randint(2, 5, (1,), generator=g)), 20, 2
    truth = torch.randint(3, 8, (length,), generator=g)
    rows = truth.repeat(n, 1)
    rows[:, p:][torch.rand(n, length - p, generator=g) < 0.6] = MASK
    rows[torch.rand(n, length, generator=g) < 0.02] = 9  # a token another branch may disagree with
    rows[:, :p] = truth[:p]
    sizes = [2, 4, 8, 16][:n]
    logits = None
    outcomes = []
    for kernel in (None, dllm_host):
        state = _Branches(DiffusionModel(tiny_dlm()), rows.clone(), p, sizes, floor=0.1, kernel=kernel)
        state.best[:] = truth
        state.prob[:] = torch.rand(n, length, generator=torch.Generator().manual_seed(seed + 1))
        state.snap(*range(n))
        live = state.live()
        w = state.windows(live)
        if logits is None:  # mostly agreeing with the truth, so that branches agree and adopt
            logits = _logits(g, tuple(w.targets.shape))
            favoured = torch.rand(w.targets.shape, generator=g) < 0.6
            logits.scatter_add_(-1, truth[w.targets][..., None], 6.0 * favoured[..., None].float())
        scanned, merged = dllm._branch_commit(state, live, w, logits, 0.9, True, 0.5)
        first, ends, decoded = zip(*scanned)
        out = None
        if all(e is None for e in ends):
            state.place(live, first)
            out = _merge(state, 0.5, dict(zip(live, decoded)), merged)
        outcomes.append((state, scanned, out))
    (torch_state, torch_scan, torch_out), (c_state, c_scan, c_out) = outcomes
    assert c_scan == torch_scan and c_out == torch_out
    assert torch.equal(c_state.x, torch_state.x) and torch.equal(c_state.best, torch_state.best)
    assert torch.allclose(c_state.prob, torch_state.prob)
    assert c_state.start == torch_state.start and c_state.done == torch_state.done


@pytest.mark.parametrize("shift", [0, 1])
def test_decodes_are_the_same_with_either_host(shift):
    dlm = DiffusionModel(tiny_dlm(shift, seed=5))
    for seed in range(4):
        prompt = torch.randint(3, VOCAB, (1, 3 + seed), generator=torch.Generator().manual_seed(seed))
        runs = {host: [fast_dllm_generate(dlm, prompt, 32, 8, threshold=0.3, host=host)]
                + [blockbatch_generate(dlm, prompt, 32, sizes, threshold=0.3, refresh_tokens=refresh,
                                       refresh_rows=rows, host=host)
                   for sizes, refresh, rows in (((2, 4, 8), 8, "all"), ((4, 16), 16, "leader"), ((8, 32), None, "all"))]
                for host in ("torch", "c")}
        for a, b in zip(runs["torch"], runs["c"]):
            assert torch.equal(a.sequence, b.sequence)
            assert (a.nfe, a.forwards, a.events, a.block_size) == (b.nfe, b.forwards, b.events, b.block_size)
            assert a.branch_rows is None or torch.equal(a.branch_rows, b.branch_rows)


def test_who_does_the_bookkeeping(monkeypatch):
    assert host_kernel("auto", "cpu") is dllm_host
    assert host_kernel("c", torch.device("cpu")) is dllm_host
    assert host_kernel("torch", "cpu") is None
    assert host_kernel("auto", "meta") is None  # not a CPU: torch operations
    with pytest.raises(ValueError, match="host must be one of"):
        host_kernel("fast", "cpu")
    with pytest.raises(ValueError, match="runs on the CPU"):
        host_kernel("c", "meta")
    monkeypatch.setattr(dllm_host, "_library", lambda: "no C compiler found (set $CC, or install gcc)")
    assert host_kernel("auto", "cpu") is None  # where it cannot be built, torch does the work
    with pytest.raises(ValueError, match="no C compiler found.*Pass host='torch'"):
        host_kernel("c", "cpu")
    result = fast_dllm_generate(DiffusionModel(tiny_dlm()), torch.tensor([[3, 4]]), 8, 4)
    assert result.nfe >= 2  # and decoding goes on without it
    assert dllm_host_options.HOSTS == ("auto", "c", "torch")


def test_generate_takes_the_choice():
    from hf_dscale.generation import dllm_generate

    model = tiny_dlm(seed=7)
    prompt = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(1))
    outs = [model.generate(prompt, max_new_tokens=16, do_sample=False, custom_generate=dllm_generate,
                           dllm_method="blockbatch", block_sizes=(4, 8), threshold=0.3, dllm_host=host)
            for host in ("c", "torch")]
    assert torch.equal(*outs)
    with pytest.raises(ValueError, match="host must be one of"):
        model.generate(prompt, max_new_tokens=16, do_sample=False, custom_generate=dllm_generate, dllm_host="gpu")

