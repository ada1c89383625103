"""Prompt lookup: find earlier occurrences of the context's suffix (the longest that
matches, between n_min and n_max tokens, over prompt + output) and propose the k tokens
that followed. With branches > 1 the most recent distinct continuations become the
branches of a draft tree.

The index maps every n-gram to the positions after its most recent occurrences and is
extended only by the tokens added since the last proposal, so a step costs
O(new tokens × n-gram sizes), not O(context) as a rescan would.
"""

from __future__ import annotations

from .base import Draft


class _Index:
    def __init__(self, tokens: list[int], n_min: int, n_max: int, branches: int):
        self.tokens = list(tokens)
        self.sizes = range(n_min, n_max + 1)
        self.branches = branches
        # One map for every size (tuples of different lengths never collide). With one
        # branch a key maps to the position after its latest occurrence, a plain int
        # overwritten in place; with more, to the newest `branches` positions, newest first.
        self.map: dict[tuple[int, ...], int | list[int]] = {}
        self.indexed = 1  # n-grams ending before this position are in the map

    def catch_up(self) -> None:
        # An n-gram ending at `end` is indexed once a token follows it, so the live
        # suffix never matches itself.
        t, m, sizes, branches = self.tokens, self.map, self.sizes, self.branches
        for end in range(self.indexed, len(t)):
            for n in sizes:
                if n > end:
                    break
                key = tuple(t[end - n : end])
                if branches == 1:
                    m[key] = end  # ends ascend: the latest occurrence wins
                    continue
                recent = m.get(key)
                if recent is None:
                    m[key] = [end]
                else:
                    recent.insert(0, end)
                    del recent[branches:]
        self.indexed = max(self.indexed, len(t))

    def continuations(self, k: int) -> list[list[int]]:
        """Up to `branches` continuations of the longest matching suffix, newest first."""
        self.catch_up()
        t, m = self.tokens, self.map
        for n in reversed(self.sizes):
            if len(t) > n:
                ends = m.get(tuple(t[-n:]))
                if ends is not None:
                    return [t[ends : ends + k]] if self.branches == 1 else [t[e : e + k] for e in ends]
        return []


def trie_draft(sequences: list[list[int]], budget: int) -> Draft:
    """Merge token sequences that share prefixes into one tree of at most `budget` nodes."""
    draft = Draft()
    child: dict[tuple[int, int], int] = {}  # (parent node, token) → node
    for seq in sequences:
        parent = -1
        for token in seq:
            node = child.get((parent, token))
            if node is None:
                if len(draft.tokens) >= budget:
                    break
                node = child[(parent, token)] = len(draft.tokens)
                draft.tokens.append(token)
                draft.parents.append(parent)
            parent = node
    return draft


class NgramDrafter:
    name = "ngram"

    def __init__(self, k: int = 8, n_min: int = 1, n_max: int = 4, branches: int = 1):
        if k < 1:
            raise ValueError(f"--k must be >= 1, got {k}")
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= --ngram-min <= --ngram-max, got {n_min} and {n_max}")
        if branches < 1:
            raise ValueError(f"--branches must be >= 1, got {branches}")
        self.k, self.n_min, self.n_max, self.branches = k, n_min, n_max, branches
        self.state: dict[str, _Index] = {}

    def begin(self, req: str, prompt_ids: list[int]) -> None:
        self.state[req] = index = _Index(prompt_ids, self.n_min, self.n_max, self.branches)
        index.catch_up()  # index the prompt now, with the prefill, not on the first decode step

    def propose(self, req: str, budget: int) -> Draft:
        found = self.state[req].continuations(min(self.k, budget))
        return trie_draft(found, budget) if len(found) > 1 else Draft.chain(found[0] if found else [])

    def observe(self, req: str, emitted_ids: list[int]) -> None:
        self.state[req].tokens.extend(emitted_ids)

    def end(self, req: str) -> None:
        self.state.pop(req, None)
