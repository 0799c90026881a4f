"""`hf-dscale sweep`: every causal-LM class of the installed transformers, built tiny, decoded through the engine and
`assistant_model=` against plain `generate()` (`hf_dscale.sweep`); writes the README's table and a JSON report."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="decode every causal-LM class transformers registers, tiny and random")
    p.add_argument("--readme", default=None, help="write the table into this file between its "
                   "<!-- targets:start --> and <!-- targets:end --> markers (README.md)")
    p.add_argument("--json", default=None, help="write every verdict here")
    p.add_argument("--only", nargs="*", default=None, help="model types to check (default: all)")
    p.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a class may take before it is a hang")
    p.set_defaults(func=main)


def main(args) -> int:
    import transformers

    from ..sweep import readme_section, replace_section, summary, sweep

    def progress(verdict):
        worst = next(iter(verdict.failures.values()), None)
        print(f"{verdict.model_type:28s} {verdict.seconds:5.1f} s  "
              + (verdict.built if verdict.built != "ok" else worst or "ok"), file=sys.stderr, flush=True)

    verdicts = sweep(args.only, workers=args.workers, timeout_s=args.timeout, progress=progress)
    counts = summary(verdicts)
    print(json.dumps(counts))
    if args.readme:
        with open(args.readme) as f:
            text = replace_section(f.read(), readme_section(verdicts, transformers.__version__))
        with open(args.readme, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "summary": counts,
                       "verdicts": [asdict(v) for v in verdicts]}, f, indent=1)
    return 1 if any(v.failures for v in verdicts if v.built == "ok" and
                    any(w.startswith("engine") for w in v.failures)) else 0
