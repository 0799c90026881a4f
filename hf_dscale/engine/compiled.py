"""The verify forward compiled at the edge: fixed shapes, and on a CPU the target's weights frozen into the graph.

On a CPU an eager verify of 9 tokens costs about 1.8x a one-token step: MKL's small-M GEMMs repack the weights at
every call and dozens of small ops run between them. Compiled by inductor with freezing (the weights become
constants, prepacked once for the width), the same verify costs about 1.2x a step, so wider trees pay. Compiling
needs fixed shapes, which a growing cache does not have; here the cache is a `compat.column_cache` (every forward
sees all `capacity` columns, its 4D mask hides those not in use) and a tree is padded to one of a few `widths`, so
a shape depends only on the batch size and the width: one compile for each (marked dynamic in the capacity, so a
longer generation does not compile again). Compiling takes tens of seconds per width on a CPU; it is kept in
`compile_s`, apart from decode time.

The tapped layers' outputs (the drafter's context) come back as the forward's `hidden_states`, not through hooks,
so the compiled graph does not depend on hooks the engine adds and removes. A frozen graph keeps the weights it
froze: where they change between generations (a training loop), the verify compiles once more without freezing
(`static_verify_for`).
"""

from __future__ import annotations

import itertools
import time
import types
import weakref

import torch
from torch import nn

from ..models.dscale import compat
from .target_forward import apply_head, splittable

RECOMPILE_LIMIT = 256  # compiled shapes the verify keeps in one process (dynamo's own default: 8)


class StaticVerify:
    """One target's forward at fixed shapes, compiled once per (batch, width).

    `__call__(ids, positions, mask, cache)` -> (logits [B, W, V], taps [B, W, T, H]) for `ids` [B, W] at the columns
    `cache.columns.write` names; `prefill(...)` is the same forward run eagerly, with the head on the last position
    only.
    """

    def __init__(self, target: nn.Module, tap_ids: list[int], widths: tuple[int, ...], freeze: bool | None = None):
        layers = target.config.get_text_config(decoder=True).num_hidden_layers
        if layers - 1 in tap_ids:
            raise ValueError(f"The drafter reads the target's last layer ({layers - 1}), whose output transformers "
                             "returns only after the final norm, so a compiled verify cannot hand it over: decode "
                             "without compile.")
        self.target, self.tap_ids, self.widths = target, list(tap_ids), tuple(sorted(widths))
        self.split = splittable(target)  # run the base model and apply the head here (only where that is exact)
        self.module = target.base_model if self.split else target
        self.cache_name = next(iter(compat.cache_kwargs(self.module, None)))  # outside the graph: an lru_cache'd lookup
        self.compiled = torch.compile(_own_code(self._forward), dynamic=False)
        self.seen: set[tuple[int, int]] = set()  # (batch, width) already compiled
        # Freezing makes the weights constants of the graph, which on a CPU lets inductor prepack them for MKL once
        # (a 16-token verify of SmolLM2: 49 ms frozen, 61 ms not); a GPU's GEMMs gain nothing from it. A frozen graph
        # keeps the weights it froze, so `fingerprint` tells when they have changed since.
        self.freeze = next(target.parameters()).device.type == "cpu" if freeze is None else freeze
        self.fingerprint = weights_fingerprint(target)
        self.compile_s = 0.0

    def width(self, n: int) -> int:
        """The bucket a verify of n nodes runs at (the widest, if n exceeds every bucket)."""
        return next((w for w in self.widths if w >= n), self.widths[-1])

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask, cache, last: bool = False):
        out = self.module(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                     output_hidden_states=True, **{self.cache_name: cache})
        taps = torch.stack([out.hidden_states[i + 1] for i in self.tap_ids], dim=2)  # [B, W, T, H]
        if not self.split:
            return out.logits[:, -1:] if last else out.logits, taps
        hidden = out.last_hidden_state[:, -1:] if last else out.last_hidden_state
        return apply_head(self.target.get_output_embeddings(), hidden, False), taps

    def _run(self, *args):
        # Scoped to this call, not the process: freezing, and room for every compiled shape (each batch size and
        # width is one graph; past dynamo's default limit of 8 the ninth would run eagerly, silently).
        with torch._inductor.config.patch(freezing=self.freeze), \
                torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)):
            return self.compiled(*args)

    def prefill(self, ids, positions, mask, cache):
        return self._forward(ids, positions, mask, cache, last=True)

    def __call__(self, ids, positions, mask, cache):
        for layer in cache.layers:  # the capacity may change between generations: not a reason to compile again
            for tensor in (layer.keys, layer.values):
                torch._dynamo.mark_dynamic(tensor, 2)
        for m in mask.values() if isinstance(mask, dict) else (mask,):
            torch._dynamo.mark_dynamic(m, 3)
        shape = tuple(ids.shape)
        if shape in self.seen:
            return self._run(ids, positions, mask, cache)
        start = time.perf_counter()
        out = self._run(ids, positions, mask, cache)
        self.compile_s += time.perf_counter() - start
        self.seen.add(shape)
        return out

    @torch.no_grad()
    def measure(self, batch_size: int = 1, context: int = 256, repeats: int = 3, clock=time.perf_counter) -> dict:
        """Compile every width at `batch_size` (timed into `compile_s`) and return the median seconds of a verify at
        each, over a cache of `context` positions (`median_seconds`)."""
        from ..timing import median_seconds
        from .masks import TargetAttention

        device = next(self.target.parameters()).device
        widest = self.widths[-1]
        cache = compat.column_cache(context + widest)
        attention = TargetAttention.of(self.target)
        dtype = next(self.target.parameters()).dtype
        ids = torch.zeros(batch_size, context + widest, dtype=torch.long, device=device)
        positions = torch.arange(context + widest, device=device).expand(batch_size, -1)
        causal = torch.ones(context + widest, context + widest, dtype=torch.bool, device=device).tril()

        def run(start: int, width: int, call):
            cache.columns.write, cache.columns.length = torch.arange(start, start + width, device=device), start + width
            allowed = causal[start : start + width].expand(batch_size, -1, -1)
            mask = attention.masks(allowed, positions[:, start : start + width], positions, dtype)
            return call(ids[:, start : start + width].clone(memory_format=torch.contiguous_format),
                        positions[:, start : start + width].clone(memory_format=torch.contiguous_format),
                        mask, cache)

        run(0, context, self.prefill)
        for width in self.widths:
            run(context, width, self)  # compiles
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        jobs = {w: (lambda w=w: run(context, w, self)) for w in self.widths}
        return median_seconds(jobs, repeats, clock, sync)


