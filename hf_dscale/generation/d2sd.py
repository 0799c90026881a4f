"""D²SD: a block drafter's draft plus a variable-prefix drafter's re-drafts, verified as one token tree (or,
without the second drafter, the block drafter's own runner-up alternatives).

One cycle (batch size 1; `tree_generate` runs a batch row by row):

1. The first drafter proposes γ-1 tokens t_1..t_{γ-1} greedily, with confidences c_k (its max
   probability at temperature 1).
2. Boundary scores r(i) = (c_1…c_i)(1 - c_{i+1}), i = 0..γ-2: the chance that the draft is rejected
   right after i accepted tokens, if the confidences are calibrated and independent. The K best i are
   the re-anchoring points.
3. The variable-prefix (VP) drafter reads the K rows `[anchor, t_1..t_i, mask, ...]` in one batched
   pass (the context K/V are computed once for all rows) and fills positions i+1..γ-1. Which K
   branches leave the spine (`branch_policy`):
   * `"ranked"` (default): every (boundary i, token a ≠ t_{i+1}) pair is scored r(i)·q(a)/(1 - q(t_{i+1}))
     with q the VP drafter's distribution there, and the K best are kept (`ranked_branches`), so a
     likely rejection point, typically the root, can hold several alternatives;
   * `"distinct"`: one branch per boundary, starting with the VP drafter's best token other than t_{i+1};
   * `"vp"`: one branch per boundary with the VP drafter's plain argmax (the paper's rule, where a
     branch may repeat the spine's token and add nothing at its branch point).
4. The spine and the K branches become a token tree (shared prefixes stored once) and the target
   verifies every node in one forward with an ancestor-only mask and positions anchor + depth.
5. The target walks the tree (`walk_tree`): exact for greedy decoding, lossless for sampling. The
   target cache keeps only the accepted path's K/V and both drafters read that path's hidden states
   as their next context.

Without a VP drafter (`vp_drafter=None`, `draft_tree=True` in `generate()`), step 3 reads the first drafter's
own distributions instead: it fills every position of the block in one pass, so its runner-up tokens at each
depth are alternatives whose later drafts are those of the spine (`own_branches`). The K best such swaps
(one runner-up token each, scored by the chance of reaching their depth times the drafter's belief in them)
join the spine in the tree; no second drafter, no second pass.

With `draft_confidence` c > 0 every path of the tree stops at the depth where the first drafter's
cumulative confidence falls below c (at least `min_drafts_for(target)`, as in single-drafter decoding; "auto",
the CPU's default, is c = `CPU_DRAFT_CONFIDENCE` here, since a tree's verify width is not a chain's): boundaries
are picked inside that head and branches end there too. That is for hardware where a wide verify costs
more than a narrow one (a CPU): on SmolLM2 with K = 2 the tree holds about 12 tokens instead of 73 and
keeps about half of D²SD's τ gain. The depth comes from confidences, never from drawn tokens, so
sampling stays lossless. The drafter's own tree has its own "auto" (`throughput_tree`): of the spine and its K
branches, the nodes likeliest to be accepted by the drafter's beliefs, as many as give the most tokens expected per
second of the cycle with the measured verify costs, so it is at most a block wide and is a bare chain where no
branch pays.

`prompt_lookup=True` adds one more path to every tree: the tokens that followed the latest earlier occurrence of
the sequence's last few tokens (`lookup.PromptLookup`), which a drafter may not rank at all where the output
repeats its context (code restating the function it completes). In the own tree's "auto" its nodes are weighed
with the chances learnt from how its earlier proposals fared in the same generation.
"""

from __future__ import annotations

import time

import torch

from ..kernels.hf_attention import register as register_tree_attention
from ..kernels.tree_attention import triton_usable
from ..models.dscale import compat
from ..models.dscale.modeling_dscale import DraftContextCache
from .decode import AUTO, CPU_DRAFT_CONFIDENCE, _commit, _Decoder, _Rows, lay_out, resolve_draft_confidence
from .lookup import PromptLookup
from .tree import TokenTree, walk_tree
from .types import DecodeStats

BRANCH_POLICIES = ("vp", "distinct", "ranked")


