"""LLaDA and Dream checkpoints laid out as published load without remote code and decode with both methods.

The fixtures write tiny random checkpoints with the published config keys and weight names (LLaDA's OLMo-style
config and `model.transformer.*` weights; Dream's Qwen2 config and names, q/k/v biases), straight from tensors,
not through hf_dscale's classes. A reference forward and a reference one-token-per-step decode, written here from
the papers' description, check the classes' forward and the decoders' commits.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModel, AutoModelForCausalLM

from hf_dscale.generation import dllm_generate, fast_dllm_generate
from hf_dscale.models import DreamModel, LLaDAModelLM
from hf_dscale.models.dllm import DiffusionModel

from ..generation.test_dllm import ragged_block_equals_rows_alone
from ..hub_cache import add_to_hub_cache

VOCAB, ROWS, MASK = 60, 64, 59  # LLaDA's embedding has padding rows past the vocabulary, as published
D, LAYERS, HEADS, KV, MLP = 32, 2, 4, 2, 48


def _random(shape, generator):
    return torch.randn(*shape, generator=generator) * 0.3


def write_llada(folder, weight_tying=False, **config_changes):
    g = torch.Generator().manual_seed(0)
    head = D // HEADS
    weights = {"model.transformer.wte.weight": _random((ROWS, D), g),
               "model.transformer.ln_f.weight": 1 + _random((D,), g)}
    if not weight_tying:
        weights["model.transformer.ff_out.weight"] = _random((ROWS, D), g)
    for i in range(LAYERS):
        p = f"model.transformer.blocks.{i}."
        weights |= {p + "attn_norm.weight": 1 + _random((D,), g), p + "ff_norm.weight": 1 + _random((D,), g),
                    p + "q_proj.weight": _random((D, D), g), p + "k_proj.weight": _random((KV * head, D), g),
                    p + "v_proj.weight": _random((KV * head, D), g), p + "attn_out.weight": _random((D, D), g),
                    p + "ff_proj.weight": _random((MLP, D), g), p + "up_proj.weight": _random((MLP, D), g),
                    p + "ff_out.weight": _random((D, MLP), g)}
    config = {"model_type": "llada", "architectures": ["LLaDAModelLM"],
              "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                           "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                           "AutoModel": "modeling_llada.LLaDAModelLM"},
              "d_model": D, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV, "mlp_hidden_size": MLP,
              "mlp_ratio": 4, "activation_type": "silu", "block_type": "llama", "layer_norm_type": "rms",
              "rms_norm_eps": 1e-5, "layer_norm_with_affine": True, "bias_for_layer_norm": False,
              "include_bias": False, "include_qkv_bias": False, "rope": True, "rope_theta": 500000.0,
              "rope_full_precision": True, "alibi": False, "alibi_bias_max": 8.0, "vocab_size": VOCAB,
              "embedding_size": ROWS, "weight_tying": weight_tying, "scale_logits": False, "input_emb_norm": False,
              "attention_layer_norm": False, "max_sequence_length": 256, "block_group_size": 1,
              "flash_attention": False, "eos_token_id": None, "pad_token_id": 0, "mask_token_id": MASK,
              "precision": "amp_bf16", "use_cache": False, "transformers_version": "4.46.3", **config_changes}
    _save(folder, config, weights)
    return weights


def write_dream(folder, **config_changes):
    g = torch.Generator().manual_seed(1)
    head = D // HEADS
    weights = {"model.embed_tokens.weight": _random((VOCAB, D), g), "model.norm.weight": 1 + _random((D,), g),
               "lm_head.weight": _random((VOCAB, D), g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": 1 + _random((D,), g),
                    p + "post_attention_layernorm.weight": 1 + _random((D,), g),
                    p + "self_attn.q_proj.weight": _random((D, D), g), p + "self_attn.q_proj.bias": _random((D,), g),
                    p + "self_attn.k_proj.weight": _random((KV * head, D), g),
                    p + "self_attn.k_proj.bias": _random((KV * head,), g),
                    p + "self_attn.v_proj.weight": _random((KV * head, D), g),
                    p + "self_attn.v_proj.bias": _random((KV * head,), g),
                    p + "self_attn.o_proj.weight": _random((D, D), g),
                    p + "mlp.gate_proj.weight": _random((MLP, D), g), p + "mlp.up_proj.weight": _random((MLP, D), g),
                    p + "mlp.down_proj.weight": _random((D, MLP), g)}
    config = {"model_type": "Dream", "architectures": ["DreamModel"],
              "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
              "vocab_size": VOCAB, "hidden_size": D, "intermediate_size": MLP, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "hidden_act": "silu",
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
              "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
              "max_window_layers": LAYERS, "attention_dropout": 0.0, "mask_token_id": MASK, "eos_token_id": None,
              "pad_token_id": 0, "bos_token_id": None, "torch_dtype": "float32", "transformers_version": "4.46.2",
              **config_changes}
    _save(folder, config, weights)
    return weights


def _save(folder, config, weights):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------- reference forward
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, theta):
    """Split-half RoPE at positions 0..T-1; x [T, heads, d]."""
    t, _, d = x.shape
    angles = torch.arange(t)[:, None] * theta ** (-torch.arange(0, d, 2) / d)
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * sin


def _layer(x, norm1, q, k, v, o, norm2, gate, up, down, eps, theta, biases=(None, None, None)):
    t = x.shape[0]
    h = _rms(x, norm1, eps)
    qh, kh, vh = (F.linear(h, w, b).view(t, -1, D // HEADS) for w, b in zip((q, k, v), biases))
    qh, kh = _rotate(qh, theta), _rotate(kh, theta)
    kh, vh = kh.repeat_interleave(HEADS // KV, 1), vh.repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", qh, kh) / math.sqrt(D // HEADS)  # every query sees every key
    x = x + torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh).reshape(t, D) @ o.T
    h = _rms(x, norm2, eps)
    return x + (F.silu(h @ gate.T) * (h @ up.T)) @ down.T


def llada_reference(w, ids, weight_tying=False):
    x = w["model.transformer.wte.weight"][ids]
    for i in range(LAYERS):
        p = f"model.transformer.blocks.{i}."
        x = _layer(x, *(w[p + n + ".weight"] for n in ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out",
                                                        "ff_norm", "ff_proj", "up_proj", "ff_out")), 1e-5, 500000.0)
    head = w["model.transformer.wte.weight" if weight_tying else "model.transformer.ff_out.weight"]
    return _rms(x, w["model.transformer.ln_f.weight"], 1e-5) @ head.T


def dream_reference(w, ids):
    x = w["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        names = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        biases = tuple(w[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
        x = _layer(x, *(w[p + n + ".weight"] for n in names), 1e-6, 1000000.0, biases)
    return _rms(x, w["model.norm.weight"], 1e-6) @ w["lm_head.weight"].T


FAMILIES = {"llada": (write_llada, llada_reference, LLaDAModelLM, 0),
            "dream": (write_dream, dream_reference, DreamModel, 1)}


@pytest.fixture(params=sorted(FAMILIES))
def family(request, tmp_path):
    write, reference, cls, shift = FAMILIES[request.param]
    weights = write(tmp_path / request.param)
    return SimpleNamespace(name=request.param, folder=tmp_path / request.param, weights=weights, reference=reference,
                           cls=cls, shift=shift)


def test_published_layout_loads_without_remote_code_and_computes_the_reference(family):
    for auto in (AutoModel, AutoModelForCausalLM):
        model, info = auto.from_pretrained(family.folder, output_loading_info=True)  # no trust_remote_code
        assert type(model) is family.cls
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[0], family.reference(family.weights, ids[0]), rtol=1e-4,
                                   atol=1e-4)


def test_llada_weight_tying_reads_no_head(tmp_path):
    weights = write_llada(tmp_path, weight_tying=True)
    model, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.arange(9)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[0], llada_reference(weights, ids[0], weight_tying=True),
                                   rtol=1e-4, atol=1e-4)


def _reference_decode(logits_of, prompt: list[int], gen_length: int, block: int, shift: int) -> tuple[list[int], int]:
    """One token per step, as LLaDA's generate.py with steps = gen_length: every step a full forward, and the most
    confident masked position of the current block takes its most likely token (never the mask itself)."""
    x, forwards = prompt + [MASK] * gen_length, 0
    for start in range(len(prompt), len(x), block):
        while MASK in x[start : start + block]:
            logits = logits_of(torch.tensor(x)).double()
            forwards += 1
            if shift:  # Dream: the logit at p - 1 predicts p
                logits = torch.cat((logits[:1], logits[:-1]))
            logits[:, MASK] = -math.inf
            conf, tokens = logits.softmax(-1).max(-1)
            masked = [p for p in range(start, start + block) if x[p] == MASK]
            best = max(masked, key=lambda p: float(conf[p]))
            x[best] = int(tokens[best])
    return x, forwards


def test_one_token_per_step_equals_the_reference_decode(family):
    model = AutoModel.from_pretrained(family.folder).eval()
    prompt = [5, 9, 14, 3, 7]
    expected, forwards = _reference_decode(lambda x: family.reference(family.weights, x), prompt, 16, 8, family.shift)
    result = fast_dllm_generate(DiffusionModel(model, dual_cache=False), torch.tensor([prompt]), gen_length=16,
                                block_size=8, threshold=1.01, commit_first=False)
    assert result.sequence.tolist() == expected
    assert result.nfe == forwards == 16


def test_ragged_block_call_equals_each_row_alone(family):
    ragged_block_equals_rows_alone(DiffusionModel(AutoModel.from_pretrained(family.folder).eval()), VOCAB)


@pytest.mark.parametrize("method", ["fast-dllm", "blockbatch"])
def test_both_methods_through_generate(family, method):
    model = AutoModel.from_pretrained(family.folder).eval()
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    stats = []
    out = model.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=dllm_generate, dllm_method=method,
                         block_size=8, block_sizes=(4, 8, 16), dllm_stats=stats)
    assert out.shape == (1, 5 + 16) and torch.equal(out[:, :5], ids)
    assert MASK not in out[0].tolist()
    assert 1 <= stats[0].nfe <= 16
    direct = fast_dllm_generate(DiffusionModel(model), ids, 16, 8) if method == "fast-dllm" else None
    if direct is not None:  # generate() runs the same decoder, with the dual cache
        assert out[0].tolist() == direct.sequence.tolist() and stats[0].nfe == direct.nfe


def test_hub_id_from_an_offline_cache_in_a_fresh_process(family, tmp_path):
    add_to_hub_cache(tmp_path / "hub", f"some-org/{family.name}-tiny", family.folder)
    code = (f"import hf_dscale, torch\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained('some-org/{family.name}-tiny')\n"
            f"print(type(m).__name__, m(torch.tensor([[1, 2, 3]])).logits.shape[-1])")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "PATH": ""}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [family.cls.__name__, str(ROWS if family.name == "llada" else VOCAB)]


@pytest.mark.parametrize("write, change, key", [
    (write_llada, {"block_type": "sequential"}, "block_type"),
    (write_llada, {"input_emb_norm": True}, "input_emb_norm"),
    (write_llada, {"alibi": True, "rope": False}, "alibi"),
    (write_dream, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
])
def test_options_not_computed_are_refused_by_name(tmp_path, write, change, key):
    write(tmp_path, **change)
    with pytest.raises(ValueError, match=key):
        AutoModel.from_pretrained(tmp_path)


def test_diffusion_gemma_is_refused_with_the_reason():
    model = type("DiffusionGemmaForBlockDiffusion", (), {"config": SimpleNamespace(model_type="diffusion_gemma")})()
    with pytest.raises(ValueError, match="no mask token"):
        DiffusionModel(model)
