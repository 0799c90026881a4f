"""The dLLM decoders' bookkeeping on the CPU in C (`dllm_host.c`): one call where torch runs a dozen small operations.

On a CPU a small masked-diffusion model's step is short, and what the decoder does between two model calls (the
threshold commit, the stopping rule's scan, BlockBatch's merge) is a fair part of it: each torch operation costs a few
microseconds whatever its size, and a BlockBatch step runs some sixty of them. These functions do the same work in
one pass each. They take CPU tensors (int64 rows, float32 logits and beliefs), change them in place as the torch
functions of `dllm/host.py` and `dllm/decode.py` do, and equal them: the tests compare both on random inputs,
tokens tied for a slot's top included. Two slots whose confidences are equal in exact arithmetic (the same logits in another order)
tie here, and the first is committed; torch's float sums may break such a tie by a rounding.

The library is built on first use like `cpu_linear` (`kernels/build.py`); where it cannot be, `unavailable()` says
why and the decoders keep to torch. Whether a decode uses it is its `host` argument (`dllm.host.host_kernel`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import bind, build

SOURCE = Path(__file__).with_name("dllm_host.c")
FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC", "-fno-fast-math")
PARALLEL_FROM = 1 << 12  # logits (slots x vocabulary) from which a commit splits its softmaxes between threads


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or why it is not there (kept per process)."""
    library = build(SOURCE, "dllm_host", FLAGS)
    if isinstance(library, str):
        return library
    try:
        bind(library, SOURCE)  # argument and return types as the C source declares them
    except (ValueError, AttributeError) as error:
        return f"binding {SOURCE.name} failed: {error}"
    return library


def unavailable() -> str | None:
    """Why the library cannot run here, or None when it can (builds it on the first call)."""
    library = _library()
    return library if isinstance(library, str) else None


def _check(x: torch.Tensor) -> None:
    if x.device.type != "cpu" or x.dtype != torch.long or not x.is_contiguous():
        raise ValueError(f"dllm_host takes the rows as a contiguous int64 CPU tensor; got {x.dtype} on {x.device}.")


def commit(x: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor,
           mask_id: int, eos_id: int | None, threshold: float, beliefs: tuple | None = None,
           prompt_len: int | None = None) -> list:
    """`dllm.host.commit_windows` from the logits: window r of x [N, L] is row rows[r] [R] at positions
    targets [R, Q] (valid [R, Q]: False is padding), with logits [R, Q, V] there. `beliefs`: (prob, eos, best), each
    [N, L] (float32, float32, int64), take every valid slot's probability, EOS probability and most likely token, as
    `_Branches.remember` of `_beliefs` does. Returns the tokens each window committed; with `prompt_len`, the rows'
    `scan` after the commit instead (made in the same call)."""
    args, counts, scanned, _keep = _commit_args(x, rows, targets, valid, logits, mask_id, eos_id, threshold, beliefs,
                                                prompt_len)
    _library().hf_dscale_dllm_commit(*args)
    return counts.tolist() if scanned is None else _scanned(scanned)


def commit_merge(x: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                 logits: torch.Tensor, mask_id: int, eos_id: int | None, threshold: float, beliefs: tuple | None,
                 prompt_len: int, sizes: list[int], prob: torch.Tensor, best: torch.Tensor, gate: float
                 ) -> tuple[list, tuple | None]:
    """`commit` (with its scan) of a BlockBatch step's windows, then in the same call, unless a window's answer
    ended, the merge that `dllm.decode` runs after it: the windows' branches that still hold a mask move their
    windows (`sizes`: each window's block size) and merge as `merge` does (prob and best: the maps it reads).
    Returns (the commit's scan, the merge's (tokens adopted, scan) over those branches in window order, or None
    where it did not run: an answer ended, or fewer than two branches hold a mask)."""
    args, _, scanned, _keep = _commit_args(x, rows, targets, valid, logits, mask_id, eos_id, threshold, beliefs,
                                           prompt_len)
    r = len(sizes)
    i64s = ctypes.c_int64 * r
    start = i64s()
    out = (ctypes.c_int64 * (4 * r))()  # adopted [R], then the scan [R, 3]
    n = _library().hf_dscale_dllm_commit_merge(*args, i64s(*sizes), start, prob.data_ptr(), best.data_ptr(), gate,
                                               out, ctypes.byref(out, 8 * r))
    return _scanned(scanned), (_adopted_and_scan(out, r, n) if n > 0 else None)