def resolve_tree_confidence(threshold: float | str | None, device) -> float:
    """`resolve_draft_confidence` for a token tree: "auto" (the CPU's default) is `CPU_DRAFT_CONFIDENCE`, since
    the throughput cut's costs are those of a chain and a tree's verify width is not a chain's."""
    threshold = resolve_draft_confidence(threshold, device)
    return CPU_DRAFT_CONFIDENCE if threshold == AUTO else threshold


def boundary_scores(confidences: torch.Tensor) -> torch.Tensor:
    """[γ-1] confidences c_1..c_{γ-1} -> [γ-1] scores r(0..γ-2), r(i) = (c_1…c_i)(1 - c_{i+1}).

    Example: c = [0.9, 0.5, 0.8] -> r = [0.1, 0.45, 0.09].
    """
    kept = torch.cat((confidences.new_ones(1), confidences[:-1].cumprod(0)))
    return kept * (1 - confidences)


def top_prefixes(confidences: torch.Tensor, k: int) -> list[int]:
    """The k most likely rejection boundaries (prefix lengths i), ascending."""
    scores = boundary_scores(confidences.float())
    k = min(k, scores.numel())
    return sorted(scores.topk(k).indices.tolist())


def ranked_branches(vp_logits: torch.Tensor, prefixes: list[int], spine: torch.Tensor, scores: torch.Tensor,
                    k: int, columns: torch.Tensor | None = None) -> list[tuple[int, int, int]]:
    """The k best (row j, boundary i, first token) branch starts over all boundaries, best first.

    A branch that leaves the spine at boundary i with token a pays off when the spine is rejected
    there (r(i)) and a is the target's token; given the rejection, the VP drafter's belief in a is
    q(a) / (1 - q(spine token)). Several branches may leave at one boundary; each continues with the
    VP drafter's argmax after its first token.

    `columns` gives the token id of each column of compact logits (`DraftVocab.ids`); None = the columns are the
    vocabulary. A spine token outside those columns has q = 0 there.

    Example: r = [0.8, 0.1], VP beliefs at boundary 0 beyond the spine's token 0.5, 0.3, at boundary
    1 0.9 -> scores 0.4, 0.24, 0.09: two branches at the root before one at depth 1.
    """
    options = []
    for j, i in enumerate(prefixes):
        q = vp_logits[j, i].float().softmax(-1)
        token = int(spine[i])
        spine_column = token if columns is None else _column_of(columns, token)
        rest = 1.0
        if spine_column is not None:
            rest = (1 - q[spine_column]).clamp_min(1e-6)
            q[spine_column] = 0
        values, picked = q.topk(min(k, q.numel()))
        tokens = picked if columns is None else columns[picked]
        options += [(float(scores[i] * v / rest), j, i, int(t)) for v, t in zip(values, tokens)]
    options.sort(key=lambda option: -option[0])
    return [(j, i, t) for _, j, i, t in options[:k]]


