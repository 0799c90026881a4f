"""The same guarantees on a CUDA GPU: greedy identity of both decoders (fp32, as DESIGN.md checks
exactness: in bf16 a near-tie can flip between a one-token and a many-token forward) through the GPU's default, the
compiled verify (a compile that fails falls back to an eager verify with a log line: here it fails the test), and
eagerly; a sliding-window family compiled; the diffusion-LM decoders' batched calls; the bench's read of the
weights; and a training run with bf16 autocast that computes taps on the fly. Skipped without a GPU; the CPU runs
of these paths are the rest of the suite."""

from __future__ import annotations

import pytest
import torch
from accelerate.state import AcceleratorState

from hf_dscale import DScaleDrafter
from hf_dscale.generation import DecodeStats, custom_generate
from hf_dscale.training.data import generate_data, iter_samples
from hf_dscale.training.trainer import TrainConfig, train_drafter

from .conftest import tiny_drafter, tiny_target
from .training.test_trainer import _tokenizer, write_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_identity_on_the_gpu(kind):
    target = tiny_target(kind).to("cuda")
    drafter, vp = tiny_drafter(target).to("cuda"), tiny_drafter(target, seed=7).to("cuda")
    ids = torch.tensor([[5, 9, 11, 4, 7, 30, 2, 61], [3, 17, 29, 41, 8, 66, 12, 9]], device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    for compile in (None, False):  # the GPU's default (compiled), then eager
        stats = DecodeStats()
        block = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                custom_generate=custom_generate, drafter=drafter, dscale_stats=stats, compile=compile)
        assert torch.equal(plain, block) and stats.cycles > 0, f"compile={compile}"
        assert (stats.plan.verify_path == "compiled") == (compile is None), stats.plan.reasons
    one = ids[:1]
    plain = target.generate(one, max_new_tokens=40, do_sample=False)
    for kernel in (False, True):
        tree = target.generate(one, max_new_tokens=40, do_sample=False, custom_generate=custom_generate,
                               drafter=drafter, vp_drafter=vp, tree_kernel=kernel)
        assert torch.equal(plain, tree), f"tree_kernel={kernel}"


def test_a_sliding_window_target_compiled_on_the_gpu():
    """Gemma 3 (a window on two layers of three) through the compiled verify, prompts longer than the window."""
    target = tiny_target("gemma3").to("cuda")
    drafter = tiny_drafter(target).to("cuda")
    ids = torch.randint(3, 60, (2, 40), generator=torch.Generator().manual_seed(3)).to("cuda")
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    stats = DecodeStats()
    spec = target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=custom_generate, drafter=drafter,
                           dscale_stats=stats)
    assert torch.equal(plain, spec) and stats.plan.verify_path == "compiled", stats.plan.reasons


def test_dllm_batched_calls_on_the_gpu():
    """The dual cache's packed block call and BlockBatch's batched branches, on the GPU."""
    from hf_dscale.generation import blockbatch_generate
    from hf_dscale.models.dllm import DiffusionModel

    from .generation.test_dllm import VOCAB, ragged_block_equals_rows_alone, tiny_dlm

    for shift in (0, 1):
        dlm = DiffusionModel(tiny_dlm(shift, seed=3).to("cuda"))
        ragged_block_equals_rows_alone(dlm, VOCAB)
        prompt = torch.randint(3, VOCAB, (1, 5)).to("cuda")
        kw = dict(gen_length=16, refresh_tokens=None, exchange=False, stop_early=False, threshold=0.05)
        together = blockbatch_generate(dlm, prompt, block_sizes=(2, 4, 8), **kw)
        for i, b in enumerate((2, 4, 8)):
            alone = blockbatch_generate(dlm, prompt, block_sizes=(b,), **kw)
            assert torch.equal(together.branch_rows[i], alone.branch_rows[0]), f"shift {shift}, block size {b}"
        planned = blockbatch_generate(dlm, prompt, gen_length=16, block_sizes=(4, 8))  # merge, sync, refresh
        assert planned.nfe > 0 and planned.sequence.device.type == "cuda"


def test_weights_read_on_the_gpu_is_one_fused_reduction_per_dtype():
    from hf_dscale.evaluation import weights_read_seconds

    target = tiny_target("llama").to("cuda")
    fused, per_tensor = weights_read_seconds(target), weights_read_seconds(target, fused=False)
    assert 0 < fused and 0 < per_tensor


def test_training_on_the_gpu_with_taps_from_the_target(tmp_path):
    target = tiny_target("llama").to("cuda")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    assert generate_data(target, _tokenizer(), [str(prompts)], str(tmp_path / "data"), None, max_new_tokens=24,
                         batch_size=4) == 8
    assert all(s.taps is None for s in iter_samples(str(tmp_path / "data")))
    drafter = tiny_drafter(target, block_size=4).to("cuda")
    history = []
    cfg = TrainConfig(steps=30, lr=1e-2, grad_accum=1, batch_size=4, num_anchors=16, save_every=10,
                      mixed_precision="bf16")
    try:
        trained = train_drafter(drafter, target, str(tmp_path / "data"), str(tmp_path / "run"), cfg,
                                on_step=lambda step, m: history.append(m["loss"]))
    finally:  # accelerate keeps one precision per process; the other tests train without autocast
        AcceleratorState._reset_state(reset_partial_state=True)
    assert trained.norm.weight.device.type == "cuda"
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 0.5
    loaded = DScaleDrafter.from_pretrained(tmp_path / "run").to("cuda").bind_target(target)
    ids = torch.tensor([[5, 9, 11, 4, 7, 30]], device="cuda")
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    spec = target.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=custom_generate, drafter=loaded)
    assert torch.equal(plain, spec)
