"""`model.generate(..., custom_generate=hf_dscale.generation.custom_generate.generate, drafter=...)`.

`generate()` prepares everything (logits processors, stopping criteria, the cache) and hands it here;
the engine (`hf_dscale.engine`) decodes. transformers drops `streamer` and `assistant_model` on the way to a
custom generate function, so they are taken as `streamer_=` and `drafter=`.
"""

from __future__ import annotations

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..engine import decode
from ..models import DScaleDrafter
from ..models.dscale import compat


def _load_drafter(drafter, model):
    if isinstance(drafter, str):
        drafter = DScaleDrafter.from_pretrained(drafter, dtype=model.dtype).to(model.device)
    if drafter is None:
        raise ValueError("Pass the drafter: model.generate(..., custom_generate=..., drafter=<DScaleDrafter or path>).")
    return drafter


def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    drafter=None,
    vp_drafter=None,
    draft_tree: bool | None = None,
    num_branches: int | None = None,
    branch_policy: str | None = None,
    tree_kernel: bool | None = None,
    draft_confidence: float | str | None = None,
    prompt_lookup: bool | None = None,
    compile: bool | None = None,
    cpu_linear: bool | None = None,
    direct_forward: bool | None = None,
    one_read: bool | None = None,
    plan=None,
    streamer_=None,
    dscale_stats=None,
    **model_kwargs,
):
    """Speculative decoding with a DScale/DFlash drafter; exact for greedy, lossless for sampling.

    With no method options, the method is the one the engine's plan chooses for the device (`hf_dscale.engine.plan`):
    greedy decoding verifies the drafter's own tree sized by measured verify costs, with a prompt-lookup path;
    sampling verifies a chain. Every option below overrides that choice.

    Args:
        drafter: a `DScaleDrafter` (or a path or Hub id of one) trained for `model`.
        vp_drafter: a variable-prefix drafter (or a path) to decode with D²SD: the first drafter's draft
            plus `num_branches` re-drafted branches, verified as one token tree.
        draft_tree: True: verify the drafter's block plus its own best alternatives (a runner-up token at one depth,
            then the block's later drafts) as one token tree; False: the block's chain only.
        num_branches: branches a tree may hold (default 4).
        branch_policy: D²SD only: "ranked" (default; the K best (boundary, token) branch starts by rejection chance
            times the VP drafter's belief; several may share a boundary), "distinct" (one branch per boundary,
            starting with the VP drafter's best token other than the first draft's) or "vp" (the VP drafter's
            argmax everywhere, as in the paper).
        draft_confidence: how much of each block to verify, worth cutting where a wide verify costs more than a
            narrow one (the CPU); output is unchanged. "auto": the head (or the tree's nodes) with the most tokens
            expected per second, from the drafter's confidences and the target's verify costs measured once; a number
            in (0, 1): the head whose cumulative drafter confidence is at least it; 0: the whole block. Default:
            `drafter.draft_confidence` if set, else the plan's ("auto" for trees and on a CPU, 0 for a GPU chain;
            0.1 for D²SD on a CPU).
        prompt_lookup: add to each tree the tokens that followed the latest earlier occurrence of the sequence's
            last few tokens (prompt lookup), weighed by how often such proposals were accepted so far; helps where
            the output repeats its context (code, quotes). No model pass; output is unchanged.
        compile: run the verify forward compiled (`torch.compile` with the weights frozen, at the widest verify; see
            `hf_dscale.engine.compiled`): on a CPU a 16-token verify then costs about 1.3x a one-token step instead
            of 2x, so wider trees pay. Compiling takes tens of seconds once per target (reported in
            `dscale_stats.compile_s` and the plan's `compile_s`); later calls reuse it. Default: the plan's, compiled
            on a GPU (eager where compiling fails, logged) and eager on a CPU, where a compile pays back only over
            thousands of tokens.
        cpu_linear: on a CPU, whether an eager verify may run its matrix products with hf_dscale's CPU kernel
            (`hf_dscale.kernels.cpu_linear`, which reads each float32 weight once for all the verified tokens,
            where MKL's SGEMM at 4-16 tokens costs up to twice a one-token product). Default: measured per verify
            width once per target, kept where cheaper; False: torch's products; True: fail where the kernel cannot
            run (it needs x86-64 with AVX-512 and a C compiler, and compiles itself once into the cache folder).
        direct_forward: whether an eager verify may run the target's weights layer by layer without its modules
            (`hf_dscale.engine.direct_forward`: the same ops, in one loop; about a third of a small model's CPU
            verify is transformers' module machinery). Default: for float32 Llama-family targets whose forward a
            probe shows equal, measured per verify width once per target, kept where cheaper; False: the target's
            own forward; True: fail where it cannot run.
        one_read: True drafts each cycle's next block before reading the cycle's tokens back, so the host waits for
            the device once a cycle; False drafts after that read, with the new tokens known (two reads). Default: one
            read on a GPU, two on a CPU (see `hf_dscale.engine.calibrate`); output is unchanged either way.
        plan: a `hf_dscale.engine.Plan` (from `calibrate`) to decode with instead of the one measured for this
            target; it fixes the method, so it excludes the options above.
        streamer_: a transformers streamer (batch size 1).
        dscale_stats: an optional `DecodeStats` that receives tau, stage timings and the plan.
    Returns:
        sequences [B, P + N], or a `GenerateDecoderOnlyOutput` when `return_dict_in_generate=True`.
    """
    drafter = _load_drafter(drafter, model)
    if draft_confidence is None and plan is None:  # the drafter's own setting, else the plan's default
        draft_confidence = getattr(drafter, "draft_confidence", None)
    if generation_config.num_beams not in (None, 1) or (generation_config.num_return_sequences or 1) != 1:
        raise ValueError("hf_dscale speculative decoding supports num_beams=1 and num_return_sequences=1.")
    pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0
    vp_drafter = None if vp_drafter is None else _load_drafter(vp_drafter, model)
    sequences, stats = decode(model, drafter, input_ids, model_kwargs.get("attention_mask"), vp_drafter=vp_drafter,
                              plan=plan, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                              do_sample=bool(generation_config.do_sample), pad_token_id=int(pad),
                              cache=compat.find_cache(model_kwargs), streamer=streamer_, tree_kernel=tree_kernel,
                              tree=draft_tree, num_branches=num_branches, branch_policy=branch_policy,
                              draft_confidence=draft_confidence, prompt_lookup=prompt_lookup, compile=compile,
                              cpu_linear=cpu_linear, direct_forward=direct_forward, one_read=one_read)
    if dscale_stats is not None:
        dscale_stats.merge(stats)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
