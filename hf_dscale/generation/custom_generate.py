"""`model.generate(..., custom_generate=hf_dscale.generation.custom_generate.generate, drafter=...)`.

`generate()` prepares everything (logits processors, stopping criteria, the cache) and hands it here;
we run the batched speculative loop. transformers drops `streamer` and `assistant_model` on the way to a
custom generate function, so they are taken as `streamer_=` and `drafter=`.
"""

from __future__ import annotations

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..models.dscale import compat
from .d2sd import tree_generate
from .decode import speculative_generate


def _load_drafter(drafter, model):
    if isinstance(drafter, str):
        from ..models import DScaleDrafter

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
    draft_tree: bool = False,
    num_branches: int = 4,
    branch_policy: str = "ranked",
    tree_kernel: bool | None = None,
    draft_confidence: float | str | None = None,
    prompt_lookup: bool = False,
    streamer_=None,
    dscale_stats=None,
    **model_kwargs,
):
    """Speculative decoding with a DScale/DFlash drafter; exact for greedy, lossless for sampling.

    Args:
        drafter: a `DScaleDrafter` (or a path to one) trained for `model`.
        vp_drafter: a variable-prefix drafter (or a path) to decode with D²SD: the first drafter's draft
            plus `num_branches` re-drafted branches, verified as one token tree. Batches run row by row.
        draft_tree: without `vp_drafter`, verify the drafter's block plus its own `num_branches` best
            alternatives (a runner-up token at one depth, then the block's later drafts) as one token tree:
            more tokens per target forward for a wider verify; on a CPU "auto" keeps only the nodes that pay
            for their width (`draft_confidence`). Batches run row by row.
        branch_policy: "ranked" (the K best (boundary, token) branch starts by rejection chance times
            the VP drafter's belief; several may share a boundary), "distinct" (one branch per boundary,
            starting with the VP drafter's best token other than the first draft's) or "vp" (the VP
            drafter's argmax everywhere, as in the paper).
        draft_confidence: how much of each block to verify, worth cutting where a wide verify costs more
            than a narrow one (the CPU); output is unchanged. "auto": the head with the most tokens expected
            per second, from the drafter's confidences and the target's verify costs (measured once, ~3 s
            on a small CPU); a number in (0, 1): the head whose cumulative drafter confidence is at least
            it; 0: the whole block. In a token tree every path stops at that depth; with `vp_drafter`
            "auto" = 0.1, with `draft_tree` it verifies the likeliest nodes, as many as give the most tokens
            expected per second (`throughput_tree`). Default: `drafter.draft_confidence` if set, else "auto"
            on a CPU and 0 on a GPU.
        prompt_lookup: with `draft_tree` or `vp_drafter`, add to each tree the tokens that followed the latest
            earlier occurrence of the sequence's last few tokens (prompt lookup), weighed by how often such
            proposals were accepted so far in the generation; helps where the output repeats its context (code,
            quotes). No model pass; output is unchanged.
        streamer_: a transformers streamer (batch size 1).
        dscale_stats: an optional `DecodeStats` that receives tau and stage timings.
    Returns:
        sequences [B, P + N], or a `GenerateDecoderOnlyOutput` when `return_dict_in_generate=True`.
    """
    drafter = _load_drafter(drafter, model)
    if draft_confidence is None:  # the drafter's own setting, else the device's default
        draft_confidence = getattr(drafter, "draft_confidence", None)
    if generation_config.num_beams not in (None, 1) or (generation_config.num_return_sequences or 1) != 1:
        raise ValueError("hf_dscale speculative decoding supports num_beams=1 and num_return_sequences=1.")
    if prompt_lookup and vp_drafter is None and not draft_tree:
        raise ValueError("prompt_lookup adds a branch to a token tree: pass draft_tree=True as well (or a vp_drafter).")
    if streamer_ is not None and input_ids.shape[0] != 1:
        raise ValueError("Streamers support batch size 1 only.")
    pad = generation_config.pad_token_id
    if pad is None:
        eos = generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0
    common = dict(
        attention_mask=model_kwargs.get("attention_mask"),
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        do_sample=bool(generation_config.do_sample),
        pad_token_id=int(pad),
        cache=compat.find_cache(model_kwargs),
        streamer=streamer_,
    )
    if vp_drafter is not None or draft_tree:
        vp_drafter = None if vp_drafter is None else _load_drafter(vp_drafter, model)
        sequences, stats = tree_generate(model, drafter, vp_drafter, input_ids, num_branches=num_branches,
                                         branch_policy=branch_policy, tree_kernel=tree_kernel,
                                         draft_confidence=draft_confidence, prompt_lookup=prompt_lookup, **common)
    else:
        sequences, stats = speculative_generate(model, drafter, input_ids, draft_confidence=draft_confidence,
                                                **common)
    if dscale_stats is not None:
        dscale_stats.merge(stats)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
