"""Prompt lookup as one more branch of a token tree.

Much of what a model writes repeats its context: code restates the signature and docstring it was asked to
complete, an answer quotes the numbers of its question. `PromptLookup` proposes, at each cycle, the tokens that
followed the latest earlier occurrence of the sequence's last n tokens (the longest n ≤ `max_ngram` that has
one), a path from the anchor that the drafter may not rank at all. It joins the drafter's tree
(`throughput_tree(..., extra=...)`), so the target verifies it in the same forward, and costs no model pass.

To be weighed against the drafter's nodes, each of its nodes needs a chance of acceptance. `PromptLookup`
learns it during the generation, per match length n and depth d, from the target's own tokens: the chance
that the lookup's first d tokens are all accepted is the product of the rates at which its token at depth j
was right when the j - 1 before it were (j ≤ d), each rate a running count started from a prior of
`prior_rate` worth `prior_weight` observations. A depth the cycle did not reach (the walk stopped earlier) is not
counted. The tree depends only on committed tokens, so greedy output is unchanged and sampling stays lossless.

Example: the sequence [5, 6, 7, 9, 5, 6] ends with the 2-gram [5, 6], last seen at positions 0-1, so the lookup
proposes [7, 9, 5, 6], with n = 2, and after it, if `max_tokens` allows, what it copied again: [7, 9, 5, 6, 7, 9]
(the sequence in a loop of period 4 continues that loop).
"""

from __future__ import annotations


class PromptLookup:
    """N-gram lookup over one row's tokens (prompt + committed), with acceptance rates learnt as it decodes."""

    def __init__(self, tokens: list[int], max_ngram: int = 4, prior_rate: float = 0.5, prior_weight: float = 2.0):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be at least 1, got {max_ngram}.")
        self.tokens: list[int] = []
        self.max_ngram, self.prior_rate, self.prior_weight = max_ngram, prior_rate, prior_weight
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token, latest occurrence
        self._indexed = 0  # n-grams ending before this index are in `_last`
        self._hits: dict[tuple[int, int], int] = {}  # (n, depth) -> times right when the tokens before were
        self._trials: dict[tuple[int, int], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens."""
        self.tokens.extend(tokens)

    def _index(self) -> None:
        # Every n-gram ending before the last token; those ending at it are the suffix being looked up.
        for end in range(self._indexed, len(self.tokens) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self._last[tuple(self.tokens[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def propose(self, max_tokens: int) -> tuple[list[int], int]:
        """`max_tokens` tokens that continue the longest suffix n-gram seen before, and n; ([], 0) if none."""
        self._index()
        for n in range(min(self.max_ngram, len(self.tokens)), 0, -1):
            end = self._last.get(tuple(self.tokens[-n:]))
            if end is not None:
                # Copy from after the match on; a copy that reaches the end goes on with what it copied (a loop).
                out, start = [], end + 1
                for j in range(start, start + max_tokens):
                    out.append(self.tokens[j] if j < len(self.tokens) else out[j - len(self.tokens)])
                return out, n
        return [], 0

    def chances(self, n: int, length: int) -> list[float]:
        """The learnt chance that the first d tokens of an n-gram match's proposal are accepted, d = 1..length."""
        out, chance = [], 1.0
        for depth in range(1, length + 1):
            key = (n, depth)
            rate = (self._hits.get(key, 0) + self.prior_rate * self.prior_weight) / (
                self._trials.get(key, 0) + self.prior_weight)
            chance *= rate
            out.append(chance)
        return out

    def record(self, proposal: list[int], n: int, target_tokens: list[int]) -> None:
        """Count how a proposal fared against the target's tokens of the cycle (those after the anchor that the
        target decided: the accepted path and its correction or bonus token)."""
        for depth, (proposed, actual) in enumerate(zip(proposal, target_tokens), start=1):
            key = (n, depth)
            self._trials[key] = self._trials.get(key, 0) + 1
            if proposed != actual:
                return
            self._hits[key] = self._hits.get(key, 0) + 1
