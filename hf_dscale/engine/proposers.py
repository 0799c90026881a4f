"""Proposers: the candidate paths of one cycle, per row. A token tree is the union of their paths.

Every proposer reads the block drafter's draft of the cycle (`Draft`: its spine t_1..t_K and confidences c_k, the
top probability of each position's distribution) and returns paths from the anchor:

* the **chain**: the spine, as deep as the cut allows (`DraftCut`: a confidence cut or the throughput cut);
* the drafter's **own tree** (`own_branches`): a block drafter fills every position in one pass, so its runner-up
  token at depth i+1 is an alternative whose later drafts are the spine's; the K best such swaps, no second pass;
* a **VP drafter's branches** (D²SD, `ranked_branches`): boundary scores r(i) = (c_1…c_i)(1 - c_{i+1}), the
  chance that the spine is rejected right after i accepted tokens, pick K re-anchoring points; the VP drafter
  reads the rows `[anchor, t_1..t_i, mask, ...]` in one batched pass and fills the rest. Which branches leave the
  spine: "ranked" (default; the K best (boundary, token) pairs by r(i)·q(a)/(1 - q(t_{i+1})), several may share a
  boundary), "distinct" (one per boundary, the VP drafter's best token other than t_{i+1}) or "vp" (the paper's:
  its argmax everywhere, which may repeat the spine's token);
* the **prompt lookup** (`lookup.PromptLookup`): the tokens after the latest earlier occurrence of the sequence's
  last few tokens, with chances learnt from how its earlier proposals fared.

A path that carries its nodes' chances of acceptance can be *sized*: `select_nodes` keeps the likeliest nodes of all
paths, as many as give the most tokens expected per second of the cycle at the measured verify costs, so a tree is
at most the widest measured verify and is a bare chain where no branch pays. Every choice reads only the drafter's
distributions and committed tokens, never drawn target tokens, so greedy output is unchanged and sampling stays
lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..generation.lookup import PromptLookup


@dataclass
class Draft:
    """The block drafter's proposal for B rows (stage 1 of a cycle)."""

    spine: torch.Tensor  # [B, K] token ids (greedy, or sampled from q when `q_logits` is set)
    confidences: torch.Tensor  # [B, K] float, c_k: top probability of position k's distribution
    logits: torch.Tensor  # [B, K, V or |columns|] the drafter's logits (processed where the spine was sampled)
    columns: torch.Tensor | None = None  # [|columns|] token id of each logits column (a draft vocabulary), or None
    q_logits: torch.Tensor | None = None  # [B, K, V] the processed q the spine was drawn from (a sampled chain)
    _read: dict = field(default_factory=dict, repr=False, compare=False)  # (depth, k) -> `on_host`'s answer

    def on_host(self, depth: int, k: int = 0) -> list[tuple[list[int], list[float], list[float], list[tuple]]]:
        """Per row: the spine's first `depth` drafts, their confidences c_1…c_d and chances c_1…c_i (products), and
        (k > 0) the k best own options (`_own_options`: score, depth, token), read from the device for every row at
        once: the draft stage's one host synchronisation, however many rows and paths use them."""
        if (depth, k) not in self._read:
            spine, confidences = self.spine[:, :depth], self.confidences[:, :depth].float()
            parts = [spine, confidences, confidences.cumprod(1)]
            if k:
                parts += list(_options(self.logits[:, :depth], spine, confidences, k, self.columns))
            d, n = depth, parts[-1].shape[1] if k else 0  # n options per row
            flat = torch.cat([part.double() for part in parts], 1).tolist()  # ids and float32 values are exact
            self._read[(depth, k)] = [
                ([int(t) for t in row[:d]], row[d : 2 * d], row[2 * d : 3 * d],
                 [(v, int(i), int(t)) for v, i, t in zip(row[3 * d : 3 * d + n], row[3 * d + n : 3 * d + 2 * n],
                                                         row[3 * d + 2 * n :])])
                for row in flat]
        return self._read[(depth, k)]


@dataclass
class Path:
    """Tokens after the anchor, with each prefix's chance of acceptance (non-increasing), or None if unknown."""

    tokens: list[int]
    chances: list[float] | None = None


def chain_paths(draft: Draft, row: int, depth: int) -> list[Path]:
    """The spine's first `depth` drafts, with their chances c_1…c_d."""
    spine, _, chances, _ = draft.on_host(depth)[row]
    return [Path(spine, chances)]


def own_tree_paths(draft: Draft, row: int, depth: int, k: int) -> list[Path]:
    """The spine and its k best runner-up swaps (`own_branches`), each continued with the spine's later drafts."""
    spine, chance, reach, options = draft.on_host(depth, k)[row]
    paths = [Path(spine, reach)]
    for value, i, token in options:
        chances = reach[:i] + [value]  # the spine's nodes above the swap, then the swapped node
        for d in range(i + 1, depth):
            chances.append(chances[-1] * chance[d])
        paths.append(Path(spine[:i] + [token] + spine[i + 1 :], chances))
    return paths


def lookup_paths(lookup: PromptLookup | None, depth: int) -> tuple[list[Path], tuple[list[int], int]]:
    """The prompt lookup's proposal as a path (none without a match) and the proposal itself, to learn from."""
    if lookup is None:
        return [], ([], 0)
    proposal, n = lookup.propose(depth)
    return ([Path(proposal, lookup.chances(n, len(proposal)))] if proposal else []), (proposal, n)


