"""The engine's typed state: the rows as `generate()` sees them, and what each stage of a cycle hands the next.

A cycle is draft (`proposers.Draft`) -> trees (one `TokenTree` per row; a chain is a one-path tree) -> `Verify`
(one target forward over every row's nodes) -> `Outcome` (accept, on the device) -> `Walk` per row (read) -> commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .tree import TokenTree


def host_stop(criteria) -> tuple[int | None, frozenset[int]] | None:
    """(max length, EOS ids) when every criterion in `criteria` is transformers' `MaxLengthCriteria` or
    `EosTokenCriteria`, whose answers follow from a row's length and last token, so the host can give them without
    reading the device; None for any other criterion (stop strings, a user's own), which is then called."""
    limit, eos = None, set()
    for criterion in criteria:
        if type(criterion) is MaxLengthCriteria:
            limit = criterion.max_length if limit is None else min(limit, criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos.update(torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
        else:
            return None
    return limit, frozenset(eos)


def lay_out(input_ids: torch.Tensor, generated, pad_token_id: int) -> torch.Tensor:
    """Sequences as plain `generate()` returns them: each (left-padded) prompt row, its generated tokens
    (a list or tensor per row), then `pad_token_id` up to the longest row."""
    b, p = input_ids.shape
    out = input_ids.new_full((b, p + max(len(g) for g in generated)), pad_token_id)
    out[:, :p] = input_ids
    for i, g in enumerate(generated):
        out[i, p : p + len(g)] = torch.as_tensor(g, dtype=input_ids.dtype, device=input_ids.device)
    return out


class _ForRow:
    """`generate()`'s logits processors applied to row `row` of a batch of `batch` rows.

    Some processors keep per-row state (repetition penalty ignores each row's left padding through a
    [batch] tensor), so they are called on `batch` copies of the row and row `row` is read back.
    Iterable as a one-element list, as `choose_tokens` expects.
    """

    def __init__(self, processors, row: int, batch: int):
        self.processors, self.row, self.batch = processors, row, batch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.batch == 1:
            return self.processors(input_ids, scores)
        out = self.processors(input_ids.expand(self.batch, -1), scores.expand(self.batch, -1).clone())
        return out[self.row : self.row + 1]

    def __iter__(self):
        yield self


@dataclass
class Rows:
    """The B rows as plain `generate()` lays them out (left-padded prompt + committed tokens), and their stopping.

    Plain `generate()` pads a row that has stopped only when it stops on an EOS criterion; without one (no
    `eos_token_id`), a batch's stopped rows go on decoding until every row has stopped, and all rows end at that
    length. `pad_finished=False` does the same: a row's stop is recorded (`stops`), it stays active, and once every
    row has stopped the rows are cut (or run on) to the longest stop.
    """

    prompt: torch.Tensor  # [B, P] left-padded prompt, as given
    generated: list[list[int]]  # tokens committed per row
    finished: list[bool]  # the row needs no more tokens
    pad_finished: bool = True
    stops: list[int | None] | None = None  # without padding: each row's length when it first stopped
    _host_stop: tuple = field(default=(None, None), repr=False)  # (criteria, `host_stop(criteria)`) last seen

    @classmethod
    def start(cls, prompt: torch.Tensor, pad_finished: bool = True) -> "Rows":
        b = prompt.shape[0]
        return cls(prompt, [[] for _ in range(b)], [False] * b, pad_finished, [None] * b)

    @property
    def length(self) -> int | None:
        """Without padding, once every row has stopped: the length every row ends at."""
        if self.pad_finished or any(stop is None for stop in self.stops):
            return None
        return max(self.stops)

    def sequence(self, b: int, extra: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """Row b as plain generate() sees it: [1, P + generated (+ extra)]."""
        parts = [self.prompt[b], self.prompt.new_tensor(self.generated[b])]
        if extra is not None and len(extra):
            parts.append(torch.as_tensor(extra, dtype=self.prompt.dtype, device=self.prompt.device))
        return torch.cat(parts)[None]

    def processors_for(self, processors, b: int) -> _ForRow | None:
        return _ForRow(processors, b, self.prompt.shape[0]) if processors else None

    def commit(self, b: int, tokens: list[int], scores: torch.Tensor, stopping_criteria) -> int:
        """Append tokens to row b one by one until a stopping criterion fires; returns how many.

        scores [len(tokens), V]: the target's (processed) logits each token was chosen from. The criteria see each
        prefix as plain `generate()` would, one token at a time; their answers are read back together, once."""
        fired = [False] * len(tokens)
        if self.stops[b] is None and stopping_criteria is not None and tokens:
            if self._host_stop[0] is not stopping_criteria:
                self._host_stop = stopping_criteria, host_stop(stopping_criteria)
            start = self.prompt.shape[1] + len(self.generated[b])
            on_host = self._host_stop[1]
            if on_host is not None:  # length and EOS only: answered here, nothing read back
                limit, eos = on_host
                fired = [(limit is not None and start + j + 1 >= limit) or token in eos
                         for j, token in enumerate(tokens)]
            else:
                row = self.sequence(b, tokens)
                fired = torch.cat([stopping_criteria(row[:, : start + j + 1], scores[j][None])[:1]
                                   for j in range(len(tokens))]).tolist()
        for j, token in enumerate(tokens):
            self.generated[b].append(token)
            if self.stops[b] is None and fired[j]:
                self.stops[b] = len(self.generated[b])
                if self.pad_finished:
                    self.finished[b] = True
                    return j + 1
        if self.length is not None:
            self.finished = [len(g) >= self.length for g in self.generated]
        return len(tokens)

    def outputs(self) -> list[list[int]]:
        """Each row's tokens as plain `generate()` returns them (before the padding `lay_out` adds)."""
        if self.length is None:
            return self.generated
        return [g[: self.length] for g in self.generated]


@dataclass
class Batch:
    """The rows the engine's batch holds, slot by slot: slot b is row `index[b]` of `rows`. Rows that stop leave the
    batch (`Engine.compact`), so the slots are the rows still decoding; `rows` keeps every row's tokens."""

    rows: Rows
    index: list[int]  # the row of each slot

    @classmethod
    def of(cls, rows: Rows) -> "Batch":
        return cls(rows, list(range(rows.prompt.shape[0])))

    @property
    def finished(self) -> list[bool]:
        return [self.rows.finished[r] for r in self.index]

    def sequence(self, b: int, extra: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        return self.rows.sequence(self.index[b], extra)

    def processors_for(self, processors, b: int) -> _ForRow | None:
        return self.rows.processors_for(processors, self.index[b])

    def commit(self, b: int, tokens: list[int], scores: torch.Tensor, stopping_criteria) -> int:
        return self.rows.commit(self.index[b], tokens, scores, stopping_criteria)

    def keep(self, slots: list[int]) -> None:
        self.index = [self.index[b] for b in slots]


@dataclass
class Verify:
    """One target forward over every row's tree (stage 2), padded to the widest tree with nodes no path reaches."""

    ids: torch.Tensor  # [B, N] node tokens (node 0: the anchor)
    positions: torch.Tensor  # [B, N] anchor position + depth
    allowed: torch.Tensor | None  # [B, N, N] bool, node i may see node j (ancestry); None: every row a full chain
    trees: list[TokenTree]
    parents: torch.Tensor  # [B, N] each node's parent (-1: the anchor, and padding, which no path reaches)
    depths: torch.Tensor  # [B, N] each node's depth (the anchor's: 0)

    @classmethod
    def of(cls, trees: list[TokenTree], anchor_pos: torch.Tensor) -> "Verify":
        """Pad the trees to a batch; a chain batch (every tree one path of the same length) needs no tree mask."""
        n = max(len(tree) for tree in trees)
        chain = all(len(tree) == n and tree.depths == list(range(n)) for tree in trees)
        ids, positions, allowed = _pad(trees, anchor_pos, n, mask=not chain)
        parents = torch.tensor([tree.parents + [-1] * (n - len(tree)) for tree in trees], device=ids.device)
        return cls(ids, positions, allowed, trees, parents, positions - anchor_pos[:, None])

    @property
    def depth(self) -> int:
        """Nodes on the longest path of any row's tree (the anchor included): how long an accepted path can be."""
        return max(max(tree.depths) for tree in self.trees) + 1

    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: node j is node i or one of its ancestors."""
        if self.allowed is not None:
            return self.allowed
        n = self.ids.shape[1]
        return torch.ones(n, n, dtype=torch.bool, device=self.ids.device).tril().expand(self.ids.shape[0], n, n)

    def padded(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions [B, width], allowed [B, width, width]): the trees padded to `width` (a compiled verify's),
        with the mask spelled out for chains too."""
        return _pad(self.trees, self.positions[:, 0], width, mask=True)


@dataclass
class PathRows:
    """A tree verify on a target whose layers keep a recurrent or conv state, or whose attention takes no tree mask:
    each root-to-leaf path of every row's tree becomes a row of its own, a chain, so each layer steps every path's
    tokens one after another as plain decoding would, from the state the path's row had (a shared prefix is run once
    per path through it).

    Node j of row b is read at `where[b, j]` = path row * width + depth, in the first path through it; a padding
    node at the anchor of the row's first path."""

    source: torch.Tensor  # [R] the batch row each path row comes from
    ids: torch.Tensor  # [R, width] each path's tokens from the anchor, padded by repeating its last token
    positions: torch.Tensor  # [R, width]
    where: torch.Tensor  # [B, N] path row * width + depth of each node
    width: int

    @classmethod
    def of(cls, verify: Verify) -> "PathRows":
        source, paths, where = [], [], []
        n = verify.ids.shape[1]
        for b, tree in enumerate(verify.trees):
            first, seen = len(paths), [None] * n
            for leaf in tree.leaves():
                path = tree.nodes_to(leaf)
                for depth, node in enumerate(path):
                    if seen[node] is None:
                        seen[node] = (len(paths), depth)
                source.append(b)
                paths.append([tree.tokens[node] for node in path])
            where.append([(first, 0) if at is None else at for at in seen])
        width = max(len(path) for path in paths)
        device = verify.ids.device
        ids = torch.tensor([path + path[-1:] * (width - len(path)) for path in paths], device=device)
        source_t = torch.tensor(source, device=device)
        positions = verify.positions[source_t, :1] + torch.arange(width, device=device)
        flat = torch.tensor([[r * width + d for r, d in row] for row in where], device=device)
        return cls(source_t, ids, positions, flat, width)

    def nodes(self, per_path: torch.Tensor) -> torch.Tensor:
        """[R, width, ...] per path position -> [B, N, ...] per tree node."""
        flat = per_path.reshape(-1, *per_path.shape[2:])
        return flat[self.where.flatten()].view(*self.where.shape, *per_path.shape[2:])

    def rows_of(self, last: torch.Tensor) -> torch.Tensor:
        """[B] the path row holding each row's node `last` [B]: the row whose states and K/V the batch row keeps."""
        return self.where.gather(1, last[:, None])[:, 0] // self.width


def _pad(trees: list[TokenTree], anchor_pos: torch.Tensor, n: int, mask: bool):
    """(ids, positions, allowed or None) of `trees` padded to n nodes each: a padding node holds the anchor at the
    anchor's position and sees itself only, so no path reaches it and it changes nothing."""
    device = anchor_pos.device
    ids = torch.tensor([tree.tokens + tree.tokens[:1] * (n - len(tree)) for tree in trees], device=device)
    depths = torch.tensor([tree.depths + [0] * (n - len(tree)) for tree in trees], device=device)
    allowed = None
    if mask:
        allowed = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
        for b, tree in enumerate(trees):
            allowed[b, : len(tree), : len(tree)] = tree.ancestor_mask()
        allowed = allowed.to(device)
    return ids, anchor_pos[:, None] + depths, allowed


@dataclass
class Outcome:
    """Every row's accepted path, on the device (stage 3), before anything of it is read."""

    length: torch.Tensor  # [B] nodes on the path, the anchor included: the tokens the row commits
    nodes: torch.Tensor  # [B, D] the path's node at each depth (0 past its end); D: the deepest tree's nodes + 1
    tokens: torch.Tensor  # [B, D] the target's token after each of those nodes: the accepted drafts, then one more
    logits: torch.Tensor  # [B, N, V] the (processed) logits the tokens were chosen from


@dataclass
class Walk:
    """One row's outcome of the cycle (stage 3): the target's tokens and the tree nodes they were read at."""

    tokens: list[int]  # the accepted drafts, then the recovered or bonus token
    path: list[int]  # nodes of the accepted path, starting with the anchor (node 0); len(path) == len(tokens)
    scores: torch.Tensor  # [len(tokens), V] the target's logits each token was chosen from (processed if any)
