"""Time the cascade tree attention against SDPA with a dense mask (CUDA), and its achieved bandwidth."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine.tree import TokenTree
from ..kernels.tree_attention import tree_attention_triton


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def benchmark_tree_attention(
    prefix_lengths=(512, 2048, 8192, 32768),
    tree_sizes=(16, 48, 80),
    heads: int = 9,
    kv_heads: int = 3,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 50,
) -> list[dict]:
    """One row per (C, N): kernel and SDPA times in ms, bytes moved, achieved GB/s, max abs difference."""
    if not torch.cuda.is_available():
        raise ValueError("The tree attention benchmark needs a CUDA GPU (the kernels are tested on CPU by pytest).")
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for c in prefix_lengths:
        for n in tree_sizes:
            def rand(*shape):
                return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

            q = rand(1, heads, n, head_dim)
            kp, vp, kt, vt = (rand(1, kv_heads, length, head_dim) for length in (c, c, n, n))
            draws = torch.randint(0, 1 << 30, (n,), generator=g, device="cuda").tolist()
            parents = [-1] + [draws[i] % i for i in range(1, n)]
            mask = TokenTree(list(range(n)), parents, [0] * n, [{} for _ in range(n)]).ancestor_mask("cuda")[None]
            dense = torch.cat((torch.ones(1, n, c, dtype=torch.bool, device="cuda"), mask), dim=2)[:, None]
            groups = heads // kv_heads

            def sdpa():
                k = torch.cat((kp, kt), 2).repeat_interleave(groups, 1)
                v = torch.cat((vp, vt), 2).repeat_interleave(groups, 1)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

            def kernel():
                return tree_attention_triton(q, kp, vp, kt, vt, mask)

            t_kernel, t_sdpa = _time_ms(kernel, iters), _time_ms(sdpa, iters)
            moved = (q.numel() * 2 + 2 * kp.numel() + 2 * kt.numel()) * q.element_size() + mask.numel()
            rows.append({
                "prefix": c, "tree": n, "kernel_ms": round(t_kernel, 4), "sdpa_dense_ms": round(t_sdpa, 4),
                "speedup": round(t_sdpa / t_kernel, 3), "kernel_GBps": round(moved / t_kernel / 1e6, 1),
                "max_abs_diff": float((kernel().float() - sdpa().float()).abs().max()),
            })
    return rows
