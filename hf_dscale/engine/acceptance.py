"""Acceptance rules for one verified chain of drafts (arXiv 2211.17192).

Vocabulary, used in identifiers everywhere: the drafter proposes **draft** tokens d_1..d_K; the target
accepts a prefix of them (**num_accepted**); at the first rejection it emits a **recovered** token,
and when all K are accepted it emits a **bonus** token from its distribution after d_K. The
**output** tokens of a row are its accepted drafts plus that one recovered-or-bonus token.
p is the target's distribution, q the drafter's (the one the drafts were sampled from).
"""

from __future__ import annotations

import torch


def greedy_accept(
    draft_ids: torch.Tensor,  # [B, K]
    target_logits: torch.Tensor,  # [B, K+1, V] processed target logits at the anchor and each draft
) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix where the draft equals the target's argmax.

    Returns num_accepted [B] and output_ids [B, K+1]; row b commits `output_ids[b, :num_accepted[b] + 1]`.

    Example: drafts [5, 7, 9], target argmax [5, 7, 2, 4] -> num_accepted 2, output [5, 7, 2, 4]
    (commit 5, 7 and the recovered 2).
    """
    output_ids = target_logits.argmax(-1)
    matches = (draft_ids == output_ids[:, :-1]).int()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    return num_accepted, output_ids


def speculative_accept(
    draft_ids: torch.Tensor,  # [B, K] drafts, d_k ~ q_k
    q_probs: torch.Tensor,  # [B, K, V] drafter distributions the drafts were sampled from
    p_probs: torch.Tensor,  # [B, K+1, V] target distributions
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling: accept d_k with probability min(1, p_k(d_k) / q_k(d_k)).

    At the first rejection the recovered token is drawn from norm(max(p_k - q_k, 0)); if every draft is
    accepted the bonus token is drawn from p_{K+1}. Returns num_accepted [B] and output_ids [B, K+1]
    (positions past `num_accepted` hold the recovered/bonus token at index num_accepted; later ones are
    meaningless).
    """
    b, k = draft_ids.shape
    rows = torch.arange(b, device=draft_ids.device)
    p_draft = p_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)
    q_draft = q_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    # NOTE: float64 uniforms so that u is never exactly 0 where p/q is 0.
    u = torch.rand((b, k), generator=generator, device=draft_ids.device, dtype=torch.float64)
    accepted = u * q_draft.double() < p_draft.double()
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)

    last_p = p_probs[rows, num_accepted]  # [B, V]
    padded_q = torch.cat((q_probs, torch.zeros_like(q_probs[:, :1])), dim=1)  # q of "position K" is 0
    residual = (last_p - padded_q[rows, num_accepted]).clamp_min(0)
    # A residual can vanish only when p == q there, where rejection has probability 0; guard anyway.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, last_p, residual)
    extra = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator).squeeze(1)

    output_ids = torch.cat((draft_ids, draft_ids[:, :1]), dim=1).clone()
    output_ids[rows, num_accepted] = extra
    return num_accepted, output_ids
