"""Token trees: candidate continuations that share prefixes, verified by one target forward.

Node 0 is the anchor (the last committed token, not yet run through the target); every other node is
a drafted token whose parent comes earlier in the order, so a node's ancestors always precede it. A
query attends to the committed prefix and to its own ancestors (itself included), at position
`anchor_position + depth`: exactly what the target would see if that branch were fed alone.

Example: candidates [[5, 7], [5, 9], [6]] after anchor a give nodes a, 5, 7, 9, 6 with parents
-1, 0, 1, 1, 0 and depths 0, 1, 2, 2, 1 (the shared 5 is stored once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    tokens: list[int]  # node -> token id (node 0: the anchor)
    parents: list[int]  # node -> parent node (-1 for the anchor)
    depths: list[int]  # node -> distance from the anchor
    children: list[dict[int, int]] = field(default_factory=list)  # node -> {token: child node}

    @classmethod
    def from_candidates(cls, anchor: int, candidates: Sequence[Sequence[int]]) -> "TokenTree":
        """A trie of the candidate continuations (each a list of token ids after the anchor)."""
        tree = cls([anchor], [-1], [0], [{}])
        for candidate in candidates:
            node = 0
            for token in candidate:
                token = int(token)
                child = tree.children[node].get(token)
                if child is None:
                    child = len(tree.tokens)
                    tree.tokens.append(token)
                    tree.parents.append(node)
                    tree.depths.append(tree.depths[node] + 1)
                    tree.children.append({})
                    tree.children[node][token] = child
                node = child
        return tree

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[N, N] bool, True where query node i may attend to key node j (j is i or an ancestor of i)."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask.to(device)

    def nodes_to(self, node: int) -> list[int]:
        """The nodes from the anchor (node 0) down to `node`, both included."""
        nodes = [node]
        while node > 0:
            node = self.parents[node]
            nodes.append(node)
        return nodes[::-1]

    def path(self, node: int) -> list[int]:
        """Tokens from the anchor's first child down to `node` (empty for the anchor)."""
        return [self.tokens[n] for n in self.nodes_to(node)[1:]]

    def leaves(self) -> list[int]:
        """The nodes no other node descends from: each ends one root-to-leaf path."""
        return [node for node, below in enumerate(self.children) if not below]


def walk_tree(
    tree: TokenTree,
    choose: Callable[[int], int],
) -> tuple[list[int], list[int]]:
    """Follow the target down the tree.

    `choose(node)` returns the target's token after `node` (its argmax, or a sample from its processed
    distribution). While that token is a child of the current node, move there; the first token that
    is not is the recovered/bonus token. Every output token is drawn from the target's conditional
    given the path so far, so the walk is exact for greedy decoding and lossless for sampling
    ("sample, then match").

    Returns (output tokens, nodes on the accepted path starting with the anchor); both have the same
    length: the anchor and the accepted drafts, then one token more than accepted drafts.
    """
    node, output, path = 0, [], [0]
    while True:
        token = choose(node)
        output.append(token)
        child = tree.children[node].get(token)
        if child is None:
            return output, path
        node = child
        path.append(child)
