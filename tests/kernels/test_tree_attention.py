"""Triton cascade tree attention against its torch reference (CPU: TRITON_INTERPRET=1, set in conftest),
the reference against dense SDPA, and the kernel inside a real D²SD verification."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_dscale.generation import custom_generate
from hf_dscale.engine.tree import TokenTree
from hf_dscale.engine import attention as hf_attention
from hf_dscale.kernels import tree_attention_reference, tree_attention_triton, triton_usable
from hf_dscale.kernels.tree_attention import merge_states, partial_attention_reference

from ..conftest import tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(not triton_usable(torch.device("cpu")) and not torch.cuda.is_available(),
                                reason="needs triton (CPU: TRITON_INTERPRET=1)")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on the CPU


def _random_tree(n: int, generator: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, n)]
    tree = TokenTree(list(range(n)), parents, [0] * n, [{} for _ in range(n)])
    return tree.ancestor_mask()


def _case(b, hq, hkv, n, c, d, dtype, seed, device=DEVICE, padded=True):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, kp, vp, kt, vt = rand(b, hq, n, d), rand(b, hkv, c, d), rand(b, hkv, c, d), rand(b, hkv, n, d), rand(b, hkv, n, d)
    mask = torch.stack([_random_tree(n, g) for _ in range(b)]).to(device)
    valid = torch.ones(b, c, dtype=torch.bool, device=device)
    if padded and c > 4:
        valid[-1, : c // 3] = False  # the last row is left-padded
    return q, kp, vp, kt, vt, mask, valid


def _dense(q, kp, vp, kt, vt, mask, valid):
    groups = q.shape[1] // kp.shape[1]
    k = torch.cat((kp, kt), 2).float().repeat_interleave(groups, 1)
    v = torch.cat((vp, vt), 2).float().repeat_interleave(groups, 1)
    allowed = torch.cat((valid[:, None, :].expand(-1, q.shape[2], -1), mask), 2)[:, None]
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=allowed)


@pytest.mark.parametrize("shape", [
    (1, 4, 2, 20, 37, 64),   # GQA, N and C not multiples of the tiles
    (2, 9, 3, 33, 70, 64),   # SmolLM2 heads
    (1, 2, 2, 5, 0, 32),     # empty prefix: the tree part alone
    (2, 4, 1, 16, 16, 48),   # head_dim not a power of two
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference_on_random_trees(shape, dtype):
    case = _case(*shape, dtype=dtype, seed=sum(shape))
    scale = 1 / math.sqrt(shape[-1])
    ref = tree_attention_reference(*case[:6], scale, case[6])
    out = tree_attention_triton(*case[:6], scale, case[6])
    assert out.dtype == dtype
    assert (out.float() - ref.float()).abs().max().item() < TOLERANCE[dtype]


def test_reference_equals_dense_sdpa_and_merge_is_exact():
    q, kp, vp, kt, vt, mask, valid = _case(2, 4, 2, 12, 30, 32, torch.float32, seed=1, device="cpu")
    ref = tree_attention_reference(q, kp, vp, kt, vt, mask, None, valid)
    assert torch.allclose(ref, _dense(q, kp, vp, kt, vt, mask, valid), atol=1e-5)
    # merging the two halves of one key set equals attending to all of it
    keys = torch.ones(2, 12, 30, dtype=torch.bool)
    o, lse = partial_attention_reference(q, kp, vp, keys, 0.3)
    o1, l1 = partial_attention_reference(q, kp[:, :, :11], vp[:, :, :11], keys[:, :, :11], 0.3)
    o2, l2 = partial_attention_reference(q, kp[:, :, 11:], vp[:, :, 11:], keys[:, :, 11:], 0.3)
    assert torch.allclose(merge_states(o1, l1, o2, l2), o, atol=1e-6)


def test_kernel_inside_d2sd_verification_keeps_greedy_identity(monkeypatch):
    calls = []
    original = hf_attention.tree_attention
    monkeypatch.setattr(hf_attention, "tree_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    target = tiny_target("qwen3").to(DEVICE)
    ids = torch.tensor([[3, 17, 29, 41, 8, 66, 12]], device=DEVICE)
    plain = target.generate(ids, max_new_tokens=8, do_sample=False)
    spec = target.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=custom_generate,
                           drafter=tiny_drafter(target).to(DEVICE), vp_drafter=tiny_drafter(target, seed=4).to(DEVICE),
                           tree_kernel=True)
    assert torch.equal(plain, spec)
    assert calls  # the verification forwards went through the kernel
    assert target.config._attn_implementation == "sdpa"  # restored afterwards


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_on_gpu(dtype):
    case = _case(1, 9, 3, 48, 1500, 64, dtype, seed=7, device="cuda")
    ref = tree_attention_reference(*case[:6], None, case[6])
    out = tree_attention_triton(*case[:6], None, case[6])
    assert (out.float() - ref.float()).abs().max().item() < TOLERANCE[dtype]
