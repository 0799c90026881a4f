"""The CPU kernel for a verify's matrix products (`hf_dscale.kernels.cpu_linear`): its sums against torch's, the
hooks that route a model's `nn.Linear` calls to it, the plan's per-width choice, and decoding through it."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_dscale.engine.plan import calibrate
from hf_dscale.generation import custom_generate
from hf_dscale.engine import target_forward
from hf_dscale.kernels import cpu_linear
from tests.conftest import tiny_drafter, tiny_target, unevenly_padded

WHY_NOT = cpu_linear.unavailable()
REAL_VERIFY_COSTS_WAYS = target_forward.verify_costs_ways  # the conftest replaces it in every test
needs_kernel = pytest.mark.skipif(WHY_NOT is not None, reason=f"the CPU kernel cannot run here: {WHY_NOT}")


@pytest.fixture(params=["AVX512", "AVX2"])
def isa(request, monkeypatch):
    """The kernel built for each vector extension this CPU runs (AVX2 code runs on AVX-512 CPUs too)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if WHY_NOT is not None or (request.param == "AVX512" and "AVX512" not in capability):
        pytest.skip(f"this CPU does not run the {request.param} kernel ({WHY_NOT or capability})")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: request.param)
    cpu_linear._library.cache_clear()
    yield request.param
    cpu_linear._library.cache_clear()


