"""Shared fixtures: tiny random targets (Llama, Qwen3, and the sliding-window families) and drafters.

`OracleDrafter` is a real `DScaleDrafter` (its forward and caches run every step) whose proposals are
replaced by a known continuation with injected errors, so the decode loops see long accepted runs,
rejections at every depth, EOS inside a block and rows that advance at different speeds.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on the CPU (set before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_dscale import DScaleConfig, DScaleDrafter
from hf_dscale.sweep import OracleDrafter, oracle_from, restrict  # noqa: F401 (the tests' oracle, shipped with the sweep)
from hf_dscale.engine import target_forward
from hf_dscale.models.dscale import assistant

torch.set_num_threads(min(2, os.cpu_count() or 1))

VOCAB = 96
MASK_ID = VOCAB - 1


REAL_MIN_DRAFTS_FOR = assistant.min_drafts_for


@pytest.fixture(autouse=True)
def fixed_min_drafts(monkeypatch):
    """A confidence cut keeps at least 4 drafts in every test: measured on a tiny model, whose forwards all cost
    about the same, the minimum would be the whole block and vary with the machine's noise.
    tests/generation/test_min_drafts.py measures it (fake clock and real)."""
    monkeypatch.setattr(assistant, "min_drafts_for", lambda target, forward=None: 4)


def cpu_like_costs(max_width: int) -> dict[int, float]:
    """Seconds per verify width shaped as on a 2-core CPU: +3% per token and a 30% jump at 4 tokens. Slow enough
    that the real drafting time of a tiny drafter (the cut's overhead) weighs little against it."""
    return {w: 10.0 * (1 + 0.03 * w + (0.3 if w >= 4 else 0.0)) for w in range(1, max_width + 1)}


REAL_VERIFY_COSTS_FOR = assistant.verify_costs_for


@pytest.fixture(autouse=True)
def fixed_verify_costs(monkeypatch):
    """The throughput cut ("auto", the CPU's default) reads `cpu_like_costs` instead of timing each tiny target:
    tests stay fast and every run cuts the same way. tests/generation/test_min_drafts.py measures for real."""
    monkeypatch.setattr(assistant, "verify_costs_for",
                        lambda target, max_width, batch_size=1, forward=None: cpu_like_costs(max_width))


@pytest.fixture(autouse=True)
def split_head_everywhere(monkeypatch):
    """Verifies apply the LM head themselves, transposed at every width, wherever the probe allows it (every tiny
    target here): each decode test then checks that path, and none depends on a timing. The chooser is tested for
    real in tests/generation/test_target_forward.py."""
    monkeypatch.setattr(target_forward, "faster_transposed", lambda head, widths, batch_size=1: set(widths))


@pytest.fixture(autouse=True)
def fastest_ways_everywhere(monkeypatch):
    """Every eager verify a plan measures runs the fastest way open to it: the direct forward where it runs the
    target (the Llama-family targets here), hf_dscale's CPU kernel where it runs (x86-64 with AVX2 and a C
    compiler). The measurement reads `cpu_like_costs` for the best way offered and 5-10% more for each step down
    (the target's modules, torch's products), so each decode test checks those paths, the costs a plan keeps are
    `cpu_like_costs` whichever ways run here, and none depends on a timing. tests/kernels/test_cpu_linear.py and
    tests/generation/test_direct_forward.py measure for real."""
    def costs(target, transposed, ways, widths, batch_size=1):
        factor = {way: 1.0 + 0.1 * (not way.direct) + 0.05 * (not way.kernel) for way in ways}
        best = min(factor.values())
        return {way: {w: f / best * c for w, c in cpu_like_costs(max(widths)).items()} for way, f in factor.items()}

    monkeypatch.setattr(target_forward, "verify_costs_ways", costs)


def fix_verify_costs(monkeypatch, costs: dict[int, float]) -> None:
    """Every plan measured in the test reads `costs` as its verify costs, every way alike (a plan then keeps torch's
    products)."""
    monkeypatch.setattr(assistant, "verify_costs_for", lambda *args, **kwargs: costs)
    monkeypatch.setattr(target_forward, "verify_costs_ways",
                        lambda target, transposed, ways, *args, **kwargs: {way: costs for way in ways})


FAMILIES = ("llama", "qwen3", "mistral", "qwen2", "phi3", "gemma2", "gemma3")
SLIDING_FAMILIES = FAMILIES[2:]  # each with a sliding window of WINDOW tokens on some or all layers
WINDOW = 8


def tiny_target(kind: str = "llama", seed: int = 0, vocab: int = VOCAB, eos: int | None = None,
                window: int | None = WINDOW):
    """A tiny random causal LM of a family. The sliding-window families slide over `window` tokens (None: they
    attend to everything): Mistral and Phi-3 on every layer, Qwen2 on its upper half (`use_sliding_window`),
    Gemma 2 on every other layer (with attention and final-logit soft-capping), Gemma 3 on two layers of three
    (with its scaled embeddings and a local RoPE)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  pad_token_id=0, eos_token_id=eos, bos_token_id=None)
    gemma = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=window or 1024)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(head_dim=16, sliding_window=window, **common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=window is not None, sliding_window=window,
                                             max_window_layers=3, **common))
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(sliding_window=window, **common))
    elif kind == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, **gemma,
                                               **common))
    elif kind == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(sliding_window_pattern=3, **gemma, **common))
    else:
        raise ValueError(kind)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = eos
    return model.eval()


def tiny_drafter(target, fusion: str = "layerwise", block_size: int = 8, seed: int = 1, cls=DScaleDrafter):
    torch.manual_seed(seed)
    config = DScaleConfig.from_target(target.config, num_hidden_layers=2, fusion=fusion,
                                      mask_token_id=target.config.vocab_size - 1, block_size=block_size)
    return cls(config).eval()


def unevenly_padded(batch: int, length: int = 12, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts [batch, length] of tokens 1-89 and their mask: row b left-padded by 2b positions."""
    torch.manual_seed(seed)
    ids = torch.randint(1, 90, (batch, length))
    mask = torch.ones_like(ids)
    for b in range(1, batch):
        mask[b, : 2 * b] = 0
    return ids, mask


@pytest.fixture(params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param)
