"""Replays a known continuation (by default the target's own greedy output) as the draft,
corrupting each drafted token with probability 1 - alpha. At alpha = 1 it is the perfect
drafter: the ceiling any real drafter could reach with this k on this verify step."""

from __future__ import annotations

import random

from .base import Draft


class OracleDrafter:
    name = "oracle"

    def __init__(self, references: dict[str, list[int]], vocab_size: int, k: int = 8, alpha: float = 1.0,
                 seed: int = 0):
        if k < 1:
            raise ValueError(f"--k must be >= 1, got {k}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"--oracle-alpha must be in [0, 1], got {alpha}")
        self.references, self.k, self.alpha, self.vocab_size = references, k, alpha, vocab_size
        self.rng = random.Random(seed)
        self.emitted: dict[str, int] = {}

    def begin(self, req: str, prompt_ids: list[int]) -> None:
        if req not in self.references:
            raise KeyError(f"oracle has no reference continuation for request '{req}'")
        self.emitted[req] = 0

    def propose(self, req: str, budget: int) -> Draft:
        n = self.emitted[req]
        tokens = self.references[req][n : n + min(self.k, budget)]
        return Draft.chain([t if self.rng.random() < self.alpha else self._other(t) for t in tokens])

    def _other(self, token: int) -> int:
        return (token + self.rng.randrange(1, self.vocab_size)) % self.vocab_size

    def observe(self, req: str, emitted_ids: list[int]) -> None:
        self.emitted[req] += len(emitted_ids)

    def end(self, req: str) -> None:
        self.emitted.pop(req, None)
