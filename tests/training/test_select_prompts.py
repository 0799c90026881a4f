"""examples/select_prompts.py: a pattern picks training prompts, in order; eval files are refused."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "select_prompts.py"


def _run(source, out, pattern="python|def "):
    return subprocess.run([sys.executable, str(SCRIPT), str(source), "--pattern", pattern, "--out", str(out)],
                          capture_output=True, text=True)


def test_keeps_matching_prompts_in_order(tmp_path):
    source = tmp_path / "train_sharegpt_prompts.jsonl"
    prompts = ["Write it in PYTHON please", "a poem about the sea", "def f(x): why is this slow?", "undefined"]
    source.write_text("".join(json.dumps({"id": f"s{i}", "prompt": p, "extra": 1}) + "\n" for i, p in enumerate(prompts)))
    result = _run(source, tmp_path / "out.jsonl")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows == [{"id": "s0", "prompt": prompts[0]}, {"id": "s2", "prompt": prompts[2]}]


def test_refuses_an_eval_file(tmp_path):
    source = tmp_path / "eval_humaneval.jsonl"
    source.write_text(json.dumps({"id": "h0", "prompt": "def f():"}) + "\n")
    result = _run(source, tmp_path / "out.jsonl")
    assert result.returncode != 0 and "train_*" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()
