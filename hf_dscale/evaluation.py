"""Side-by-side measurement of plain greedy `generate()` and speculative decoding (no I/O, no printing)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .generation import DecodeStats, custom_generate

BENCH_METHODS = ("dscale", "dscale-tree", "d2sd")


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

    def to_json(self) -> dict:
        cycles = max(1, self.stats.cycles)
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
            "acceptance_histogram": {str(k): v for k, v in sorted(histogram.items())},
            "per_prompt": self.per_prompt,
            **({"verify_tokens": verify_tokens} if verify_tokens else {}),
            **({"tree_tokens": verify_tokens} if verify_tokens and self.method != "dscale" else {}),
        }


def _timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


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

    method "dscale" decodes with `drafter` alone, verifying its block as a chain; "dscale-tree" verifies the
    block plus the drafter's own runner-up alternatives as a token tree; "d2sd" adds `vp_drafter` (extra keyword
    arguments such as `num_branches` go to `custom_generate`).
    """
    if method not in BENCH_METHODS:
        raise ValueError(f"method must be one of {BENCH_METHODS}, got {method!r}.")
    if (method == "d2sd") != (vp_drafter is not None):
        raise ValueError("method 'd2sd' needs a VP drafter (--vp-drafter); 'dscale' and 'dscale-tree' take none.")
    result = BenchResult(method=method)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    spec_kw = dict(custom_generate=custom_generate, drafter=drafter, **method_kwargs)
    if vp_drafter is not None:
        spec_kw["vp_drafter"] = vp_drafter
    if method == "dscale-tree":
        spec_kw["draft_tree"] = True
    warm = prompts[0][1]
    target.generate(warm, max_new_tokens=4, do_sample=False)
    target.generate(warm, max_new_tokens=4, do_sample=False, **spec_kw)
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


@torch.no_grad()
def bench_dllm(model, tokenizer, problems, method: str, gen_length: int, block_size: int = 32,
               block_sizes=None, threshold: float = 0.9,
               on_problem: Callable[[int], None] | None = None) -> dict:
    """Decode each problem with Fast-dLLM or BlockBatch; NFE, accuracy (final number) and speed."""
    from .generation.dllm import BLOCK_SIZES, blockbatch_generate, fast_dllm_generate
    from .training.dllm_tasks import final_answer
    from .training.dllm_trainer import encode

    block_sizes = BLOCK_SIZES if block_sizes is None else block_sizes
    device = next(model.model.parameters()).device
    nfe, correct, tokens, seconds, queries = [], 0, 0, 0.0, 0
    full = block = 0
    for i, problem in enumerate(problems):
        prompt, _ = encode(tokenizer, [problem], gen_length, with_answers=False)
        prompt = prompt.to(device)
        if method == "fast-dllm":
            run = lambda: fast_dllm_generate(model, prompt, gen_length, block_size, threshold)  # noqa: E731
        elif method == "blockbatch":
            run = lambda: blockbatch_generate(model, prompt, gen_length, block_sizes, threshold)  # noqa: E731
        else:
            raise ValueError(f"method must be fast-dllm or blockbatch, got {method!r}.")
        result, wall = _timed(run)
        answer = result.sequence[prompt.shape[1] :]
        text = tokenizer.decode(answer, skip_special_tokens=True)
        correct += int(final_answer(text) == problem.answer)
        nfe.append(result.nfe)
        queries += result.query_tokens
        full, block = full + result.nfe_full, block + result.nfe_block
        tokens += answer.numel()
        seconds += wall
        if on_problem is not None:
            on_problem(i)
    n = max(1, len(problems))
    return {
        "method": method,
        "n_prompts": len(problems),
        "nfe": round(sum(nfe) / n, 3),
        "nfe_full": round(full / n, 3),
        "nfe_block": round(block / n, 3),
        "accuracy": round(correct / n, 4),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 3),
        "seconds_per_answer": round(seconds / n, 4),
        "ms_per_nfe": round(1000 * seconds / max(1, sum(nfe)), 3),
        "answer_tokens": round(tokens / n, 2),
        "query_tokens_per_nfe": round(queries / max(1, sum(nfe)), 2),
    }
