"""Prompt lookup: find the longest earlier occurrence of the context's suffix (between
n_min and n_max tokens, prompt + output) and propose the k tokens that followed it.

The index maps every n-gram to the position after its most recent occurrence and is
extended only by the tokens added since the last proposal, so a step costs
O(new tokens × n-gram sizes), not O(context) as a rescan would.
"""

from __future__ import annotations

from .base import Draft


class _Index:
    def __init__(self, tokens: list[int], n_min: int, n_max: int):
        self.tokens = list(tokens)
        self.sizes = range(n_min, n_max + 1)
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending before this position are in the maps

    def catch_up(self) -> None:
        # An n-gram ending at `end` is indexed once a token follows it, so the live
        # suffix never matches itself.
        t = self.tokens
        for end in range(max(self.indexed, 1), len(t)):
            for n in self.sizes:
                if end >= n:
                    self.maps[n][tuple(t[end - n : end])] = end
        self.indexed = max(self.indexed, len(t))

    def lookup(self, k: int) -> list[int]:
        self.catch_up()
        t = self.tokens
        for n in reversed(self.sizes):
            if len(t) > n:
                pos = self.maps[n].get(tuple(t[-n:]))
                if pos is not None:
                    return t[pos : pos + k]
        return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, k: int = 8, n_min: int = 1, n_max: int = 4):
        if k < 1:
            raise ValueError(f"--k must be >= 1, got {k}")
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= --ngram-min <= --ngram-max, got {n_min} and {n_max}")
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.state: dict[str, _Index] = {}

    def begin(self, req: str, prompt_ids: list[int]) -> None:
        self.state[req] = _Index(prompt_ids, self.n_min, self.n_max)

    def propose(self, req: str, budget: int) -> Draft:
        return Draft.chain(self.state[req].lookup(min(self.k, budget)))

    def observe(self, req: str, emitted_ids: list[int]) -> None:
        self.state[req].tokens.extend(emitted_ids)

    def end(self, req: str) -> None:
        self.state.pop(req, None)
