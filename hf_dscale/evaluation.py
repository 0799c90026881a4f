"""Side-by-side measurement of plain greedy `generate()` and speculative decoding (no I/O, no printing)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .generation import DecodeStats, custom_generate

BENCH_METHODS = ("auto", "dscale", "dscale-tree", "d2sd")


@dataclass
class BenchResult:
    method: str
    n_prompts: int = 0
    new_tokens: int = 0
    baseline_s: float = 0.0
    method_s: float = 0.0
    identical: bool = True
    mismatches: list[str] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    outputs: list[torch.Tensor] = field(default_factory=list)  # speculative sequences, per prompt
    per_prompt: list[dict] = field(default_factory=list)  # id, new_tokens, tau, forwards, identical
    weights_read_s: float | None = None  # `weights_read_seconds` of the target: the floor of one forward

    def to_json(self) -> dict:
        cycles = max(1, self.stats.cycles)
        cycle_ms = 1000 * (self.stats.draft_s + self.stats.verify_s + self.stats.other_s) / cycles
        step_ms = 1000 * self.baseline_s / max(1, self.new_tokens)  # plain decoding: one forward per token
        verified = self.stats.verified
        verify_tokens = round(sum(verified) / len(verified), 2) if verified else None
        histogram: dict[int, int] = {}
        for n in self.stats.committed:
            histogram[n] = histogram.get(n, 0) + 1
        return {
            "method": self.method,
            "n_prompts": self.n_prompts,
            "new_tokens": self.new_tokens,
            "tau": round(self.stats.tau, 4),
            "state_bytes": self.stats.state_bytes,
            "tokens_per_s": round(self.new_tokens / max(self.method_s, 1e-9), 3),
            "baseline_tokens_per_s": round(self.new_tokens / max(self.baseline_s, 1e-9), 3),
            "speedup": round(self.baseline_s / max(self.method_s, 1e-9), 4),
            "identical": self.identical,
            "mismatches": self.mismatches,
            "stage_ms": {
                "draft": round(1000 * self.stats.draft_s / cycles, 3),
                "verify": round(1000 * self.stats.verify_s / cycles, 3),
                "other": round(1000 * self.stats.other_s / cycles, 3),
            },
            "compile_s": round(self.stats.compile_total_s, 3),
            "weights_read_ms": None if self.weights_read_s is None else round(1000 * self.weights_read_s, 3),
            **_against_weights_read(self.weights_read_s, cycle_ms=cycle_ms, plain_step_ms=step_ms),
            "acceptance_histogram": {str(k): v for k, v in sorted(histogram.items())},
            "per_prompt": self.per_prompt,
            **({"verify_tokens": verify_tokens} if verify_tokens else {}),
            **({"tree_tokens": verify_tokens} if verify_tokens and self.method != "dscale" else {}),
            **({"plan": self.stats.plan.to_dict()} if self.stats.plan is not None else {}),
        }


@torch.no_grad()
def weights_read_seconds(model: torch.nn.Module, repeats: int = 5, clock: Callable[[], float] = time.perf_counter,
                         fused: bool | None = None) -> float:
    """Median seconds to read every parameter and buffer of `model` once (a reduction over each): the floor of any
    forward that uses all the weights. A one-token step of a small model on a GPU or a CPU is bound by that read; a
    speculative cycle's time over it says how far a cycle (draft, verify of many tokens, bookkeeping) is from it.

    `fused`: one multi-tensor reduction (`torch._foreach_norm`, one launch per group of tensors on a GPU) instead of
    one per tensor, whose launches would outlast the reads of a small model on a GPU; None: on CUDA only (on a CPU
    the per-tensor sums read faster)."""
    from .timing import median_seconds

    tensors = {t.data_ptr(): t for t in itertools.chain(model.parameters(), model.buffers()) if t.numel()}
    groups: dict[torch.dtype, list[torch.Tensor]] = {}  # tied weights once; one group per dtype
    for t in tensors.values():
        groups.setdefault(t.dtype, []).append(t)
    device = next(iter(tensors.values())).device
    fused = device.type == "cuda" if fused is None else fused
    floats = [g for dtype, g in groups.items() if dtype.is_floating_point]
    others = [t for dtype, g in groups.items() if not dtype.is_floating_point for t in g]  # e.g. position ids

    def read() -> None:
        if fused:
            for group in floats:
                torch._foreach_norm(group, 1)
        else:
            for group in floats:
                for t in group:
                    t.sum()
        for t in others:
            t.sum()

    read()  # the first read may allocate
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return median_seconds({"read": read}, repeats, clock, sync)["read"]


def _against_weights_read(read_s: float | None, **ms: float) -> dict:
    """Each of `ms` (milliseconds) and its ratio to the weights' read (`<name>_over_weights_read`), rounded; the ms
    alone without a read."""
    out = {}
    for name, value in ms.items():
        out[name] = round(value, 3)
        if read_s is not None:
            out[f"{name.removesuffix('_ms')}_over_weights_read"] = round(value / max(1000 * read_s, 1e-9), 3)
    return out


def _timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def method_generate_kwargs(method: str, drafter, vp_drafter=None, **method_kwargs) -> dict:
    """The `target.generate` keyword arguments that decode with a `BENCH_METHODS` method through `custom_generate`
    (extra keyword arguments such as `num_branches` pass through)."""
    if method not in BENCH_METHODS:
        raise ValueError(f"method must be one of {BENCH_METHODS}, got {method!r}.")
    if (method == "d2sd") != (vp_drafter is not None):
        raise ValueError("method 'd2sd' needs a VP drafter (--vp-drafter); 'dscale' and 'dscale-tree' take none.")
    kwargs = dict(custom_generate=custom_generate, drafter=drafter, **method_kwargs)
    if vp_drafter is not None:
        kwargs["vp_drafter"] = vp_drafter
    if method in ("dscale", "dscale-tree"):
        kwargs["draft_tree"] = method == "dscale-tree"
    return kwargs


@torch.no_grad()
def bench_speculative(
    target,
    drafter,
    prompts: list[tuple[str, torch.Tensor]],  # (id, input ids [1, P])
    max_new_tokens: int = 256,
    method: str = "dscale",
    on_prompt: Callable[[int], None] | None = None,
    vp_drafter=None,
    **method_kwargs,
) -> BenchResult:
    """Plain greedy `generate()` and the speculative method on the same prompts, alternating per prompt.

    method "auto" decodes as `custom_generate` does with no method options (the engine's plan chooses); "dscale"
    verifies the drafter's block as a chain; "dscale-tree" the block plus the drafter's own runner-up alternatives
    as a token tree; "d2sd" adds `vp_drafter` (extra keyword arguments such as `num_branches` go to
    `custom_generate`).
    """
    result = BenchResult(method=method)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    spec_kw = method_generate_kwargs(method, drafter, vp_drafter, **method_kwargs)
    warm = prompts[0][1]
    target.generate(warm, max_new_tokens=4, do_sample=False)
    target.generate(warm, max_new_tokens=4, do_sample=False, **spec_kw)
    result.weights_read_s = weights_read_seconds(target)
    for i, (name, ids) in enumerate(prompts):
        plain, t_plain = _timed(lambda: target.generate(ids, **kw))
        stats = DecodeStats()
        spec, t_spec = _timed(
            lambda: target.generate(ids, **kw, **spec_kw, dscale_stats=stats)
        )
        result.n_prompts += 1
        result.new_tokens += plain.shape[1] - ids.shape[1]
        result.baseline_s += t_plain
        result.method_s += t_spec
        result.stats.merge(stats)
        result.outputs.append(spec)
        same = torch.equal(plain, spec)
        result.per_prompt.append({"id": name, "new_tokens": plain.shape[1] - ids.shape[1], "tau": round(stats.tau, 4),
                                  "forwards": len(stats.committed), "identical": same})
        if not same:
            result.identical = False
            result.mismatches.append(name)
        if on_prompt is not None:
            on_prompt(i)
    return result


# ------------------------------------------------------------------------------------------------- peers
@dataclass
class Peer:
    """One way to decode: `kwargs` for `target.generate` (besides the ids, max_new_tokens and do_sample);
    `dscale`: it takes `dscale_stats`."""

    name: str
    kwargs: dict
    dscale: bool = False
    autoregressive: bool = False  # one target forward per token (plain decoding): its step is timed per token


def peers_for(target, drafter, vp_drafter=None, num_branches: int = 4, draft_confidence=None,
              prompt_lookup_num_tokens: int = 10, compile: bool = False) -> list[Peer]:
    """Every way to decode with `target` that `hf-dscale bench --peers` compares, plain `generate()` first:

    * `generate`: plain eager decoding with a `DynamicCache`;
    * `generate-static`: plain decoding with a static cache (`cache_implementation="static"`), which transformers
      also compiles where it compiles by default (a GPU);
    * `transformers-prompt-lookup`: transformers' prompt lookup (`prompt_lookup_num_tokens`);
    * `transformers-dflash`: transformers' own DFlash assisted decoding with the drafter
      (`speculation_type="dflash"`), where the installed transformers taps the right layers, and
      `transformers-dflash-static` the same with a static cache (left out of the report, with the reason, where
      the installed transformers refuses it);
    * `assistant_model`: transformers' assisted decoding with the drafter;
    * `dscale-auto` (what `custom_generate` does with no method options: the engine's plan chooses), `dscale` (the
      chain), `dscale-tree`, `dscale-tree-lookup`, `d2sd` (with a VP drafter): hf_dscale's `custom_generate` (on a
      target with recurrent or conv layers `dscale-auto` verifies one path a row, the likelier of the chain and the
      prompt lookup's, and the trees verify each of their paths as a row);
    * with `compile`: `generate-compiled`, plain decoding with a static cache compiled by transformers on any device
      (`compat.compile_everywhere`), and the plan's method with the other verify than the device's default
      (`plan.compile_by_default`): `dscale-auto-compiled` (`custom_generate(compile=True)`) where the default is
      eager (a CPU), `dscale-auto-eager` (`compile=False`) where it compiles (a GPU);
    * on a CPU where hf_dscale's CPU kernel runs, `dscale-auto-no-cpu-kernel`: the plan's method with torch's
      matrix products in every verify (`cpu_linear=False`);
    * where the direct forward runs the target, `dscale-auto-model-forward`: the plan's method verifying through the
      target's own forward (`direct_forward=False`).
    """
    from .engine import direct_forward
    from .engine.plan import compile_by_default
    from .kernels import cpu_linear
    from .models.dscale.compat import compile_everywhere, native_dflash_reads_layer_outputs

    ours = dict(custom_generate=custom_generate, drafter=drafter, draft_confidence=draft_confidence)
    peers = [
        Peer("generate", {}, autoregressive=True),
        Peer("generate-static", {"cache_implementation": "static"}, autoregressive=True),
        Peer("transformers-prompt-lookup", {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}),
    ]
    if compile:
        peers.append(Peer("generate-compiled", {"cache_implementation": "static", **compile_everywhere()},
                          autoregressive=True))
    if native_dflash_reads_layer_outputs():
        dflash = {"assistant_model": drafter, "speculation_type": "dflash"}
        peers += [Peer("transformers-dflash", dflash),
                  Peer("transformers-dflash-static", dict(dflash, cache_implementation="static"))]
    peers += [
        Peer("assistant_model", {"assistant_model": drafter}),
        Peer("dscale-auto", ours, dscale=True),
        Peer("dscale", dict(ours, draft_tree=False), dscale=True),
    ]
    peers += [Peer("dscale-tree", dict(ours, draft_tree=True, num_branches=num_branches), dscale=True),
              Peer("dscale-tree-lookup", dict(ours, draft_tree=True, num_branches=num_branches, prompt_lookup=True),
                   dscale=True)]
    if compile:
        compiled = compile_by_default(next(target.parameters()).device)[0]
        peers.append(Peer("dscale-auto-eager", dict(ours, compile=False), dscale=True) if compiled else
                     Peer("dscale-auto-compiled", dict(ours, compile=True), dscale=True))
    if next(target.parameters()).device.type == "cpu" and cpu_linear.unavailable() is None:
        peers.append(Peer("dscale-auto-no-cpu-kernel", dict(ours, cpu_linear=False), dscale=True))
    if direct_forward.unavailable(target) is None:
        peers.append(Peer("dscale-auto-model-forward", dict(ours, direct_forward=False), dscale=True))
    if vp_drafter is not None:
        peers.append(Peer("d2sd", dict(ours, vp_drafter=vp_drafter, num_branches=num_branches), dscale=True))
    return peers


class _PeakMemory:
    """Peak memory of the code inside `with`: CUDA's allocator peak on a GPU, the process's peak resident set
    (`VmHWM`, reset through /proc/self/clear_refs) on a Linux CPU; None where neither can be read."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.bytes = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.bytes = torch.cuda.max_memory_allocated()
        else:
            try:
                with open("/proc/self/status") as f:
                    line = next(line for line in f if line.startswith("VmHWM:"))
                self.bytes = int(line.split()[1]) * 1024
            except (OSError, StopIteration):
                self.bytes = None
        return False


def _significant(x: float, digits: int = 5) -> float:
    """x to `digits` significant digits (a ratio of 0.0156 keeps its precision, as one of 2.32 does)."""
    return float(f"{x:.{digits}g}")


@torch.no_grad()
def bench_peers(target, peers: list[Peer], prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int = 256,
                on_prompt: Callable[[int], None] | None = None) -> dict:
    """Every peer on every prompt, greedy, interleaved per prompt (the order rotates from prompt to prompt, so
    that no peer always runs first); outputs compared with the first peer's (plain `generate()`).

    Each peer runs once untimed on the first prompt before the timed runs (`warmup_s`: compilation, one-time
    calibrations). A transformers peer other than the first that raises (a combination the installed transformers
    refuses, or fails on: its DFlash with a static cache can overrun the cache) is left out from then on and its
    error kept in `refused`; hf_dscale's own peers never are. Returns {"peers": {name: tokens_per_s, seconds,
    new_tokens, identical, mismatches, tau, warmup_s, peak_memory_bytes, and for plain decoding `step_ms` (per
    token: one forward), for hf_dscale's `cycle_ms` (draft, verify and bookkeeping), each with its ratio to
    `weights_read_ms`}, "speedup": {a: {b: tokens/s of a over tokens/s of b}}, "refused": {name: error},
    "weights_read_ms": the time to read the target's weights once (`weights_read_seconds`), "per_prompt": [...]}.
    """
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    totals = {p.name: {"seconds": 0.0, "new_tokens": 0, "identical": True, "mismatches": [], "stats": DecodeStats(),
                       "peak": None, "warmup_s": 0.0} for p in peers}
    device = target.device
    refused = {}

    def run(peer: Peer, prompt: str, call: Callable):
        """call(), or None once a transformers peer has raised (it is then left out)."""
        if peer.dscale or peer is peers[0]:
            return call()
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - reported in the JSON, the peer left out
            refused[peer.name] = f"{type(error).__name__} on {prompt}: {error}"
            return None

    for peer in peers:
        warm = run(peer, prompts[0][0], lambda: _timed(lambda: target.generate(prompts[0][1], **kw, **peer.kwargs)))
        if warm is not None:
            totals[peer.name]["warmup_s"] = warm[1]
    read_s = weights_read_seconds(target)
    per_prompt = []
    for i, (name, ids) in enumerate(prompts):
        outputs, row = {}, {"id": name}
        peers = [p for p in peers if p.name not in refused]
        order = peers[i % len(peers):] + peers[: i % len(peers)]
        for peer in order:
            total, stats = totals[peer.name], DecodeStats()
            extra = {"dscale_stats": stats} if peer.dscale else {}
            with _PeakMemory(device) as peak:
                done = run(peer, name, lambda: _timed(lambda: target.generate(ids, **kw, **peer.kwargs, **extra)))
            if done is None:
                continue
            out, seconds = done
            outputs[peer.name] = out
            total["seconds"] += seconds
            total["new_tokens"] += out.shape[1] - ids.shape[1]
            total["stats"].merge(stats)
            if peak.bytes is not None:
                total["peak"] = max(total["peak"] or 0, peak.bytes)
            row[peer.name] = {"seconds": round(seconds, 6), "new_tokens": out.shape[1] - ids.shape[1]}
        peers = [p for p in peers if p.name not in refused]
        reference = outputs[peers[0].name]
        for peer in peers:
            same = torch.equal(outputs[peer.name], reference)
            row[peer.name]["identical"] = same
            if not same:
                totals[peer.name]["identical"] = False
                totals[peer.name]["mismatches"].append(name)
        per_prompt.append(row)
        if on_prompt is not None:
            on_prompt(i)
    for row in per_prompt:  # a peer left out is left out of every prompt's row
        for gone in set(row) & set(refused):
            del row[gone]
    report = {}
    for peer in peers:
        total = totals[peer.name]
        stats = total["stats"]
        per_token_ms = 1000 * total["seconds"] / max(1, total["new_tokens"])
        cycle_ms = 1000 * (stats.draft_s + stats.verify_s + stats.other_s) / max(1, stats.cycles)
        against = (_against_weights_read(read_s, step_ms=per_token_ms) if peer.autoregressive else
                   _against_weights_read(read_s, cycle_ms=cycle_ms) if peer.dscale else {})
        report[peer.name] = {
            "tokens_per_s": _significant(total["new_tokens"] / max(total["seconds"], 1e-9)),
            "seconds": round(total["seconds"], 6),
            "new_tokens": total["new_tokens"],
            "identical": total["identical"],
            "mismatches": total["mismatches"],
            "tau": round(total["stats"].tau, 4) if peer.dscale else None,
            "warmup_s": round(total["warmup_s"], 3),
            "compile_s": round(total["stats"].compile_total_s, 3) if peer.dscale else None,
            "state_bytes": total["stats"].state_bytes if peer.dscale else None,
            "peak_memory_bytes": total["peak"],
            **against,
            **({"plan": total["stats"].plan.to_dict()} if peer.dscale and total["stats"].plan is not None else {}),
        }
    speedup = {a: {b: _significant(report[a]["tokens_per_s"] / max(report[b]["tokens_per_s"], 1e-9)) for b in report}
               for a in report}
    return {"peers": report, "speedup": speedup, "refused": refused, "weights_read_ms": round(1000 * read_s, 3),
            "per_prompt": per_prompt}


def _batch(group: list[tuple[str, torch.Tensor]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (id, [1, P_i]) -> left-padded input ids and attention mask [B, max P_i] on their device."""
    from .training.data import left_pad

    device = group[0][1].device
    ids, mask = left_pad([ids[0].tolist() for _, ids in group], pad_token_id)
    return ids.to(device), mask.to(device)


def _new_tokens(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> int:
    """Tokens generated per row up to and including its EOS (the rest is padding), summed over rows."""
    total = 0
    for row in sequences[:, prompt_width:].tolist():
        end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        total += end
    return total


@torch.no_grad()
def bench_batched(target, drafter, prompts: list[tuple[str, torch.Tensor]], batch_size: int,
                  max_new_tokens: int = 256, method: str = "auto", pad_token_id: int = 0,
                  on_batch: Callable[[int], None] | None = None, vp_drafter=None, **method_kwargs) -> dict:
    """Throughput of a method on batches of `batch_size` left-padded prompts against the same method one prompt at a
    time and plain batched `generate()`, interleaved per batch, greedy; the batched output must equal plain
    `generate()`'s on the same batch. `method` and the keyword arguments as in `bench_speculative`."""
    method_kwargs = method_generate_kwargs(method, drafter, vp_drafter, **method_kwargs)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    groups = [prompts[i : i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]
    if not groups:
        raise ValueError(f"--batch-size {batch_size} needs at least {batch_size} prompts, got {len(prompts)}.")
    ways = ("plain_batched", "method_batched", "method_batch_1")
    seconds, tokens = dict.fromkeys(ways, 0.0), dict.fromkeys(ways, 0)
    identical, stats = True, DecodeStats()
    ids, mask = _batch(groups[0], pad_token_id)
    # warm-up at both batch sizes: a plan is measured (and a verify compiled) once per batch size, before any timing
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **method_kwargs)
    target.generate(groups[0][0][1], max_new_tokens=4, do_sample=False, **method_kwargs)
    for g, group in enumerate(groups):
        ids, mask = _batch(group, pad_token_id)
        plain, t = _timed(lambda: target.generate(input_ids=ids, attention_mask=mask, **kw))
        seconds["plain_batched"] += t
        tokens["plain_batched"] += _new_tokens(plain, ids.shape[1], eos)
        group_stats = DecodeStats()
        out, t = _timed(lambda: target.generate(input_ids=ids, attention_mask=mask, **kw, **method_kwargs,
                                                dscale_stats=group_stats))
        stats.merge(group_stats)
        seconds["method_batched"] += t
        tokens["method_batched"] += _new_tokens(out, ids.shape[1], eos)
        identical = identical and torch.equal(out, plain)
        for _, one in group:
            single, t = _timed(lambda: target.generate(one, **kw, **method_kwargs))
            seconds["method_batch_1"] += t
            tokens["method_batch_1"] += _new_tokens(single, one.shape[1], eos)
        if on_batch is not None:
            on_batch(g)
    rate = {way: _significant(tokens[way] / max(seconds[way], 1e-9)) for way in ways}
    return {"batch_size": batch_size, "n_prompts": batch_size * len(groups), "identical": identical,
            "tokens_per_s": rate, "new_tokens": tokens, "seconds": {w: round(s, 4) for w, s in seconds.items()},
            "batched_over_batch_1": _significant(rate["method_batched"] / max(rate["method_batch_1"], 1e-9)),
            "batched_over_plain_batched": _significant(rate["method_batched"] / max(rate["plain_batched"], 1e-9)),
            "tau": round(stats.tau, 4), "plan": None if stats.plan is None else stats.plan.to_dict()}


DLLM_METHODS = ("fast-dllm", "blockbatch")


def _dllm_summary(totals: dict, n: int) -> dict:
    """One method's means per answer from its totals over n problems."""
    return {"nfe": round(totals["nfe"] / n, 3), "nfe_full": round(totals["full"] / n, 3),
            "nfe_block": round(totals["block"] / n, 3), "accuracy": round(totals["correct"] / n, 4),
            "tokens_per_s": round(totals["tokens"] / max(totals["seconds"], 1e-9), 3),
            "seconds_per_answer": round(totals["seconds"] / n, 5),
            "ms_per_nfe": round(1000 * totals["seconds"] / max(1, totals["nfe"]), 3),
            "answer_tokens": round(totals["tokens"] / n, 2),
            "query_tokens_per_nfe": round(totals["queries"] / max(1, totals["nfe"]), 2),
            "ms_per_full_forward": round(1000 * totals["full_s"] / max(1, totals["full"]), 4),
            "ms_per_block_forward": round(1000 * totals["block_s"] / max(1, totals["block"]), 4),
            "host_seconds_per_answer": round(totals["host_s"] / n, 6)}


@torch.no_grad()
def bench_dllm(model, tokenizer, problems, method: str, gen_length: int, block_size: int = 32,
               block_sizes=None, threshold: float = 0.9, refresh_tokens: int | None | str = "plan",
               refresh_rows: str = "plan", sync_threshold: int | str = "plan", on_problem: Callable[[int], None] | None = None,
               host: str = "auto") -> dict:
    """Decode each problem with Fast-dLLM or BlockBatch (`block_sizes`, None: the paper's set; `refresh_tokens`,
    "plan": the paper's 32; `refresh_rows`, "plan": the paper's "all"; `sync_threshold`, "plan": the paper's 8), or
    with both
    (`method="both"`): NFE, accuracy (final number) and speed per method.

    "both" interleaves the two methods problem by problem (which goes first alternates), so that a change in the
    machine's speed during the run falls on both alike, and adds their ratios and the share of identical answers.
    Each method's model calls are timed as they run (`ms_per_full_forward`, `ms_per_block_forward`; the rest of an
    answer's time is `host_seconds_per_answer`), which gives the ratios `block_step` (what a BlockBatch block step,
    all its branches' windows in one forward, costs against a Fast-dLLM one) and `block_step_to_tie` (what it could
    cost, with everything else as measured, for BlockBatch's time per answer to equal Fast-dLLM's): BlockBatch is
    the faster where the first is below the second. On a GPU each call is synchronised before and after, so that its
    time is its own (both decoders read the device after every step anyway). `host`: who does the decoders'
    bookkeeping between model calls (`dllm.host.host_kernel`); the report says which did (`host`: "c" or
    "torch").
    """
    from .dllm.decode import blockbatch_generate, fast_dllm_generate
    from .dllm.host import host_kernel
    from .dllm.plan import TimedModel
    from .training.dllm_tasks import final_answer
    from .training.dllm_trainer import encode

    if method not in (*DLLM_METHODS, "both"):
        raise ValueError(f"method must be fast-dllm, blockbatch or both, got {method!r}.")
    methods = DLLM_METHODS if method == "both" else (method,)
    device = next(model.model.parameters()).device
    timed = {m: TimedModel(model, time.perf_counter, device) for m in methods}
    run = {"fast-dllm": lambda q: fast_dllm_generate(timed["fast-dllm"], q, gen_length, block_size, threshold,
                                                     host=host),
           "blockbatch": lambda q: blockbatch_generate(timed["blockbatch"], q, gen_length, block_sizes, threshold,
                                                       refresh_tokens=refresh_tokens, refresh_rows=refresh_rows,
                                                       sync_threshold=sync_threshold,
                                                       host=host)}
    used = "torch" if host_kernel(host, device) is None else "c"
    totals = {m: dict.fromkeys(("nfe", "full", "block", "correct", "tokens", "seconds", "queries"), 0)
              for m in methods}
    same = 0
    for i, problem in enumerate(problems):
        prompt = encode(tokenizer, [problem], gen_length, with_answers=False)[0].to(device)
        answers = {}
        for m in (methods if i % 2 == 0 else methods[::-1]):
            result, seconds = _timed(lambda: run[m](prompt))
            answers[m] = answer = result.sequence[prompt.shape[1] :]
            correct = final_answer(tokenizer.decode(answer, skip_special_tokens=True)) == problem.answer
            for key, value in (("seconds", seconds), ("correct", int(correct)), ("nfe", result.nfe),
                               ("full", result.nfe_full), ("block", result.nfe_block), ("tokens", answer.numel()),
                               ("queries", result.query_tokens)):
                totals[m][key] += value
        if method == "both":
            same += int(torch.equal(answers["fast-dllm"], answers["blockbatch"]))
        if on_problem is not None:
            on_problem(i)
    n = max(1, len(problems))
    for m in methods:
        totals[m]["full_s"], totals[m]["block_s"] = timed[m].seconds_of["full"], timed[m].seconds_of["block"]
        totals[m]["host_s"] = totals[m]["seconds"] - timed[m].seconds
    if method != "both":
        return {"method": method, "n_prompts": len(problems), "host": used, **_dllm_summary(totals[method], n)}
    ff, bb = totals["fast-dllm"], totals["blockbatch"]
    return {"method": "both", "n_prompts": len(problems), "host": used, "identical_answers": round(same / n, 4),
            **{m: _dllm_summary(totals[m], n) for m in methods},
            "blockbatch_vs_fast_dllm": {
                "nfe": round(bb["nfe"] / max(1, ff["nfe"]), 4),
                "seconds_per_answer": round(bb["seconds"] / max(ff["seconds"], 1e-9), 4),
                "accuracy_points": round(100 * (bb["correct"] - ff["correct"]) / n, 2),
                **_block_steps(ff, bb)}}


def _block_steps(ff: dict, bb: dict) -> dict:
    """`bench_dllm`'s `block_step` and `block_step_to_tie` from Fast-dLLM's (ff) and BlockBatch's (bb) totals: a
    BlockBatch block step against a Fast-dLLM one, as measured, and the most it could cost for BlockBatch's time to
    equal Fast-dLLM's (its full forwards and host time as measured). None where a method ran no block step."""
    if not ff["block"] or not bb["block"] or ff["block_s"] <= 0:
        return {"block_step": None, "block_step_to_tie": None}
    single = ff["block_s"] / ff["block"]
    tie = (ff["seconds"] - bb["full_s"] - bb["host_s"]) / bb["block"]
    return {"block_step": round(bb["block_s"] / bb["block"] / single, 4), "block_step_to_tie": round(tie / single, 4)}
