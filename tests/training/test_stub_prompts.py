"""examples/make_stub_prompts.py: word problems posed as Python stubs, interleaved with plain questions."""

import ast
import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "make_stub_prompts.py"


def _write(path, prompts, prefix):
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))


def _stubs(tmp_path, *extra, name="stubs.jsonl"):
    out = tmp_path / name
    subprocess.run([sys.executable, str(SCRIPT), "--data", str(tmp_path), "--out", str(out), *extra], check=True,
                   capture_output=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_stub_plain_stub_plain_from_the_unused_questions(tmp_path):
    _write(tmp_path / "train_gsm8k_prompts.jsonl", [f"How many apples are in basket {i}?" for i in range(10)], "g")
    _write(tmp_path / "train_math_prompts.jsonl", [f"Find $x$ if $x + {i} = 7$." for i in range(5)], "m")
    rows = _stubs(tmp_path, "--plain-from", "4", "--plain-skip", "6:8")
    ids = [row["id"] for row in rows]
    # plain questions are rows 4, 5, 8, 9 (6 and 7 skipped); stubs pose rows 0, 1 of each file
    assert ids == ["stub-g0", "g4", "stub-m0", "g5", "stub-g1", "g8", "stub-m1", "g9"]
    assert rows[1]["prompt"] == "How many apples are in basket 4?"
    assert _stubs(tmp_path, "--plain-from", "4", "--plain-skip", "6:8", name="again.jsonl") == rows


def test_a_stub_is_a_function_whose_docstring_is_the_question(tmp_path):
    question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 3
    _write(tmp_path / "train_gsm8k_prompts.jsonl", [question] * 6, "g")
    _write(tmp_path / "train_math_prompts.jsonl", ["Find $a+b$."] * 2, "m")
    rows = _stubs(tmp_path, "--plain-from", "2", "--plain-skip", "0:0")
    assert len(rows) == 8
    for row, asked in zip(rows[0::2], [question, "Find $a+b$."] * 2):
        function = ast.parse(row["prompt"] + "    ...\n").body[0]
        assert isinstance(function, ast.FunctionDef)
        docstring = " ".join(ast.get_docstring(function).split()).removesuffix(" >>> answer()")
        assert docstring == " ".join(asked.split())
        assert max(len(line) for line in row["prompt"].splitlines()) <= 96
    assert {row["prompt"].splitlines()[0] for row in rows[0::2]} >= {"def solve() -> int:", "def answer() -> float:"}


def test_stubs_after_appends_stubs_alone_once_the_plain_questions_run_out(tmp_path):
    _write(tmp_path / "train_gsm8k_prompts.jsonl", [f"How many apples are in basket {i}?" for i in range(8)], "g")
    _write(tmp_path / "train_math_prompts.jsonl", [f"Find $x$ if $x + {i} = 7$." for i in range(5)], "m")
    interleaved = _stubs(tmp_path, "--plain-from", "4", "--plain-skip", "0:0")
    rows = _stubs(tmp_path, "--plain-from", "4", "--plain-skip", "0:0", "--stubs-after", "3", name="more.jsonl")
    # the interleave is unchanged (stubs of rows 0, 1); then stubs alone from row 3, not repeating 0-2
    assert rows[: len(interleaved)] == interleaved
    assert [row["id"] for row in rows[len(interleaved):]] == ["stub-g3", "stub-m3", "stub-g4", "stub-m4"]
    # a start inside the interleave still begins after it, so no stub is posed twice
    again = _stubs(tmp_path, "--plain-from", "4", "--plain-skip", "0:0", "--stubs-after", "0", name="again.jsonl")
    assert [row["id"] for row in again[len(interleaved):]][:2] == ["stub-g2", "stub-m2"]