def own_branches(logits: torch.Tensor, spine: torch.Tensor, confidences: torch.Tensor, k: int,
                 columns: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """The k best (depth i, token a) alternatives to a block draft from the block drafter's own logits, best first.

    A block drafter fills every position in one pass, so its distribution p_{i+1} at depth i+1 does not depend
    on the token at depth i: a branch that swaps the spine's t_{i+1} for a and keeps the spine's later drafts
    holds the drafter's next-best guess at that depth. It pays off when the spine survives to depth i
    (c_1…c_i) and the target's token there is a, so it scores (c_1…c_i)·p(a): `ranked_branches` with the
    drafter as its own VP drafter, r(i)·p(a)/(1 - c_{i+1}), since c_{i+1} = p(t_{i+1}).

    logits [depth, V or |columns|] (row i predicts spine[i]); `columns` as in `ranked_branches`.
    """
    return [(i, token) for _, i, token in _own_options(logits, spine, confidences, k, columns)]


def _own_options(logits, spine, confidences, k, columns=None) -> list[tuple[float, int, int]]:
    """`own_branches` with their scores: [(score, depth i, token)], best first."""
    probs = logits.float().softmax(-1)  # [depth, C]
    depth, width = probs.shape
    if columns is None:
        is_spine = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, spine[:, None].to(probs.device), True)
    else:
        is_spine = columns[None, :] == spine[:, None]
    reach = torch.cat((confidences.new_ones(1), confidences[:-1].cumprod(0))).float()  # c_1…c_i for depth i
    scores = (reach[:, None] * probs).masked_fill_(is_spine, -1.0).flatten()
    values, picked = scores.topk(min(k, depth * (width - 1)))
    tokens = picked % width if columns is None else columns[picked % width]
    return [(v, i, t) for v, i, t in zip(values.tolist(), (picked // width).tolist(), tokens.tolist())]


def throughput_tree(logits: torch.Tensor, spine: torch.Tensor, confidences: torch.Tensor, k: int,
                    costs: dict[int, float], overhead: float = 0.0, columns: torch.Tensor | None = None,
                    extra: tuple[tuple[list[int], list[float]], ...] = ()) -> list[list[int]]:
    """The drafter's own tree cut for throughput: of the spine and its k best alternatives (`own_branches`, each
    continued with the spine's later drafts), the n nodes most likely to be accepted, as token paths from the anchor.

    A node's chance is the drafter's belief along its path: c_1…c_d for the spine's node at depth d, and
    (c_1…c_i)·p_{i+1}(a)·c_{i+2}…c_d for the node at depth d of the branch that swaps in a at depth i+1. No
    node is likelier than its parent, so the n likeliest form a tree. The cycle then commits 1 + the sum of their
    chances in expectation and costs `overhead` + costs[n + 1] (the anchor and n nodes in one verify; measured
    by `verify_costs_for`, which bounds n); n is the one with the most tokens expected per second, as
    `throughput_length` picks a chain's.

    logits [depth, V or |columns|] (row i predicts spine[i]); confidences [depth]; `columns` as in
    `ranked_branches`. `extra`: more paths from the anchor, each with the chance of each of its prefixes
    (non-increasing; a prompt lookup's, `PromptLookup.chances`); a node on several paths counts its best chance.

    Example: c = [0.9, 0.5], the root's runner-up at p 0.08, k 1, costs {2: 10, 3: 11, 4: 16} (ms) -> nodes 0.9,
    0.45, 0.08 (and 0.04 below it): 1.9/10, 2.35/11, 2.43/16 -> the spine's two drafts, no branch.
    """
    depth = logits.shape[0]
    chance = confidences.float().tolist()
    reach = [1.0]  # reach[i]: the spine's first i drafts all accepted
    for c in chance:
        reach.append(reach[-1] * c)
    spine_list = spine.tolist()
    nodes = [(reach[d], d, spine_list[:d]) for d in range(1, depth + 1)]  # (chance, depth, path)
    for value, i, token in _own_options(logits, spine, confidences, k, columns):
        path = spine_list[:i] + [token]
        nodes.append((value, i + 1, path))
        for d in range(i + 1, depth):
            value, path = value * chance[d], path + [spine_list[d]]
            nodes.append((value, d + 1, path))
    for path, chances in extra:
        nodes += [(value, d, path[:d]) for d, value in enumerate(chances[:depth], start=1)]
    if extra:  # one node per path, at its best chance (a parent's best is still at least its child's)
        kept = {}
        for node in nodes:
            key = tuple(node[2])
            if key not in kept or node[0] > kept[key][0]:
                kept[key] = node
        nodes = list(kept.values())
    nodes.sort(key=lambda node: (-node[0], node[1]))  # a tie puts the parent (shallower) first
    nodes = nodes[: max(costs) - 1]
    expected, best, best_rate = 1.0, 1, -1.0
    for n, (value, _, _) in enumerate(nodes, start=1):
        expected += value
        rate = expected / (overhead + costs[n + 1])
        if rate > best_rate:
            best, best_rate = n, rate
    return [path for _, _, path in nodes[:best]]


def _column_of(columns: torch.Tensor, token: int) -> int | None:
    hit = (columns == token).nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def _check_pair(drafter, vp_drafter) -> None:
    if vp_drafter.config.block_size != drafter.config.block_size:
        raise ValueError(
            f"The VP drafter's block_size ({vp_drafter.config.block_size}) differs from the first drafter's "
            f"({drafter.config.block_size}); D²SD verifies branches of the first drafter's width."
        )
    if vp_drafter.config.mask_token_id is None:
        raise ValueError("The VP drafter has no mask_token_id; set it in its config.")


class _TreeDecoder(_Decoder):
    """The batch-1 D²SD loop; prefill is the block decoder's, with taps for both drafters."""

    def __init__(self, target, drafter, vp_drafter, rows, row, cache, processors, criteria, do_sample, streamer,
                 num_branches: int = 4, branch_policy: str = "ranked", draft_confidence: float = 0.0,
                 prompt_lookup: bool = False):
        layer_ids = sorted(set(drafter.config.target_layer_ids)
                           | set(() if vp_drafter is None else vp_drafter.config.target_layer_ids))
        super().__init__(target, drafter, rows, cache, processors, criteria, do_sample, streamer, layer_ids,
                         draft_confidence, batch_size=1)
        self.row, self.row_ids = row, [row]
        self.vp_drafter, self.num_branches, self.branch_policy = vp_drafter, num_branches, branch_policy
        self.tap_index = [layer_ids.index(i) for i in drafter.config.target_layer_ids]
        self.vp_vocab = None
        self.prompt_lookup, self.lookup, self.proposal = prompt_lookup, None, ([], 0)
        if vp_drafter is not None:
            self.vp_cache = DraftContextCache(vp_drafter.config.num_hidden_layers)
            self.vp_tap_index = [layer_ids.index(i) for i in vp_drafter.config.target_layer_ids]

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        super().prefill(input_ids, valid)
        if self.prompt_lookup:
            self.lookup = PromptLookup(input_ids[0][valid[0]].tolist() + self.rows.generated[self.row])
        if self.vp_drafter is not None:
            self.vp_vocab = self.vp_drafter.draft_vocab_for(self.rows.sequence(self.row))

    def _candidates(self) -> TokenTree:
        """Steps 1-4: the spine, the boundaries and the branches (the VP drafter's, or without one the first
        drafter's own), as a token tree."""
        valid = None if bool(self.valid.all()) else self.valid
        anchor = self.anchors[:, None]
        # The spine is greedy, so the drafter's logits over its draft vocabulary's columns are enough (compact).
        logits = self.drafter.draft_logits(anchor, self.taps[:, :, self.tap_index], self.anchor_pos, self.ctx_pos,
                                           self.dcache, valid, self.vocab, compact=True)[0].float()
        sized = self.vp_drafter is None and self.cut.costs is not None  # "auto" on the own tree: `throughput_tree`
        depth = logits.shape[0] if sized else self.cut.length(logits[None])  # drafts on every path
        confidences, spine = logits[:depth].softmax(-1).max(-1)  # [depth]
        if self.vocab is not None:
            spine = self.vocab.ids[spine]
        if self.lookup is not None:
            self.proposal = self.lookup.propose(depth)
        if self.vp_drafter is None:
            return self._own_tree(logits[:depth], spine, confidences, sized)
        prefixes = top_prefixes(confidences, self.num_branches)
        gamma = self.drafter.config.block_size
        rows = spine.new_full((len(prefixes), gamma), self.vp_drafter.config.mask_token_id)
        rows[:, 0] = self.anchors[0]
        for j, i in enumerate(prefixes):
            rows[j, 1 : i + 1] = spine[:i]
        # Compact VP logits (its vocabulary's columns only) skip spreading K x (γ-1) rows over the whole
        # vocabulary, which costs more than the products on a CPU; `columns` maps a column to its token.
        columns = None if self.vp_vocab is None else self.vp_vocab.ids
        vp_logits = self.vp_drafter.block_logits(rows, self.anchor_pos, self.taps[:, :, self.vp_tap_index],
                                                 self.ctx_pos, self.vp_cache, valid, self.vp_vocab,
                                                 compact=columns is not None).float()  # [K, γ-1, V or |vocab|]

        def tokens(picked: torch.Tensor) -> list[int]:
            return (picked if columns is None else columns[picked]).tolist()

        spine_list = spine.tolist()
        candidates = [spine_list] + ([self.proposal[0]] if self.proposal[0] else [])
        if self.branch_policy == "ranked":
            scores = boundary_scores(confidences)
            for j, i, token in ranked_branches(vp_logits, prefixes, spine, scores, self.num_branches, columns):
                candidates.append(spine_list[:i] + [token] + tokens(vp_logits[j, i + 1 : depth].argmax(-1)))
            return TokenTree.from_candidates(int(self.anchors[0]), candidates)
        for j, i in enumerate(prefixes):
            fill = tokens(vp_logits[j, i:depth].argmax(-1))
            if self.branch_policy == "distinct" and fill[0] == spine_list[i]:
                fill[0] = tokens(vp_logits[j, i].topk(2).indices[1:])[0]
            candidates.append(spine_list[:i] + fill)
        return TokenTree.from_candidates(int(self.anchors[0]), candidates)

    def _own_tree(self, logits: torch.Tensor, spine: torch.Tensor, confidences: torch.Tensor,
                  sized: bool) -> TokenTree:
        """Without a VP drafter: the spine plus the K best alternatives from the first drafter's own
        distributions (`own_branches`), each continued with the spine's later drafts; `sized` ("auto"): only
        the nodes `throughput_tree` keeps. A prompt lookup's proposal, if any, is one more path."""
        columns = None if self.vocab is None else self.vocab.ids
        proposal, n = self.proposal
        if sized:
            overhead = self.overhead_s / self.stats.cycles if self.stats.cycles else 0.0
            extra = ((proposal, self.lookup.chances(n, len(proposal))),) if proposal else ()
            paths = throughput_tree(logits, spine, confidences, self.num_branches, self.cut.costs, overhead, columns,
                                    extra)
        else:
            spine_list = spine.tolist()
            paths = [spine_list] + [spine_list[:i] + [token] + spine_list[i + 1 :]
                                    for i, token in own_branches(logits, spine, confidences, self.num_branches,
                                                                 columns)]
            paths += [proposal] if proposal else []
        return TokenTree.from_candidates(int(self.anchors[0]), paths)

    def cycle(self) -> None:
        t0 = time.perf_counter()
        tree = self._candidates()
        t1 = time.perf_counter()
        device, dtype = self.anchors.device, self.target.dtype
        start = self.valid.shape[1]
        ids = torch.tensor(tree.tokens, device=device)[None]
        positions = self.anchor_pos[:, None] + torch.tensor(tree.depths, device=device)
        mask = self.attention.after_cache(self.valid, positions, tree.ancestor_mask(device), dtype)
        logits = self.verify(self.cache, input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=True)[0].float()  # [N, V]
        t2 = time.perf_counter()

        scores = []

        apply = self.rows.processors_for(self.processors, self.row)

        def choose(node: int) -> int:
            row = logits[node][None]
            if apply is not None:
                extra = torch.tensor(tree.path(node), dtype=torch.long, device=device)
                row = apply(self.rows.sequence(self.row, extra), row)
            scores.append(row[0])
            if self.do_sample:
                return int(torch.multinomial(row[0].softmax(-1), 1))
            return int(row[0].argmax())

        output, path = walk_tree(tree, choose)
        committed = _commit(self.rows, self.row, output, torch.stack(scores), self.criteria)
        if self.lookup is not None:
            self.lookup.record(*self.proposal, output)
            self.lookup.extend(output[:committed])
        self.stats.committed.append(committed)
        self.stats.verified.append(len(tree))
        if self.streamer is not None:
            self.streamer.put(torch.tensor(output[:committed]))

        for vocab in (self.vocab, self.vp_vocab):
            if vocab is not None:
                vocab.add(torch.tensor(output[:committed], device=device))
        n = len(path)
        compat.keep_tree_path(self.cache, start, path)
        self.valid = torch.cat((self.valid, self.valid.new_ones(1, n)), dim=1)
        self.taps = self.recorder.taps()[:, path]
        self.ctx_pos = self.anchor_pos[:, None] + torch.arange(n, device=device)
        self.anchors = self.anchors.new_tensor([output[-1]])
        self.anchor_pos = self.anchor_pos + n
        self.stats.cycles += 1
        t3 = time.perf_counter()
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        self.stats.other_s += t3 - t2
        self.overhead_s += (t1 - t0) + (t3 - t2)


@torch.no_grad()
def tree_generate(
    target,
    drafter,
    vp_drafter,  # None: branches from the drafter's own distributions (`own_branches`)
    input_ids: torch.LongTensor,  # [B, P], left-padded
    attention_mask: torch.LongTensor | None = None,
    logits_processor=None,
    stopping_criteria=None,
    do_sample: bool = False,
    pad_token_id: int = 0,
    cache=None,
    streamer=None,
    num_branches: int = 4,
    branch_policy: str = "ranked",
    tree_kernel: bool | None = None,
    draft_confidence: float | str | None = None,
    prompt_lookup: bool = False,
) -> tuple[torch.LongTensor, DecodeStats]:
    """D²SD decoding until every row meets a stopping criterion; returns sequences [B, P + N] and stats.

    Rows are decoded one after another (a tree per row per cycle); outputs are laid out as plain
    `generate()` lays them out (left padding kept, finished rows padded with `pad_token_id`).
    `tree_kernel` runs the target's attention with the Triton cascade kernel during the call (default:
    on CUDA when Triton is installed); otherwise the target's own SDPA/eager attention takes the mask.
    `draft_confidence` > 0 caps the tree's depth at the first drafter's confident head (module docstring);
    "auto" is `CPU_DRAFT_CONFIDENCE` with a VP drafter and `throughput_tree` without one; None: the device's
    default. `prompt_lookup` adds a prompt lookup's proposal to each tree (`PromptLookup`).
    """
    if branch_policy not in BRANCH_POLICIES:
        raise ValueError(f"branch_policy must be one of {BRANCH_POLICIES}, got {branch_policy!r}.")
    if num_branches < 1:
        raise ValueError(f"num_branches must be at least 1, got {num_branches}.")
    resolve = resolve_tree_confidence if vp_drafter is not None else resolve_draft_confidence
    draft_confidence = resolve(draft_confidence, input_ids.device)
    attn = compat.attention_implementation(target)
    if attn.startswith("flash") or attn == "flex_attention":
        raise ValueError(
            f"D²SD and draft_tree verify a token tree with a 4D attention mask, which the target's "
            f"attn_implementation {attn!r} does not take: load the target with attn_implementation='sdpa' (or 'eager')."
        )
    if vp_drafter is not None:
        _check_pair(drafter, vp_drafter)
    for model in (drafter, vp_drafter):
        if model is not None and model.target is not target:
            model.bind_target(target)
    valid = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).bool()
    if input_ids.shape[0] > 1 and streamer is not None:
        raise ValueError("Streamers support batch size 1 only.")
    if tree_kernel is None:
        tree_kernel = input_ids.device.type == "cuda" and triton_usable(input_ids.device) and attn in ("sdpa", "eager")
    if tree_kernel:
        target.set_attn_implementation(register_tree_attention())
    try:
        return _decode_rows(target, drafter, vp_drafter, input_ids, valid, logits_processor, stopping_criteria,
                            do_sample, pad_token_id, cache, streamer, num_branches, branch_policy, draft_confidence,
                            prompt_lookup)
    finally:
        if tree_kernel:
            target.set_attn_implementation(attn)


def _decode_rows(target, drafter, vp_drafter, input_ids, valid, logits_processor, stopping_criteria, do_sample,
                 pad_token_id, cache, streamer, num_branches, branch_policy, draft_confidence, prompt_lookup):
    b = input_ids.shape[0]
    stats = DecodeStats()
    rows = _Rows(input_ids, [[] for _ in range(b)], [False] * b)  # processors and criteria see padded rows
    for i in range(b):
        row_cache = cache if b == 1 else None  # None: the decoder makes one
        decoder = _TreeDecoder(target, drafter, vp_drafter, rows, i, row_cache, logits_processor, stopping_criteria,
                               do_sample, streamer, num_branches, branch_policy, draft_confidence, prompt_lookup)
        try:
            decoder.prefill(input_ids[i : i + 1], valid[i : i + 1])  # left padding stays masked, as in generate()
            while not rows.finished[i]:
                decoder.cycle()
        finally:
            decoder.recorder.remove()
        stats.merge(decoder.stats)
    if streamer is not None:
        streamer.end()
    return lay_out(input_ids, rows.generated, pad_token_id), stats