def vp_paths(draft: Draft, row: int, depth: int, prefixes: list[int], vp_logits: torch.Tensor, k: int,
             policy: str, columns: torch.Tensor | None) -> list[Path]:
    """D²SD: the spine and the VP drafter's branches at the boundaries `prefixes` (`top_prefixes`).

    vp_logits [len(prefixes), K, V or |columns|]: the VP drafter's logits for the rows `[anchor, t_1..t_i, mask...]`.
    """
    spine, confidences = draft.spine[row, :depth], draft.confidences[row, :depth].float()
    spine_list = spine.tolist()

    def tokens(picked: torch.Tensor) -> list[int]:
        return (picked if columns is None else columns[picked]).tolist()

    paths = [Path(spine_list)]
    if policy == "ranked":
        scores = boundary_scores(confidences)
        for j, i, token in ranked_branches(vp_logits, prefixes, spine, scores, k, columns):
            paths.append(Path(spine_list[:i] + [token] + tokens(vp_logits[j, i + 1 : depth].argmax(-1))))
        return paths
    for j, i in enumerate(prefixes):
        fill = tokens(vp_logits[j, i:depth].argmax(-1))
        if policy == "distinct" and fill[0] == spine_list[i]:
            fill[0] = tokens(vp_logits[j, i].topk(2).indices[1:])[0]
        paths.append(Path(spine_list[:i] + fill))
    return paths


def select_nodes(paths: list[Path], costs: dict[int, float] | None, overhead: float = 0.0) -> list[list[int]]:
    """The nodes of the union of `paths` to verify, as token paths from the anchor.

    Without `costs` (or if a path's chances are unknown), every path whole. Else the n likeliest nodes (a node on
    several paths counts its best chance; no node is likelier than its parent, so they form a tree): the cycle then
    commits 1 + the sum of their chances in expectation and costs `overhead` + costs[n + 1] (the anchor and n
    nodes in one verify), and n >= 1 is the one with the most tokens expected per second (as `throughput_length`
    picks a chain's), at most max(costs) - 1.

    Example: the spine with chances [0.9, 0.45] and a runner-up at the root with 0.08, costs {2: 10, 3: 11, 4: 16}
    (ms) -> 1.9/10, 2.35/11, 2.43/16 -> the spine's two drafts, no branch.
    """
    if costs is None or any(path.chances is None for path in paths):
        return [path.tokens for path in paths if path.tokens]
    kept: dict[tuple[int, ...], tuple[float, int]] = {}  # prefix -> (chance, depth)
    for path in paths:
        for d, value in enumerate(path.chances[: len(path.tokens)], start=1):
            key = tuple(path.tokens[:d])
            if key not in kept or value > kept[key][0]:
                kept[key] = (value, d)
    nodes = sorted(kept.items(), key=lambda item: (-item[1][0], item[1][1]))  # a tie puts the parent first
    nodes = nodes[: max(costs) - 1]
    expected, best, best_rate = 1.0, 0, -1.0  # at least one node, as a chain's cut keeps at least one draft
    for n, (_, (value, _)) in enumerate(nodes, start=1):
        expected += value
        rate = expected / (overhead + costs[n + 1])
        if rate > best_rate:
            best, best_rate = n, rate
    return [list(key) for key, _ in nodes[:best]]


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
    values, at, tokens = _options(logits[None], spine[None], confidences[None], k, columns)
    return list(zip(values[0].tolist(), at[0].tolist(), tokens[0].tolist()))


def _options(logits, spine, confidences, k, columns=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k best own options of each row, on the device: (scores, depths, token ids), each [B, k'], best first.
    logits [B, depth, V or |columns|], spine and confidences [B, depth]."""
    probs = logits.float().softmax(-1)  # [B, depth, C]
    _, depth, width = probs.shape
    if columns is None:
        is_spine = torch.zeros_like(probs, dtype=torch.bool).scatter_(2, spine[..., None].to(probs.device), True)
    else:
        is_spine = columns == spine[..., None]
    confidences = confidences.float()
    reach = torch.cat((confidences.new_ones(confidences.shape[0], 1), confidences[:, :-1].cumprod(1)), 1)  # c_1…c_i
    scores = (reach[..., None] * probs).masked_fill_(is_spine, -1.0).flatten(1)
    values, picked = scores.topk(min(k, depth * (width - 1)), dim=1)
    tokens = picked % width if columns is None else columns[picked % width]
    return values, picked // width, tokens


def throughput_tree(logits: torch.Tensor, spine: torch.Tensor, confidences: torch.Tensor, k: int,
                    costs: dict[int, float], overhead: float = 0.0, columns: torch.Tensor | None = None,
                    extra: tuple[tuple[list[int], list[float]], ...] = ()) -> list[list[int]]:
    """The drafter's own tree cut for throughput (`select_nodes` over the spine, its k best alternatives and the
    `extra` paths with their chances) for one row: logits [depth, V or |columns|] (row i predicts spine[i]),
    confidences [depth].

    Example: c = [0.9, 0.5], the root's runner-up at p 0.08, k 1, costs {2: 10, 3: 11, 4: 16} (ms) -> nodes 0.9,
    0.45, 0.08 (and 0.04 below it): 1.9/10, 2.35/11, 2.43/16 -> the spine's two drafts, no branch.
    """
    depth = logits.shape[0]
    draft = Draft(spine[None], confidences[None], logits[None], columns)
    paths = own_tree_paths(draft, 0, depth, k) + [Path(list(p), list(c)) for p, c in extra]
    return select_nodes([Path(p.tokens[:depth], p.chances[:depth]) for p in paths], costs, overhead)


def _column_of(columns: torch.Tensor, token: int) -> int | None:
    hit = (columns == token).nonzero()
    return int(hit[0, 0]) if hit.numel() else None
