"""Helpers shared by the subcommands: loading, reports, training progress."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

DEFAULT_DRAFTER = os.path.join(os.path.dirname(__file__), "..", "..", "model_cards", "SmolLM2-135M-Instruct-DScale")


def pick_device(name: str) -> str:
    """auto = the GPU of this process (cuda:LOCAL_RANK under `accelerate launch`), else the CPU."""
    if name == "auto":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    return name


def pick_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def bf16_slowdown(device: str, size: int = 256, repeats: int = 3) -> float:
    """How many times longer a bfloat16 matrix product takes than a float32 one on `device` (1.0 off the CPU).

    A CPU without native bfloat16 (no AVX512-BF16 or AMX) emulates it: on an AVX2-only machine here a
    2048 x 2048 product ran at 0.27 GFLOPS in bfloat16 against 100 in float32, which turns a one-hour
    data generation or training run into days. About 0.1 s on such a CPU, a few ms on one with native bf16.
    """
    if not device.startswith("cpu"):
        return 1.0
    a = torch.randn(size, size)

    def seconds(dtype) -> float:
        x = a.to(dtype)
        x @ x  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x @ x
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    return seconds(torch.bfloat16) / seconds(torch.float32)


def warn_if_slow_bf16(device: str, *uses: str, limit: float = 8.0) -> None:
    """Print a warning when bfloat16, asked for by `uses` (the flags that ask, e.g. "--dtype bfloat16"), runs
    more than `limit` times slower than float32 on this CPU."""
    if not uses:
        return
    slowdown = bf16_slowdown(device)
    if slowdown > limit:
        print(f"warning: {' and '.join(uses)}: this CPU has no native bfloat16, whose matrix products run "
              f"{slowdown:.0f}x slower than float32 here; unless you need bfloat16, use float32, the CPU's default "
              f"(auto).", file=sys.stderr)


def add_model_args(p, drafter_default=None) -> None:
    p.add_argument("--target", default="smollm2",
                   help='target folder or hub id; "smollm2" = the offline SmolLM2-135M-Instruct GGUF')
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --target")
    p.add_argument("--drafter", default=drafter_default, required=drafter_default is None,
                   help="drafter folder (DScale, DFlash or DFlare layout)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CUDA, float32 on CPU")


def add_cut_arg(p, tree: bool = False) -> None:
    """--draft-confidence: how much of each block to verify ("auto" or a number)."""
    tree_note = ("; dscale-tree: auto = the tree of the likeliest nodes with the most tokens expected per second, "
                 "a number = every path's depth; d2sd: the tree's depth, auto = 0.1") if tree else ""
    p.add_argument("--draft-confidence", type=parse_cut, default=None,
                   help="how much of each block to verify: auto = the head with the most tokens expected per second "
                        "of verify (measured once for the target), a number in (0, 1) = the head whose cumulative "
                        f"drafter confidence is at least it, 0 = the whole block{tree_note} (default auto on a CPU, "
                        "where wide verifies cost more; 0 on a GPU)")


def parse_cut(value: str) -> float | str:
    """A --draft-confidence value: "auto" (any case) or a number."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number in [0, 1), got {value!r}") from None


def describe_plan(plan) -> str:
    """The engine's plan (`hf_dscale.engine.Plan`) in words, for the CLI's summary lines."""
    method = "a token tree" + (" with a prompt-lookup path" if plan.prompt_lookup else "") if plan.tree else "a chain"
    if plan.draft_confidence == "auto":
        cut = "sized for the most tokens expected per second of measured verify costs"
    elif plan.draft_confidence > 0:
        cut = f"draft_confidence {plan.draft_confidence}, at least {plan.min_drafts} drafts"
    else:
        cut = "whole blocks"
    from ..engine.plan import width_span

    verify = ""
    if plan.compile_widths is not None:
        verify = ", verified compiled"
    else:
        parts = [f"{what} at {width_span(widths)} tokens" for what, widths in (
            ("the target's weights run directly", plan.direct_widths),
            ("products by hf_dscale's CPU kernel", plan.cpu_linear_widths)) if widths]
        verify = f", verify: {'; '.join(parts)}" if parts else ""
    return f"{method}, {cut}{verify}"


def load_models(args):
    from ..models.targets import load_target

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    warn_if_slow_bf16(device, *([f"--dtype {args.dtype}"] if dtype == torch.bfloat16 else []))
    target, tokenizer = load_target(args.target, args.gguf_file, dtype=dtype, device=device)
    return target, tokenizer, load_drafter(args.drafter, target)


def load_drafter(path: str, target):
    """A drafter folder, in the target's dtype and device, bound to the target (clear errors on mismatch)."""
    from ..models import DScaleDrafter

    path = os.path.abspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"No drafter at {path} (a folder with config.json and model.safetensors).")
    drafter = DScaleDrafter.from_pretrained(path, dtype=target.dtype).to(target.device).eval()
    return drafter.bind_target(target)


def describe_machine(device) -> dict:
    """What a report's numbers were measured on: a speedup depends on the CPU's vector units or the GPU, and on
    the versions."""
    import platform

    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    machine = dict(cpu=cpu, cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_count=os.cpu_count(),
                   torch_threads=torch.get_num_threads(), torch=torch.__version__,
                   transformers=transformers.__version__)
    if str(device).startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return machine


def emit_report(report: dict, json_path: str | None) -> None:
    """Print a JSON report and, with --json, write it to that file too (first, so a closed pipe loses nothing)."""
    text = json.dumps(report, indent=2)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
    print(text)


def training_progress(bar, out_dir: str):
    """An on_step callback: the progress bar shows loss/accuracy and every step's metrics go to log.jsonl."""

    def on_step(step: int, metrics: dict) -> None:
        bar.n = step
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.3f}")
        bar.refresh()
        with open(os.path.join(out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    return on_step