@pytest.mark.parametrize("n, k", [(576, 576), (192, 576), (576, 1536), (7, 21), (130, 33), (5, 16), (1, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_sums_as_torch_does(n, k, threads, isa, monkeypatch):
    assert cpu_linear.isa() == isa
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(n * 1000 + k)
    weight, bias = torch.randn(n, k), torch.randn(n)
    for rows in (1, 2, 3, 4, 5, 7, 8, 16, 17, 33):
        x = torch.randn(2, rows, k)
        for b in (None, bias):
            got, want = cpu_linear.linear(x, weight, b), F.linear(x, weight, b)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("threads", [1, 2])
def test_several_products_in_one_pass_sum_as_torch_does(threads, isa, monkeypatch):
    """A layer's q, k and v (or gate and up) in one call: the outputs side by side, each with its own bias."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(5)
    weights = [torch.randn(n, 72) for n in (64, 24, 24, 5)]
    biases = [torch.randn(64), None, torch.randn(24), None]
    for rows in (1, 3, 4, 9, 16):
        x = torch.randn(2, rows, 72)
        got = cpu_linear.linear_many(x, weights, biases)
        want = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
        assert got.shape == want.shape == (2, rows, 117)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * 72 ** 0.5)
    with pytest.raises(ValueError, match="1 to 8 contiguous"):
        cpu_linear.linear_many(torch.randn(2, 72), [torch.randn(4, 72)] * 9)
    with pytest.raises(ValueError, match="1 to 8 contiguous"):
        cpu_linear.linear_many(torch.randn(2, 72), [torch.randn(4, 72), torch.randn(4, 70)])


def test_a_product_adds_into_a_residual_stream(isa):
    x, weight, bias, stream = torch.randn(5, 40), torch.randn(24, 40), torch.randn(24), torch.randn(5, 24)
    want = stream + F.linear(x, weight, bias)
    assert cpu_linear._run(x, weight, bias, into=stream) is stream
    torch.testing.assert_close(stream, want, rtol=1e-5, atol=1e-5)


def test_rms_norm_silu_and_rope_compute_what_torch_does(isa):
    torch.manual_seed(9)
    x, weight = torch.randn(7, 96), torch.randn(96)
    torch.testing.assert_close(cpu_linear.rms_norm(x, weight, 1e-5), F.rms_norm(x, (96,), weight, 1e-5))
    gate_up = torch.randn(3, 4, 2 * 50) * 6
    torch.testing.assert_close(cpu_linear.silu_mul(gate_up), F.silu(gate_up[..., :50]) * gate_up[..., 50:])
    heads, d = 3, 16
    rows = torch.randn(5, heads * d + 8)  # 8 more columns the rotation must leave alone
    cos, sin = torch.randn(5, d), torch.randn(5, d)
    norm = torch.randn(d)
    for head_norm in (None, (norm, 1e-6)):
        got = rows.clone()
        cpu_linear.rope_(got[:, 4:], 2, d, cos, sin, head_norm)  # a strided view: heads 4..36 of each row
        part = rows[:, 4 : 4 + 2 * d].view(5, 2, d)
        if head_norm is not None:
            part = F.rms_norm(part, (d,), norm, 1e-6)
        rotated = part * cos[:, None] + torch.cat((-part[..., d // 2 :], part[..., : d // 2]), -1) * sin[:, None]
        torch.testing.assert_close(got[:, 4 : 4 + 2 * d], rotated.reshape(5, -1), rtol=1e-5, atol=1e-5)
        assert torch.equal(got[:, :4], rows[:, :4]) and torch.equal(got[:, 4 + 2 * d :], rows[:, 4 + 2 * d :])


@pytest.mark.parametrize("d", [16, 64, 128])  # 64 and 128 take the AVX-512 kernel's blocked path
@pytest.mark.parametrize("queries, length", [(1, 1), (1, 37), (5, 40), (16, 300)])
def test_attention_equals_sdpa_over_a_cache_with_a_mask(d, queries, length, isa):
    """Grouped heads (6 over 2), a batch of 2, keys and values as views of buffers with room to spare (as the
    engine's cache keeps them), queries as a view of a wider row, an additive mask with masked columns."""
    torch.manual_seed(d + queries + length)
    b, heads, kv_heads = 2, 6, 2
    q = torch.randn(b, queries, heads * d + 3)[..., : heads * d].view(b, queries, heads, d)
    keys = torch.randn(b, kv_heads, length + 9, d)[:, :, :length]
    values = torch.randn(b, kv_heads, length + 9, d)[:, :, :length]
    allowed = torch.rand(b, 1, queries, length) < 0.7
    allowed[..., -1] = True  # every query sees at least one key
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    got = cpu_linear.attention(q, keys, values, mask, d ** -0.5)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=d ** -0.5,
                                          enable_gqa=True).transpose(1, 2).reshape(b, queries, heads * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_reads_strided_rows(isa):
    weight = torch.randn(40, 64)
    x = torch.randn(6, 128)[:, ::2]  # rows with a stride of 2
    torch.testing.assert_close(cpu_linear.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-4)
    wide = torch.randn(6, 100)[:, :64]  # rows whose elements are contiguous but rows are 100 apart
    torch.testing.assert_close(cpu_linear.linear(wide, weight), wide @ weight.T, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_inputs_the_kernel_does_not_take_get_an_error_that_says_what_it_takes():
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        cpu_linear.linear(torch.randn(3, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_linear.linear(torch.randn(3, 8), torch.randn(8, 4).T)


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 40, bias=False)
        self.b = nn.Linear(40, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@needs_kernel
def test_hooks_route_a_models_linears_to_the_kernel_and_come_off(monkeypatch):
    model = _Two()
    seen = []
    model.b.register_forward_hook(lambda module, args, output: seen.append(output.shape))  # a user's own hook
    calls = []
    real = cpu_linear._run  # every product the kernel computes
    monkeypatch.setattr(cpu_linear, "_run", lambda *a: calls.append(a[1].shape) or real(*a))
    x = torch.randn(1, 5, 24)
    with torch.no_grad():
        want = model(x)
        linears = cpu_linear.CpuLinears(model)
        assert linears.modules == 2
        assert torch.equal(model(x), want) and not calls  # inactive: the modules' own products
        with linears.active():
            got = model(x)
        assert calls == [model.a.weight.shape, model.b.weight.shape]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert seen[-1] == (1, 5, 8)  # the user's hook saw the kernel's result, not the empty stand-in
        linears.remove()
        with linears.active():
            model(x)
    assert len(calls) == 2
    assert not model.a._forward_hooks and not model.a._forward_pre_hooks
    assert len(model.b._forward_hooks) == 1 and not model.b._forward_pre_hooks  # only the user's hook is left


def test_a_kernel_that_cannot_be_built_is_reported_and_the_plan_keeps_torchs_products(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DSCALE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    cpu_linear._library.cache_clear()
    try:
        why = cpu_linear.unavailable()
        target = tiny_target("llama")
        drafter = tiny_drafter(target)
        plan = calibrate(target, drafter)
        with pytest.raises(RuntimeError, match="cpu_linear=True, but the CPU kernel cannot run"):
            calibrate(target, drafter, cpu_linear=True)
    finally:
        cpu_linear._library.cache_clear()
    assert why is not None
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        assert why.startswith("compiling cpu_linear.c with false failed")
    assert plan.cpu_linear_widths is None
    assert any(r.startswith("verify products by torch:") for r in plan.reasons)


@needs_kernel
def test_the_plan_keeps_the_kernel_at_the_widths_it_measures_cheaper(monkeypatch):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    widths_seen = []

    def costs(target, transposed, ways, widths, batch_size=1):  # the kernel cheaper from 4 tokens on
        widths_seen.append(list(widths))
        assert [way.kernel for way in ways] == [False, True]
        return {way: {w: ((0.5 if w >= 4 else 2.0) if way.kernel else 1.0) + 0.1 * w for w in widths}
                for way in ways}

    monkeypatch.setattr(target_forward, "verify_costs_ways", costs)
    plan = calibrate(target, drafter, direct_forward=False)  # the kernel against torch, in the target's forward
    assert widths_seen == [list(range(1, drafter.config.block_size + 1))]
    assert plan.cpu_linear_widths == tuple(range(4, drafter.config.block_size + 1))
    assert plan.verify_costs == {w: min(1.0, (0.5 if w >= 4 else 2.0)) + 0.1 * w
                                 for w in range(1, drafter.config.block_size + 1)}
    assert plan.to_dict()["cpu_linear_widths"] == list(plan.cpu_linear_widths)
    off = calibrate(target, drafter, cpu_linear=False, direct_forward=False)
    assert off.cpu_linear_widths is None and "verify products by torch: cpu_linear=False" in off.reasons
    assert len(widths_seen) == 1  # cpu_linear=False measures nothing twice


@needs_kernel
def test_every_way_is_measured_and_the_hooks_come_off():
    target = tiny_target("llama")
    ways = [target_forward.Way(direct, kernel) for direct in (False, True) for kernel in (False, True)]
    costs = REAL_VERIFY_COSTS_WAYS(target, None, ways, range(1, 5), repeats=1)
    assert list(costs) == ways and all(sorted(c) == [1, 2, 3, 4] for c in costs.values())
    assert all(c > 0 for way in ways for c in costs[way].values())
    assert not any(m._forward_pre_hooks for m in target.modules())


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_decoding_through_the_kernel_equals_plain_generate(kind, batch, monkeypatch):
    """Qwen2's projections carry biases; Gemma 3 slides a window; rows are left-padded unevenly."""
    target = tiny_target(kind)
    drafter = tiny_drafter(target)
    ids, mask = unevenly_padded(batch, seed=7)
    calls = []
    real = cpu_linear._run  # every product the kernel computes
    monkeypatch.setattr(cpu_linear, "_run", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert not calls
    ours = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                           custom_generate=custom_generate, drafter=drafter, cpu_linear=True)
    assert torch.equal(ours, plain)
    assert calls  # the verifies ran the kernel
    assert not any(m._forward_pre_hooks for m in target.modules())  # and took its hooks off


def test_a_cache_folder_that_cannot_be_written_is_reported(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HF_DSCALE_CACHE", str(blocker))  # the kernels folder would have to be inside a file
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("CC", "cc")
    cpu_linear._library.cache_clear()
    try:
        why = cpu_linear.unavailable()
    finally:
        cpu_linear._library.cache_clear()
    assert why is not None and why.startswith("building cpu_linear-avx2-") and "a-file" in why
