"""`hf-dscale bench-kernels`: the Triton tree attention against SDPA with a dense mask (needs CUDA)."""

from __future__ import annotations

from .common import emit_report


def add_parser(sub) -> None:
    p = sub.add_parser("bench-kernels", help="time the Triton tree attention against dense-mask SDPA (CUDA)")
    p.add_argument("--prefix-lengths", default="512,2048,8192,32768")
    p.add_argument("--tree-sizes", default="16,48,80")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)


def main(args) -> int:
    import torch

    from .kernel_bench import benchmark_tree_attention

    rows = benchmark_tree_attention([int(x) for x in args.prefix_lengths.split(",")],
                                    [int(x) for x in args.tree_sizes.split(",")], dtype=getattr(torch, args.dtype))
    report = {"command": args.command_line, "device": torch.cuda.get_device_name(), "rows": rows}
    emit_report(report, args.json)
    return 0