def _commit_args(x, rows, targets, valid, logits, mask_id, eos_id, threshold, beliefs, prompt_len) -> tuple:
    """`hf_dscale_dllm_commit`'s arguments, the tensors it fills (counts [R]; the scan [R, 3] or None), and the
    tensors its pointers point into, which the caller holds until the call returns."""
    _check(x)
    r, q = targets.shape
    logits = logits.reshape(r * q, -1)
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    rows, targets = rows.contiguous(), targets.contiguous()
    valid = valid.contiguous().view(torch.uint8)
    counts = torch.empty(r, dtype=torch.long)
    scanned = None if prompt_len is None else torch.empty(r, 3, dtype=torch.long)
    prob = eos = best = None
    if beliefs is not None:
        prob, eos, best = (t.data_ptr() for t in beliefs)
    args = (logits.data_ptr(), logits.stride(0), logits.shape[1], r, q, valid.data_ptr(), rows.data_ptr(),
            targets.data_ptr(), x.data_ptr(), x.shape[1], mask_id, -1 if eos_id is None else eos_id, threshold, prob,
            eos, best, counts.data_ptr(), prompt_len or 0, None if scanned is None else scanned.data_ptr(),
            torch.get_num_threads() if logits.numel() >= PARALLEL_FROM else 1)
    return args, counts, scanned, (logits, rows, targets, valid)


def beliefs(logits: torch.Tensor, rows: torch.Tensor, of_row: torch.Tensor, mask_id: int, eos_id: int | None,
            prob: torch.Tensor, eos: torch.Tensor, best: torch.Tensor) -> None:
    """What `dllm.host._beliefs(*confidences(logits, mask_id), eos_id)` gives for a full forward's logits
    [U, L, V] of U distinct rows, stored for every position as the maps prob, eos and best [N, L] (float32, float32,
    int64) of branch rows[n] [R], which takes those of distinct row of_row[n] [R]."""
    u, length, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    rows, of_row = rows.contiguous(), of_row.contiguous()
    _library().hf_dscale_dllm_beliefs(logits.data_ptr(), logits.stride(0), logits.stride(1), vocab, u, length,
                                      len(rows), rows.data_ptr(), of_row.data_ptr(), mask_id,
                                      -1 if eos_id is None else eos_id, prob.data_ptr(), eos.data_ptr(),
                                      best.data_ptr(), torch.get_num_threads() if logits.numel() >= PARALLEL_FROM
                                      else 1)


def _scanned(out: torch.Tensor) -> list[tuple]:
    return [(None if f < 0 else f, None if e < 0 else e, n) for f, e, n in out.tolist()]


def scan(x: torch.Tensor, rows: torch.Tensor, prompt_len: int, mask_id: int, eos_id: int | None) -> list[tuple]:
    """`dllm.host.scan(x[rows], prompt_len, mask_id, eos_id, counts=True)`: (first mask offset, end, decoded)
    per row, None where the torch function has None."""
    _check(x)
    out = torch.empty(len(rows), 3, dtype=torch.long)
    rows = rows.contiguous()
    _library().hf_dscale_dllm_scan(x.data_ptr(), x.shape[1], len(rows), rows.data_ptr(), prompt_len, mask_id,
                                   -1 if eos_id is None else eos_id, out.data_ptr())
    return _scanned(out)


def merge(x: torch.Tensor, rows: list[int], after: torch.Tensor, starts: list[int], sizes: list[int],
          prob: torch.Tensor, best: torch.Tensor, gate: float, mask_id: int, prompt_len: int = 0
          ) -> tuple[list[int], list[tuple]]:
    """The merge of `dllm.decode._merge` over branches `rows` of x (in place): after [R, R] (bool, [dst, src]),
    each branch's window start and size, its beliefs prob [N, L] (float32) and best [N, L] (int64); `gate` the
    probability a position must exceed (the merge gate or the floor, the higher). Returns the tokens each adopted,
    and the rows' `scan` from `prompt_len` after the merge (without an EOS: the first mask and the tokens decoded
    are what count)."""
    _check(x)
    r = len(rows)
    i64s = ctypes.c_int64 * r
    out = (ctypes.c_int64 * (4 * r))()  # adopted [R], then the scan [R, 3]
    _library().hf_dscale_dllm_merge(x.data_ptr(), x.shape[1], r, i64s(*rows), after.contiguous().data_ptr(),
                                    i64s(*starts), i64s(*sizes), prob.data_ptr(), best.data_ptr(), gate, mask_id, out,
                                    prompt_len, ctypes.byref(out, 8 * r))
    return _adopted_and_scan(out, r, r)


def _adopted_and_scan(out, r: int, n: int) -> tuple[list[int], list[tuple]]:
    """A merge's output buffer (adopted [R], then the scan [R, 3]) read for its first n branches."""
    values = list(out)
    return values[:n], [(None if f < 0 else f, None if e < 0 else e, d)
                        for f, e, d in (values[k : k + 3] for k in range(r, r + 3 * n, 3))]
