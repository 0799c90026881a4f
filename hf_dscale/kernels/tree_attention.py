"""Cascade tree attention: queries of a token tree over [committed prefix | tree], merged by log-sum-exp.

Verification queries (the N tree nodes) attend to two key sets:

* the committed prefix (C keys), visible to every node (a key-validity vector per batch row covers
  left padding);
* the tree itself (N keys), where node i sees node j only if j is i or an ancestor of i.

Each part is a partial softmax attention returning its output o and log-sum-exp l; the full result is

    o = (e^{l1} o1 + e^{l2} o2) / (e^{l1} + e^{l2}),

computed stably around max(l1, l2). The prefix part is the long, mask-free stream (on a GPU it is the
memory traffic that matters); the tree part is small and masked. `tree_attention` runs the Triton
kernels on CUDA (or anywhere under `TRITON_INTERPRET=1`) and the torch reference otherwise.

Shapes: q [B, Hq, N, D]; prefix k/v [B, Hkv, C, D]; tree k/v [B, Hkv, N, D]; tree_mask [B, N, N] bool
(True = attend); prefix_valid [B, C] bool or None (all valid). Hq must be a multiple of Hkv (GQA).
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


# ---------------------------------------------------------------------------------- torch reference
def partial_attention_reference(q, k, v, mask, scale):
    """Softmax attention of q over (k, v) under mask [B, N, L] (True = attend), in fp32.

    Returns o [B, Hq, N, D] and lse [B, Hq, N]; a query that sees no key gets o = 0, lse = -inf.
    """
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhnd,bhld->bhnl", q.float(), k) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float32).min)).nan_to_num(0.0)
    return torch.einsum("bhnl,bhld->bhnd", weights, v), lse


def merge_states(o1, lse1, o2, lse2):
    """Combine two partial attentions over disjoint key sets (see the module docstring)."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]


def tree_attention_reference(q, k_prefix, v_prefix, k_tree, v_tree, tree_mask, scale=None, prefix_valid=None):
    """The cascade in torch (fp32 inside), output in q's dtype: the specification the kernels must match."""
    b, _, n, d = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    o, lse = partial_attention_reference(q, k_tree, v_tree, tree_mask, scale)
    c = k_prefix.shape[2]
    if c:
        valid = prefix_valid if prefix_valid is not None else torch.ones(b, c, dtype=torch.bool, device=q.device)
        o1, lse1 = partial_attention_reference(q, k_prefix, v_prefix, valid[:, None, :].expand(b, n, c), scale)
        o = merge_states(o1, lse1, o, lse)
    return o.to(q.dtype)


