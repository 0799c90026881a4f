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

import itertools
from dataclasses import dataclass, field

import torch

from .lookup import PromptLookup


@dataclass
class Draft:
    """The block drafter's proposal for B rows (stage 1 of a cycle)."""

    spine: torch.Tensor  # [B, K] token ids (greedy, or sampled from q when `q_logits` is set)
    confidences: torch.Tensor  # [B, K] float, c_k: top probability of position k's distribution
    logits: torch.Tensor  # [B, K, V or |columns|] the drafter's logits (processed where the spine was sampled)
    columns: torch.Tensor | None = None  # [|columns|] token id of each logits column (a draft vocabulary), or None
    q_logits: torch.Tensor | None = None  # [B, K, V] the processed q the spine was drawn from (a sampled chain)
    _read: dict = field(default_factory=dict, repr=False, compare=False)  # k -> every row's read, all K positions

    def on_host(self, depth: int, k: int = 0) -> list[tuple[list[int], list[float], list[float], list[tuple]]]:
        """Per row: the spine's first `depth` drafts, their confidences c_1…c_d and chances c_1…c_i (products), and
        (k > 0) the k best own options above `depth` (`own_branches`, with scores: score, depth, token; best first).
        Read from the device for every row, every depth and path at once (each position's k best options come along,
        so any depth finds its k best among them), unless `read_with` brought it along with another read."""
        if k not in self._read:
            self.read_with(k)
        return [(spine[:depth], confidences[:depth], chances[:depth],
                 sorted((o for o in options if o[1] < depth), key=lambda o: -o[0])[:k])  # stable: ties to shallower
                for spine, confidences, chances, options in self._read[k]]

    def read_with(self, k: int, extra: torch.Tensor | None = None) -> list[list[float]]:
        """Read what `on_host(..., k)` serves, and `extra` [B, E] (ids or float32 values, returned per row as floats)
        in the same transfer: one host synchronisation for both."""
        spine, confidences = self.spine, self.confidences.float()
        d, each = spine.shape[1], 0  # each: options per position
        parts = [] if extra is None else [extra]
        parts += [spine, confidences, confidences.cumprod(1)]
        if k:
            values, tokens = _position_options(self.logits, spine, confidences, k, self.columns)  # [B, K, k']
            each = values.shape[2]
            parts += [values.flatten(1), tokens.flatten(1)]
        flat = torch.cat([part.double() for part in parts], 1).tolist()  # ids and float32 values are exact
        e = 0 if extra is None else extra.shape[1]
        n = d * each  # options per row
        self._read[k] = [
            ([int(t) for t in row[e : e + d]], row[e + d : e + 2 * d], row[e + 2 * d : e + 3 * d],
             [(v, j // each, int(t)) for j, (v, t) in enumerate(zip(row[e + 3 * d : e + 3 * d + n],
                                                                    row[e + 3 * d + n :]))])
            for row in flat]
        return [row[:e] for row in flat]

    def select(self, slots: list[int]) -> "Draft":
        """The draft of the rows `slots` (a batch that lost rows), with what was read of them."""
        index = torch.tensor(slots, device=self.spine.device)
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Draft(self.spine[index], self.confidences[index], self.logits[index], self.columns,
                     pick(self.q_logits), {k: [rows[b] for b in slots] for k, rows in self._read.items()})


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


def vp_paths(spine: list[int], confidences: list[float], depth: int, prefixes: list[int], options: tuple, k: int,
             policy: str) -> list[Path]:
    """D²SD: the spine and the VP drafter's branches at the boundaries `prefixes` (`top_prefixes`), for one row.

    spine and confidences: the row's drafts and c_1.. on the host (`Draft.on_host`); options: the row's
    `vp_options` read back (values [m][k'], tokens [m][k'], rest [m], fills [m][K]).
    """
    values, tokens, rest, fills = options
    paths = [Path(spine[:depth])]
    if policy == "ranked":
        scores = _boundary_scores(confidences[:depth])
        for j, i, token in _ranked(values, tokens, rest, prefixes, scores, k):
            paths.append(Path(spine[:i] + [token] + fills[j][i + 1 : depth]))
        return paths
    for j, i in enumerate(prefixes):
        fill = fills[j][i:depth]
        if policy == "distinct" and fill[0] == spine[i]:
            fill[0] = tokens[j][0]  # its likeliest token other than the spine's
        paths.append(Path(spine[:i] + fill))
    return paths


def likeliest(paths: list[Path]) -> Path:
    """The path expected to keep the most tokens (the sum of its chances; unknown chances count as none)."""
    return max(paths, key=lambda path: sum(path.chances[: len(path.tokens)]) if path.chances else 0.0)


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
    return confidences.new_tensor(_boundary_scores(confidences.float().tolist()))


def top_prefixes(confidences: torch.Tensor | list[float], k: int) -> list[int]:
    """The k most likely rejection boundaries (prefix lengths i), ascending; of boundaries as likely, the deeper
    (its branches are shorter)."""
    values = confidences.float().tolist() if isinstance(confidences, torch.Tensor) else list(confidences)
    scores = _boundary_scores(values)
    return sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], -i))[: min(k, len(scores))])


def _boundary_scores(confidences: list[float]) -> list[float]:
    """`boundary_scores` on host lists."""
    scores, kept = [], 1.0
    for c in confidences:
        scores.append(kept * (1 - c))
        kept *= c
    return scores


