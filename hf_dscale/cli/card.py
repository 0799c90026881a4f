"""`hf-dscale card`: write a drafter folder's README.md (Hub model card) from bench reports."""

from __future__ import annotations

import json
import os


def add_parser(sub) -> None:
    p = sub.add_parser("card", help="write the model card of a drafter (or diffusion LM) folder from bench reports")
    p.add_argument("--drafter", required=True, help="the folder (a drafter, or a DiffusionLM with bench-dllm reports)")
    p.add_argument("--name", default=None, help="repo name (default: the folder name)")
    p.add_argument("--target-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--bench", nargs="*", default=[], metavar="LABEL=REPORT.json")
    p.add_argument("--training", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--notes", default="", help="a markdown file appended to the card")
    p.set_defaults(func=main)


def main(args) -> int:
    from ..hub import render_card, render_dllm_card
    from ..models import DiffusionLMConfig, DScaleConfig

    with open(os.path.join(args.drafter, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    dllm = model_type == DiffusionLMConfig.model_type
    config = (DiffusionLMConfig if dllm else DScaleConfig).from_pretrained(args.drafter)
    benches = []
    for item in args.bench:
        label, path = _pair(item, "--bench", "LABEL=REPORT.json")
        with open(path) as f:
            report = json.load(f)
        report["prompts_name"] = os.path.basename(report.get("prompts", ""))
        benches.append({"label": label, "command": report.get("command", ""), "report": report})
    training = dict(_pair(item, "--training", "KEY=VALUE") for item in args.training)
    notes = ""
    if args.notes:
        with open(args.notes) as f:
            notes = f.read()
    name = args.name or os.path.basename(os.path.abspath(args.drafter))
    if dllm:
        card = render_dllm_card(name, config, training, benches, notes)
    else:
        card = render_card(name, config, args.target_name, args.base_model, training, benches, notes)
    with open(os.path.join(args.drafter, "README.md"), "w") as f:
        f.write(card)
    print(f"wrote {os.path.join(args.drafter, 'README.md')}")
    return 0


def _pair(item: str, flag: str, form: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"{flag} takes {form}, got {item!r}.")
    return key, value
