"""`model.generate(..., custom_generate=dllm_generate, dllm_method="fast-dllm" | "blockbatch")` for dLLMs.

transformers prepares its usual arguments and hands them here; rows are decoded one by one (left
padding removed) and laid out as `generate()` does: prompt, answer, then `pad_token_id`.
`max_new_tokens` is the generation length G (a multiple of every block size).
"""

from __future__ import annotations

import torch

from ..engine.state import lay_out
from ..models.dllm import DiffusionModel
from .decode import blockbatch_generate, fast_dllm_generate
from .host import host_kernel

METHODS = ("fast-dllm", "blockbatch")


def generate(model, input_ids: torch.LongTensor, generation_config=None, dllm_method: str = "fast-dllm",
             mask_token_id: int | None = None, dllm_stats: list | None = None, block_size: int = 32,
             block_sizes=None, blockbatch_plan=None, refresh_tokens="plan", refresh_rows="plan",
             sync_threshold="plan", threshold: float = 0.9, dllm_host: str = "auto", **model_kwargs):
    """Args: dllm_method; block_size (Fast-dLLM); block_sizes (BlockBatch; default the paper's 4 to 128) or
    blockbatch_plan (a `BlockBatchPlan` from `plan_blockbatch`: branches and refresh interval chosen by measured step
    costs; explicit block_sizes win); refresh_tokens (BlockBatch's refresh interval, None: never; "plan": the plan's,
    else 32); refresh_rows (what a refresh runs: "all" branches' rows, the paper's, or the "leader"'s alone; "plan":
    the plan's, else "all"); sync_threshold (a branch this many tokens behind the leader copies it; "plan": the
    plan's, else 8); threshold; dllm_stats: a list that receives one `DLLMResult` per row (NFE counts);
    dllm_host: who does the bookkeeping between model calls ("auto": the C library on a CPU, see
    `dllm.host.host_kernel`; "c"; "torch")."""
    if dllm_method not in METHODS:
        raise ValueError(f"dllm_method must be one of {METHODS}, got {dllm_method!r}.")
    if generation_config is not None and generation_config.do_sample:
        raise ValueError("Fast-dLLM and BlockBatch decode greedily here: pass do_sample=False.")
    dlm = DiffusionModel(model, mask_token_id=mask_token_id)
    host_kernel(dllm_host, input_ids.device)  # a bad choice is refused before any decoding
    gen_length = (generation_config.max_new_tokens if generation_config is not None else None) or 256
    mask = model_kwargs.get("attention_mask")
    valid = mask.bool() if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    answers = []
    for b in range(input_ids.shape[0]):
        prompt = input_ids[b][valid[b]][None]
        if dllm_method == "fast-dllm":
            result = fast_dllm_generate(dlm, prompt, gen_length, block_size, threshold, host=dllm_host)
        else:
            result = blockbatch_generate(dlm, prompt, gen_length, block_sizes, threshold,
                                         refresh_tokens=refresh_tokens, refresh_rows=refresh_rows,
                                         sync_threshold=sync_threshold,
                                         plan=blockbatch_plan, host=dllm_host)
        answers.append(result.sequence[prompt.shape[1] :])
        if dllm_stats is not None:
            dllm_stats.append(result)
    pad = generation_config.pad_token_id if generation_config is not None else None
    pad = pad if pad is not None else dlm.eos_token_id if dlm.eos_token_id is not None else 0
    return lay_out(input_ids, answers, pad)
