"""Accept (stage 3): walk each row's verified tree with the target's tokens; a chain is a one-path tree.

Vocabulary as in `engine/acceptance.py` (arXiv 2211.17192): the target accepts a prefix of a path's drafts
(`num_accepted`), then emits a recovered token at the first rejection or a bonus token after the last draft; the
row's output tokens are the accepted drafts plus that one token. p is the target's distribution, q the drafter's.

Two rules, both exact for greedy decoding and lossless for sampling:
* a **sampled chain** (one path whose drafts were drawn from q): speculative sampling's rejection rule,
  accept d_k with probability min(1, p_k(d_k) / q_k(d_k)), recover from norm(max(p_k - q_k, 0));
* any **tree** (or a greedy chain): "sample, then match" (`walk_tree`): draw the target's token after the current
  node from p (its argmax when greedy), move to the child holding it, stop at the first token no child holds.

Every node's token is drawn at once for the whole batch and the walk runs on the device (`walk`), so nothing is
read here: the engine reads every row's path together with the next draft, once a cycle. Logits processors depend
on the path, so with them each node's logits are first processed for its own path (the row, then the tokens down to
the node), every node's, not only those the walk will visit.
"""

from __future__ import annotations

import torch

from .acceptance import speculative_accept
from .state import Batch, Outcome, Verify


def accept(verify: Verify, logits: torch.Tensor, rows: Batch, processors, do_sample: bool,
           q_logits: torch.Tensor | None, active: list[bool]) -> Outcome:
    """Every row's accepted path, on the device (a finished row's is read and dropped).

    logits [B, N, V]: the target's logits after each node; q_logits [B, N-1, V]: the processed q a sampled chain's
    drafts were drawn from (None for greedy drafts and trees).
    """
    logits = logits.float()
    if processors:
        logits = _processed(verify, logits, rows, processors, active)
    if q_logits is not None:  # a sampled chain: speculative sampling's rule over a batch of chains of one length
        num_accepted, output_ids = speculative_accept(verify.ids[:, 1:], q_logits.softmax(-1), logits.softmax(-1))
        nodes = torch.arange(output_ids.shape[1], device=output_ids.device).expand_as(output_ids)
        return Outcome(num_accepted + 1, nodes, output_ids, logits)
    if do_sample:
        b, n, v = logits.shape
        probs = logits.softmax(-1).nan_to_num_(0.0).view(b * n, v)
        # a node whose processors leave no token (no_repeat_ngram_size, every token used) draws uniformly rather than
        # fail the batch: past max_new_tokens, where plain decoding never draws, its draw is not committed
        probs.masked_fill_(probs.sum(-1, keepdim=True) <= 0, 1.0)
        picks = torch.multinomial(probs, 1).view(b, n)
    else:
        picks = logits.argmax(-1)
    return walk(verify, picks, logits)


def walk(verify: Verify, picks: torch.Tensor, logits: torch.Tensor) -> Outcome:
    """`walk_tree` for every row at once, on the device: from the anchor, move to the child holding the target's token
    (`picks` [B, N]: the token drawn after each node) while there is one. A node is on the accepted path when it and
    each of its ancestors holds the token drawn after its parent; siblings hold distinct tokens, so those nodes form
    one path. Its tokens are the draws after each of its nodes: the accepted drafts, then the recovered or bonus
    token."""
    parents = verify.parents
    matched = (verify.ids == picks.gather(1, parents.clamp_min(0))) & (parents >= 0)
    matched[:, 0] = True  # the anchor
    on_path = ~(verify.ancestors() & ~matched[:, None, :]).any(-1)  # [B, N]
    length = torch.where(on_path, verify.depths, -1).amax(-1) + 1
    levels = torch.arange(verify.depth, device=picks.device)[None, :, None]
    nodes = (on_path[:, None, :] & (verify.depths[:, None, :] == levels)).int().argmax(-1)  # [B, D]
    return Outcome(length, nodes, picks.gather(1, nodes), logits)


def _processed(verify: Verify, logits: torch.Tensor, rows: Batch, processors, active: list[bool]) -> torch.Tensor:
    """logits [B, N, V] with `generate()`'s logits processors applied at every node of every active row's tree to
    the row + the node's path, as plain decoding would apply them there."""
    processed = logits.clone()
    for b, tree in enumerate(verify.trees):
        if active[b]:
            apply, row = rows.processors_for(processors, b), rows.sequence(b)  # the row once, then each node's path
            for node in range(len(tree.tokens)):
                ids = torch.cat((row, row.new_tensor(tree.path(node))[None]), 1)
                processed[b, node] = apply(ids, logits[b, node][None])[0]
    return processed