# ------------------------------------------------------------------------------------- triton kernels
if triton is not None:

    @triton.jit
    def _partial_attention_kernel(
        Q, K, V, M, O, LSE,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kl,
        stride_vb, stride_vh, stride_vl,
        stride_mb, stride_mn, stride_ml,
        stride_ob, stride_oh, stride_on,
        stride_lb, stride_lh,
        num_heads, groups, n_queries, n_keys, head_dim, scale,
        HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One (query block, batch x head) tile: online softmax over all keys, fp32 accumulators.

        Products run in the input dtype (bf16/fp16 tensor cores) or, with DOT_FP32 (fp32 inputs, and the
        interpreter, whose bf16 dot is wrong in triton 3.9), on fp32 operands in full IEEE precision.
        """
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // num_heads
        h = pid_bh % num_heads
        kv_h = h // groups
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q_ok = offs_m < n_queries
        d_ok = offs_d < head_dim
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                    mask=q_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k_ok = offs_n < n_keys
            k = tl.load(K + b * stride_kb + kv_h * stride_kh + offs_n[:, None] * stride_kl + offs_d[None, :],
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(V + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vl + offs_d[None, :],
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            allowed = q_ok[:, None] & k_ok[None, :]
            if HAS_MASK:
                bits = tl.load(M + b * stride_mb + offs_m[:, None] * stride_mn + offs_n[None, :] * stride_ml,
                               mask=allowed, other=0)
                allowed = allowed & (bits != 0)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :], out,
                 mask=q_ok[:, None] & d_ok[None, :])
        tl.store(LSE + b * stride_lb + h * stride_lh + offs_m, lse, mask=q_ok)

    @triton.jit
    def _merge_kernel(O1, L1, O2, L2, OUT, rows, head_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """OUT = LSE-weighted merge of two partial outputs; rows = B*H*N, all tensors contiguous."""
        offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        r_ok = offs_r < rows
        ok = r_ok[:, None] & (offs_d[None, :] < head_dim)
        l1 = tl.load(L1 + offs_r, mask=r_ok, other=float("-inf"))
        l2 = tl.load(L2 + offs_r, mask=r_ok, other=float("-inf"))
        top = tl.maximum(l1, l2)
        top = tl.where(top == float("-inf"), 0.0, top)
        w1 = tl.exp(l1 - top)
        w2 = tl.exp(l2 - top)
        total = tl.where(w1 + w2 > 0, w1 + w2, 1.0)
        o1 = tl.load(O1 + offs_r[:, None] * head_dim + offs_d[None, :], mask=ok, other=0.0)
        o2 = tl.load(O2 + offs_r[:, None] * head_dim + offs_d[None, :], mask=ok, other=0.0)
        out = (o1 * w1[:, None] + o2 * w2[:, None]) / total[:, None]
        tl.store(OUT + offs_r[:, None] * head_dim + offs_d[None, :], out, mask=ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _partial_attention_triton(q, k, v, mask, scale, block_m=16, block_n=32):
    """The Triton partial attention; mask is [B, N, L] (bool/int8) or None."""
    b, hq, n, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty(b, hq, n, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(b, hq, n, device=q.device, dtype=torch.float32)
    if mask is not None:
        mask = mask if mask.dtype == torch.int8 else mask.to(torch.int8)
        mstrides = mask.stride()
    else:
        mask, mstrides = q, (0, 0, 0)  # unused pointer
    block_d = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(n, block_m), b * hq)
    _partial_attention_kernel[grid](
        q, k, v, mask, o, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *mstrides,
        o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        hq, hq // k.shape[1], n, k.shape[2], d, scale,
        HAS_MASK=mask is not q, DOT_FP32=q.dtype == torch.float32 or _interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
    )
    return o, lse


def _merge_triton(o1, l1, o2, l2):
    out = torch.empty_like(o1)
    rows, d = o1.numel() // o1.shape[-1], o1.shape[-1]
    block_r = 32
    _merge_kernel[(triton.cdiv(rows, block_r),)](o1, l1, o2, l2, out, rows, d, BLOCK_R=block_r,
                                                 BLOCK_D=max(16, triton.next_power_of_2(d)))
    return out


def tree_attention_triton(q, k_prefix, v_prefix, k_tree, v_tree, tree_mask, scale=None, prefix_valid=None):
    """The cascade with Triton kernels: prefix pass (no mask unless padding), tree pass (ancestor mask), merge."""
    if triton is None:
        raise RuntimeError("Triton is not installed: pip install triton (Linux), or use tree_attention_reference.")
    d = q.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    o, lse = _partial_attention_triton(q, k_tree, v_tree, tree_mask, scale)
    if k_prefix.shape[2]:
        valid = None
        if prefix_valid is not None and not bool(prefix_valid.all()):
            valid = prefix_valid.to(torch.int8)[:, None, :].expand(-1, q.shape[2], -1)  # stride 0 over queries
        o1, lse1 = _partial_attention_triton(q, k_prefix, v_prefix, valid, scale)
        o = _merge_triton(o1, lse1, o, lse)
    return o.to(q.dtype)


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on any device under TRITON_INTERPRET=1."""
    if triton is None:
        return False
    return device.type == "cuda" or _interpreting()


def tree_attention(q, k_prefix, v_prefix, k_tree, v_tree, tree_mask, scale=None, prefix_valid=None):
    """Cascade tree attention with the Triton kernels where they run, the torch reference elsewhere."""
    fn = tree_attention_triton if triton_usable(q.device) else tree_attention_reference
    return fn(q, k_prefix, v_prefix, k_tree, v_tree, tree_mask, scale, prefix_valid)
