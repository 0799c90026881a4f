"""A saved drafter loads with trust_remote_code in a process that never imports hf_dscale."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from ..conftest import tiny_drafter, tiny_target

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModel, AutoModelForCausalLM
    drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
    target = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
    assert "hf_dscale" not in sys.modules, "hf_dscale was imported"
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    for seed in range(3):
        torch.manual_seed(seed)
        ids = torch.randint(3, 90, (1, 5 + 4 * seed))
        plain = target.generate(ids, max_new_tokens=25, do_sample=False)
        spec = target.generate(ids, assistant_model=drafter, max_new_tokens=25, do_sample=False)
        assert torch.equal(plain, spec), (plain, spec)
    sampled = target.generate(ids, assistant_model=drafter, max_new_tokens=10, do_sample=True)
    assert sampled.shape[1] == ids.shape[1] + 10
    print("REMOTE-OK", type(drafter).__name__)
    """
)


def test_trust_remote_code_in_a_fresh_process(tmp_path):
    target = tiny_target("qwen3")
    tiny_drafter(target).save_pretrained(tmp_path / "drafter")
    target.save_pretrained(tmp_path / "target")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = ""  # hf_dscale must not be importable from the source tree either
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "drafter"), str(tmp_path / "target")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REMOTE-OK DScaleDrafter" in result.stdout


DLLM_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert "hf_dscale" not in sys.modules, "hf_dscale was imported"
    ids, expected = torch.load(sys.argv[2])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)
    print("REMOTE-OK", type(model).__name__)
    """
)


def test_diffusion_lm_loads_with_trust_remote_code(tmp_path):
    import torch

    from ..generation.test_dllm import tiny_dlm

    model = tiny_dlm(shift=1)
    model.save_pretrained(tmp_path / "dlm")
    ids = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        torch.save((ids, model(ids).logits), tmp_path / "expected.pt")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    result = subprocess.run([sys.executable, "-c", DLLM_SCRIPT, str(tmp_path / "dlm"), str(tmp_path / "expected.pt")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REMOTE-OK DiffusionLM" in result.stdout
