"""examples/make_prompt_mix.py: the training prompt mix is a fixed interleave, so a data folder can be rebuilt."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "make_prompt_mix.py"


def _write(path, prompts, prefix):
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))


def _mix(tmp_path, name="mix.jsonl"):
    out = tmp_path / name
    subprocess.run([sys.executable, str(SCRIPT), "--data", str(tmp_path), "--out", str(out)], check=True,
                   capture_output=True)
    return [json.loads(line)["id"] for line in out.read_text().splitlines()]


def test_two_questions_then_one_code_turn_then_the_rest(tmp_path):
    _write(tmp_path / "train_gsm8k_prompts.jsonl", [f"question {i}" for i in range(7)], "g")
    _write(tmp_path / "train_sharegpt_prompts.jsonl",
           ["Write a Python function that sorts", "Is iconic the same as prestigious?", "Fix this SQL query",
            "a poem about the sea", "Why does my code not compile?"], "s")
    ids = _mix(tmp_path)
    assert ids == ["g0", "g1", "s0", "g2", "g3", "s2", "g4", "g5", "s4", "g6"]
    assert _mix(tmp_path, "again.jsonl") == ids  # deterministic


def test_stops_interleaving_when_the_questions_run_out(tmp_path):
    _write(tmp_path / "train_gsm8k_prompts.jsonl", ["q0", "q1", "q2"], "g")
    _write(tmp_path / "train_sharegpt_prompts.jsonl", [f"code {i}" for i in range(5)], "s")
    assert _mix(tmp_path) == ["g0", "g1", "s0", "g2"]
