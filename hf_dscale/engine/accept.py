"""Accept (stage 3): walk each row's verified tree with the target's tokens; a chain is a one-path tree.

Vocabulary as in `generation/acceptance.py` (arXiv 2211.17192): the target accepts a prefix of a path's drafts
(`num_accepted`), then emits a recovered token at the first rejection or a bonus token after the last draft; the
row's output tokens are the accepted drafts plus that one token. p is the target's distribution, q the drafter's.

Two rules, both exact for greedy decoding and lossless for sampling:
* a **sampled chain** (one path whose drafts were drawn from q): speculative sampling's rejection rule,
  accept d_k with probability min(1, p_k(d_k) / q_k(d_k)), recover from norm(max(p_k - q_k, 0));
* any **tree** (or a greedy chain): "sample, then match" (`walk_tree`): draw the target's token after the current
  node from p (its argmax when greedy), move to the child holding it, stop at the first token no child holds.

Every node's token is drawn at once for the whole batch and read back with one host synchronisation. Logits
processors depend on the path, so with them each node's logits are first processed for its own path (the row, then
the tokens down to the node), every node's, not only those the walk will visit: a few more processor calls instead
of a read of the device per node visited.
"""

from __future__ import annotations

import torch

from ..generation.acceptance import speculative_accept
from ..generation.tree import walk_tree
from .state import Batch, Verify, Walk


def accept(verify: Verify, logits: torch.Tensor, rows: Batch, processors, do_sample: bool,
           q_logits: torch.Tensor | None, active: list[bool]) -> list[Walk | None]:
    """One `Walk` per row (None for a row already finished).

    logits [B, N, V]: the target's logits after each node; q_logits [B, N-1, V]: the processed q a sampled chain's
    drafts were drawn from (None for greedy drafts and trees).
    """
    logits = logits.float()
    if q_logits is not None:
        return _sampled_chain(verify, logits, rows, processors, q_logits, active)
    if processors:
        logits = _processed(verify, logits, rows, processors, active)
    if do_sample:
        b, n, v = logits.shape
        probs = logits.softmax(-1).nan_to_num_(0.0).view(b * n, v)
        # a node whose processors leave no token (no_repeat_ngram_size, every token used) draws uniformly rather than
        # fail the batch: past max_new_tokens, where plain decoding never draws, its draw is not committed
        probs.masked_fill_(probs.sum(-1, keepdim=True) <= 0, 1.0)
        picks = torch.multinomial(probs, 1).view(b, n)
    else:
        picks = logits.argmax(-1)
    picks = picks.tolist()  # the cycle's one host synchronisation for the target's tokens
    walks = []
    for b, tree in enumerate(verify.trees):
        if not active[b]:
            walks.append(None)
            continue
        tokens, path = walk_tree(tree, lambda node, b=b: picks[b][node])
        walks.append(Walk(tokens, path, logits[b, path]))
    return walks


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


def _sampled_chain(verify: Verify, logits: torch.Tensor, rows: Batch, processors, q_logits: torch.Tensor,
                   active: list[bool]) -> list[Walk | None]:
    """Speculative sampling over a batch of chains of one length: processed p at every node, then the rule."""
    drafts = verify.ids[:, 1:]  # [B, K]
    if processors:
        logits = _processed(verify, logits, rows, processors, active)
    num_accepted, output_ids = speculative_accept(drafts, q_logits.softmax(-1), logits.softmax(-1))
    walks = []
    for b, (n, *output) in enumerate(torch.cat((num_accepted[:, None], output_ids), 1).tolist()):  # one read
        walks.append(Walk(output[: n + 1], list(range(n + 1)), logits[b, : n + 1]) if active[b] else None)
    return walks
