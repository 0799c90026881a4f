"""The DFlash/DScale training objective on one sequence (pure functions, no I/O).

N random anchors are laid side by side as N blocks of γ tokens after the S context positions. Block i
holds the real tokens at anchor_i .. anchor_i + l_i (l_i = 0 for DScale/DFlash: the anchor only;
l_i > 0 for the variable-prefix drafter) and the mask token after them. It sees the context strictly
before its anchor (at inference the anchor's own features do not exist yet), its own block in both
directions, and no other block. Position k > l_i is labelled with the real token at anchor_i + k and
weighted exp(-(k - l_i - 1) / γ_decay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Blocks:
    input_ids: torch.Tensor  # [N, γ] block tokens (real prefix, then mask)
    labels: torch.Tensor  # [N, γ] token each position must predict (0 where weight is 0)
    weights: torch.Tensor  # [N, γ] decayed loss weights
    position_ids: torch.Tensor  # [N, γ] absolute positions anchor + k
    anchors: torch.Tensor  # [N] (the visibility of each block: see `block_attention_mask`)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to `num_anchors` distinct response positions that have at least one token after them, sorted.

    Example: loss_mask [0, 0, 1, 1, 1] -> candidates {2, 3}; num_anchors=1 picks one of them.
    """
    valid = loss_mask.clone().bool()
    valid[-1:] = False
    candidates = valid.nonzero()[:, 0]
    if candidates.numel() > num_anchors:
        keep = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[keep]
    return candidates.sort().values


def sample_prefix_lengths(n: int, block_size: int, beta: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """l ~ β^l over 0..γ-2 (truncated geometric prior of the VP drafter, l = 0 included)."""
    weights = beta ** torch.arange(block_size - 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=generator)


def build_blocks(
    input_ids: torch.Tensor,  # [S]
    loss_mask: torch.Tensor,  # [S] bool, True on response tokens
    anchors: torch.Tensor,  # [N]
    block_size: int,
    mask_token_id: int,
    decay: float,
    prefix_lengths: torch.Tensor | None = None,  # [N], default 0
) -> Blocks:
    s, n, g = input_ids.shape[0], anchors.shape[0], block_size
    k = torch.arange(g)
    prefix = torch.zeros(n, dtype=torch.long) if prefix_lengths is None else prefix_lengths
    positions = anchors[:, None] + k  # [N, γ]
    inside = positions < s
    real = input_ids[positions.clamp_max(s - 1)]
    shown = (k[None] <= prefix[:, None]) & inside
    block_ids = torch.where(shown, real, torch.full_like(real, mask_token_id))
    predicted = (k[None] > prefix[:, None]) & inside & loss_mask[positions.clamp_max(s - 1)].bool()
    weights = torch.exp(-(k[None] - prefix[:, None] - 1).clamp_min(0).float() / decay) * predicted
    labels = torch.where(predicted, real, torch.zeros_like(real))
    return Blocks(block_ids, labels, weights, positions, anchors)


def block_attention_mask(anchors: list[torch.Tensor], width: int, block_size: int,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """[B, N·γ, width + N·γ] bool (True = attend) for B sequences' blocks laid after their contexts.

    A block of sequence b sees that sequence's context strictly before its anchor and its own block in
    both directions. N is the most anchors of any sequence; a sequence's missing blocks see only
    themselves (their rows are padding). Built where it is used: for a GPU batch the mask has hundreds of
    millions of entries, far too many to make on the CPU and copy.
    """
    n = max(a.numel() for a in anchors)
    padded = torch.zeros(len(anchors), n, dtype=torch.long)
    for i, a in enumerate(anchors):
        padded[i, : a.numel()] = a
    rows = padded.to(device).repeat_interleave(block_size, dim=1)  # [B, N·γ]: each row's anchor (0 = none)
    sees_context = torch.arange(width, device=device) < rows[..., None]
    query_block = torch.arange(n, device=device).repeat_interleave(block_size)
    same_block = (query_block[:, None] == query_block[None]).expand(len(anchors), -1, -1)
    return torch.cat((sees_context, same_block), dim=-1)


def weighted_cross_entropy(
    logits: torch.Tensor,  # [M, V] at positions with weight > 0
    labels: torch.Tensor,  # [M]
    weights: torch.Tensor,  # [M]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w·CE / (Σ w + 1e-6), and the (unweighted) top-1 accuracy."""
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    loss = (weights * ce).sum() / (weights.sum() + 1e-6)
    accuracy = (logits.argmax(-1) == labels).float().mean() if labels.numel() else logits.new_zeros(())
    return loss, accuracy
