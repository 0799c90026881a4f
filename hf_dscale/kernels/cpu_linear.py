"""A CPU kernel for the matrix products of a verify: `F.linear` over a few token rows, reading each weight once.

On a CPU a one-token decoding step of a small model is bound by reading its weights, and so should a verify of a
few tokens be: 16 rows need 16 multiply-adds per weight read, which a core does faster than memory delivers the
weight. MKL's SGEMM does not get there at 4-16 rows. On a 2-core Xeon, SmolLM2-135M's 210 decoder products took
18.6 ms at one row and 29-43 ms at 4-16 rows; `cpu_linear.c` takes 19-27 ms at 4-16 rows, against a floor of about
19 ms for reading their 425 MB.

`cpu_linear.c` is compiled on first use with the machine's C compiler (`$CC`, else `cc`/`gcc`) into the cache
folder (`$HF_DSCALE_CACHE/kernels`, default `~/.cache/hf_dscale/kernels`), once per source and machine, in about
half a second, for the vector extension torch found (`torch.backends.cpu.get_cpu_capability()`: AVX-512F, or AVX2
with FMA). Where it cannot be built or loaded, `unavailable()` says why and nothing uses it. Whether a verify uses
it is measured per width by the engine's `calibrate` (`Plan.cpu_linear_widths`), since where it pays depends on the
CPU.

`CpuLinears(model)` routes the model's own `nn.Linear` calls to the kernel while it is active (`with
linears.active():`), through forward hooks on those modules, which `remove()` takes off: the model's code and
classes are not touched.

The same library holds the rest of a Llama-style decoder layer for `engine/direct_forward.py`: several products
of one input in one pass (`linear_many`), products that add into a residual stream (`_run(..., into=)`), RMS norms,
the rotary embedding in place (`rope_`), attention over a cache with an additive mask (`attention`) and SiLU(gate) *
up (`silu_mul`); each is tested against its torch counterpart.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
from pathlib import Path

import torch
from torch import nn

from .build import bind, build

SOURCE = Path(__file__).with_name("cpu_linear.c")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
ISA_FLAGS = {"AVX512": ("-mavx512f", "-mfma"), "AVX2": ("-mavx2", "-mfma")}  # by torch's CPU capability


class CpuLinearUnavailable(RuntimeError):
    """The kernel cannot run here; the message says why."""


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded kernel, or why it is not there (kept per process: the machine does not change while it runs)."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel is written for x86-64 Linux; this is {platform.system()} on {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    isa = "AVX512" if "AVX512" in capability else "AVX2" if "AVX2" in capability else None
    if isa is None:
        return f"the kernel needs AVX2 or AVX-512; torch reports this CPU's vector capability as {capability}"
    library = build(SOURCE, f"cpu_linear-{isa.lower()}", (*FLAGS, *ISA_FLAGS[isa]))
    if isinstance(library, str):
        return library
    library.isa = isa
    try:
        bind(library, SOURCE)  # argument and return types as the C source declares them
    except (ValueError, AttributeError) as error:
        return f"binding {SOURCE.name} failed: {error}"
    return library


def unavailable() -> str | None:
    """Why the kernel cannot run on this machine, or None when it can (builds it on the first call)."""
    library = _library()
    return library if isinstance(library, str) else None


def isa() -> str | None:
    """The vector extension the kernel was built for ("AVX512" or "AVX2"), or None where it cannot run."""
    library = _library()
    return None if isinstance(library, str) else library.isa


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` takes these tensors: float32 on the CPU, a row-major weight."""
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
            and x.dim() >= 2 and weight.dim() == 2 and weight.is_contiguous() and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.device.type == "cpu"))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel: x [..., K], weight [N, K] -> [..., N] (see `supports`)."""
    why = unavailable()
    if why is not None:
        raise CpuLinearUnavailable(why)
    if not supports(x, weight, bias):
        raise ValueError(f"cpu_linear.linear takes float32 CPU tensors without gradients and a contiguous [N, K] "
                         f"weight; got x {tuple(x.shape)} {x.dtype} on {x.device}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}.")
    return _run(x, weight, bias)


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         into: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` once the kernel is loaded and `supports` took the tensors; `into` (a contiguous float32 tensor of
    the output's shape): the product is added to it in place (a residual stream), and it is returned."""
    library = _library()
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32) if into is None else into.view(-1, n)
    if rows.shape[0]:
        library.hf_dscale_linear_f32(rows.data_ptr(), rows.stride(0), weight.data_ptr(),
                                     None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows.shape[0], n,
                                     k, torch.get_num_threads(), into is not None)
    return out.view(*x.shape[:-1], n) if into is None else into


MAX_MANY = 8  # weights `_run_many` takes in one pass