def ranked_branches(vp_logits: torch.Tensor, prefixes: list[int], spine: torch.Tensor, scores: torch.Tensor,
                    k: int, columns: torch.Tensor | None = None) -> list[tuple[int, int, int]]:
    """The k best (row j, boundary i, first token) branch starts over all boundaries, best first.

    A branch that leaves the spine at boundary i with token a pays off when the spine is rejected
    there (r(i)) and a is the target's token; given the rejection, the VP drafter's belief in a is
    q(a) / (1 - q(spine token)). Several branches may leave at one boundary; each continues with the
    VP drafter's argmax after its first token.

    vp_logits [m, K, V or |columns|]; `columns` gives the token id of each column of compact logits
    (`DraftVocab.ids`); None = the columns are the vocabulary. A spine token outside those columns has q = 0 there.

    Example: r = [0.8, 0.1], VP beliefs at boundary 0 beyond the spine's token 0.5, 0.3, at boundary
    1 0.9 -> scores 0.4, 0.24, 0.09: two branches at the root before one at depth 1.
    """
    values, tokens, rest, _ = vp_options(vp_logits[None], [prefixes], spine[None], k, columns)
    return _ranked(values[0].tolist(), tokens[0].tolist(), rest[0].tolist(), prefixes, scores.tolist(), k)


def vp_options(vp_logits: torch.Tensor, prefixes: list[list[int]], spine: torch.Tensor, k: int,
               columns: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """What the VP drafter offers at each row's boundaries, on the device, for one read: vp_logits [B, m, K, C] (row
    j of b re-drafted from boundary prefixes[b][j]), spine [B, K] token ids. Returns its k' best first tokens other
    than the spine's at each boundary and their probabilities (tokens, values [B, m, k']), 1 - its probability of
    the spine's token there (rest [B, m], at least 1e-6) and its argmax token at every position (fills [B, m, K])."""
    b, m, _, width = vp_logits.shape
    at = torch.tensor(prefixes, device=vp_logits.device)  # [B, m]
    q = vp_logits.gather(2, at[:, :, None, None].expand(b, m, 1, width))[:, :, 0].float().softmax(-1)  # [B, m, C]
    spine_tokens = spine.gather(1, at)  # [B, m]
    if columns is None:
        is_spine = torch.zeros_like(q, dtype=torch.bool).scatter_(2, spine_tokens[..., None], True)
    else:
        is_spine = columns == spine_tokens[..., None]  # all False where the spine's token is not a column
    rest = (1 - (q * is_spine).sum(-1)).clamp_min(1e-6)
    values, picked = q.masked_fill(is_spine, 0.0).topk(min(k, width), dim=-1)
    fills = vp_logits.argmax(-1)
    if columns is not None:
        picked, fills = columns[picked], columns[fills]
    return values, picked, rest, fills


def options_on_host(options: tuple[torch.Tensor, ...]) -> list[tuple]:
    """`vp_options` read back in one transfer, per row: (values [m][k'], tokens [m][k'], rest [m], fills [m][K]) as
    lists."""
    values, tokens, rest, fills = options
    b, m = rest.shape
    flat = torch.cat([t.double().reshape(b, -1) for t in options], 1).tolist()  # ids and float32 values are exact
    k, width = values.shape[2], fills.shape[2]
    ends = list(itertools.accumulate((m * k, m * k, m, m * width)))
    out = []
    for row in flat:
        v, t, r, f = row[: ends[0]], row[ends[0] : ends[1]], row[ends[1] : ends[2]], row[ends[2] :]
        out.append(([v[j * k : (j + 1) * k] for j in range(m)],
                    [[int(x) for x in t[j * k : (j + 1) * k]] for j in range(m)],
                    r,
                    [[int(x) for x in f[j * width : (j + 1) * width]] for j in range(m)]))
    return out


def _ranked(values: list[list[float]], tokens: list[list[int]], rest: list[float], prefixes: list[int],
            scores: list[float], k: int) -> list[tuple[int, int, int]]:
    """`ranked_branches` on the host, from one row's `vp_options` and boundary scores r(i)."""
    options = [(scores[i] * v / rest[j], j, i, t) for j, i in enumerate(prefixes)
               for v, t in zip(values[j], tokens[j])]
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
    options = Draft(spine[None], confidences[None], logits[None], columns).on_host(spine.shape[0], k)[0][3]
    return [(i, token) for _, i, token in options]


def _position_options(logits, spine, confidences, k, columns=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best own options at each position of each row, on the device: (scores, token ids), each [B, depth, k']
    (a row's k best above any depth are among them)."""
    scores = _option_scores(logits, spine, confidences, columns)
    values, picked = scores.topk(min(k, scores.shape[2] - 1), dim=2)
    return values, picked if columns is None else columns[picked]


def _option_scores(logits, spine, confidences, columns=None) -> torch.Tensor:
    """Each alternative's score (c_1…c_i)·p(a) at each depth i, the spine's own token at -1: [B, depth, C] for
    logits [B, depth, V or |columns|], spine (token ids) and confidences [B, depth]."""
    probs = logits.float().softmax(-1)  # [B, depth, C]
    if columns is None:
        is_spine = torch.zeros_like(probs, dtype=torch.bool).scatter_(2, spine[..., None].to(probs.device), True)
    else:
        is_spine = columns == spine[..., None]
    confidences = confidences.float()
    reach = torch.cat((confidences.new_ones(confidences.shape[0], 1), confidences[:, :-1].cumprod(1)), 1)  # c_1…c_i
    return (reach[..., None] * probs).masked_fill_(is_spine, -1.0)


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