def _own_code(method):
    """`method` running a copy of its function's code. Dynamo keeps its compiled graphs on the code object and guards
    `self` by type only: with a code object of its own, each StaticVerify's graphs (which hold the weights they
    froze) serve that object alone and are freed with it, and a StaticVerify built after the weights changed never
    runs an older one."""
    function = method.__func__
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    return types.MethodType(copy, method.__self__)


def weights_fingerprint(module: nn.Module) -> tuple:
    """What changes when any parameter or buffer of `module` does: each tensor's storage and its version counter,
    which every in-place write bumps (an optimizer step, `load_state_dict`, `.to()`)."""
    return tuple((t.data_ptr(), t._version) for t in itertools.chain(module.parameters(), module.buffers()))


def static_verify_for(target: nn.Module, drafter: nn.Module, tap_ids: list[int],
                      widths: tuple[int, ...]) -> StaticVerify:
    """The `StaticVerify` of `target` for these taps and widths, compiled once and kept on the drafter (held weakly by
    target, as `plan_for` keeps plans), so that later `generate()` calls do not compile again.

    A frozen one holds the weights it was compiled with. Once the target's weights change (`weights_fingerprint`: a
    training step between generations, `load_state_dict`), it is replaced by one that reads them at every call (not
    frozen), compiled once more and kept from then on: weights that change once may change again, and each frozen
    compile would keep another copy of them."""
    kept = drafter.__dict__.setdefault("_static_verifies", weakref.WeakKeyDictionary())
    known = kept.setdefault(target, {})
    key = (tuple(tap_ids), tuple(sorted(widths)))
    if key not in known:
        known[key] = StaticVerify(target, tap_ids, widths)
    elif known[key].freeze and known[key].fingerprint != weights_fingerprint(target):
        known[key] = StaticVerify(target, tap_ids, widths, freeze=False)
    return known[key]