def linear_many(x: torch.Tensor, weights, biases=None) -> torch.Tensor:
    """`torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)` by the kernel in one parallel pass
    (up to 8 weights of the same K, see `supports`): x [..., K] -> [..., sum N]."""
    why = unavailable()
    if why is not None:
        raise CpuLinearUnavailable(why)
    biases = list(biases) if biases is not None else [None] * len(weights)
    if not 1 <= len(weights) <= MAX_MANY or len(biases) != len(weights) or \
            not all(supports(x, w, b) for w, b in zip(weights, biases)):
        raise ValueError(f"cpu_linear.linear_many takes 1 to {MAX_MANY} contiguous [N, K] weights (and as many "
                         f"biases or None) for float32 CPU tensors without gradients; got {len(weights)} weights of "
                         f"shapes {[tuple(w.shape) for w in weights]} for x {tuple(x.shape)} {x.dtype}.")
    return _run_many(x, weights, biases)


def _run_many(x: torch.Tensor, weights, biases) -> torch.Tensor:
    """`linear_many` once the kernel is loaded and `supports` took the tensors."""
    library = _library()
    k = weights[0].shape[1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    sizes = [w.shape[0] for w in weights]
    out = torch.empty(rows.shape[0], sum(sizes), dtype=torch.float32)
    if rows.shape[0]:
        count, pointers = len(weights), ctypes.c_void_p * len(weights)
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        library.hf_dscale_linear_many_f32(
            rows.data_ptr(), rows.stride(0), count, pointers(*(w.data_ptr() for w in weights)),
            pointers(*(None if b is None else b.data_ptr() for b in biases)),
            pointers(*(out.data_ptr() + 4 * start for start in starts)), out.shape[1],
            (ctypes.c_int64 * count)(*sizes), rows.shape[0], k, torch.get_num_threads())
    return out.view(*x.shape[:-1], out.shape[1])


# ---- the rest of a Llama-style decoder layer, for `engine/direct_forward.py` (float32, contiguous rows) ----

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension of a contiguous x."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    _library().hf_dscale_rms_norm_f32(x.data_ptr(), n, weight.data_ptr(), eps, out.data_ptr(), n, x.numel() // n, n)
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
          norm: tuple[torch.Tensor, float] | None = None) -> None:
    """The rotary embedding in place on the first `heads` heads of each row of x [rows, >= heads * head_dim] (any
    row stride, contiguous within a row): x * cos + rotate_half(x) * sin, with cos and sin [rows, head_dim]
    contiguous; `norm` (weight, eps): each head RMS-normed over its head_dim first."""
    weight, eps = norm if norm is not None else (None, 0.0)
    _library().hf_dscale_rope_f32(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(),
                                  sin.data_ptr(), None if weight is None else weight.data_ptr(), eps)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """`scaled_dot_product_attention(q, keys, values, mask, scale, enable_gqa=True)` laid out for the next product:
    q [B, Q, H, D] (a view, D contiguous), keys and values [B, G, L, D] with rows of D contiguous floats, mask
    additive [B, 1, Q, L] (L contiguous) -> [B, Q, H * D]."""
    b, n, heads, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    out = torch.empty(b, n, heads * d, dtype=torch.float32)
    threads = torch.get_num_threads()
    scores = torch.empty(threads, n * (length + 1), dtype=torch.float32)
    _library().hf_dscale_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), keys.data_ptr(), values.data_ptr(), keys.stride(0),
        keys.stride(1), mask.data_ptr(), mask.stride(0), mask.stride(2), out.data_ptr(), out.stride(0), out.stride(1),
        b, n, heads, kv_heads, length, d, scale, scores.data_ptr(), threads)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for gate_up [..., 2N] holding the two side by side -> [..., N]."""
    n = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=torch.float32)
    _library().hf_dscale_silu_mul_f32(gate_up.data_ptr(), gate_up.numel() // (2 * n), n, out.data_ptr())
    return out


class CpuLinears:
    """Runs `model`'s `nn.Linear` modules through the kernel while `active()`, for the inputs `supports` takes; any
    other call runs the module as usual.

    A forward pre-hook computes the product and hands the module an input of zero rows, so its own product costs
    nothing; a forward hook, first in line, returns the kernel's result in place of the empty one. Call `remove()`
    when done (the engine does at the end of each decode).
    """

    def __init__(self, model: nn.Module):
        why = unavailable()
        if why is not None:
            raise CpuLinearUnavailable(why)
        self.on = False
        self._results: dict[nn.Module, torch.Tensor] = {}
        self._handles = []
        for module in model.modules():
            if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:  # not a subclass' own
                self._handles.append(module.register_forward_pre_hook(self._before))
                self._handles.append(module.register_forward_hook(self._after, prepend=True))

    @property
    def modules(self) -> int:
        """How many modules the hooks cover."""
        return len(self._handles) // 2

    @contextlib.contextmanager
    def active(self):
        before, self.on = self.on, True
        try:
            yield self
        finally:
            self.on = before
            self._results.clear()

    def _before(self, module: nn.Linear, args):
        if not self.on or len(args) != 1:
            return None
        x = args[0]
        if not supports(x, module.weight, module.bias):
            return None
        self._results[module] = _run(x, module.weight, module.bias)
        return (x[..., :0, :],)

    def _after(self, module: nn.Linear, args, output):
        return self._results.pop(module, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

