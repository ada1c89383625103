"""The Drafter protocol and the Draft it proposes.

A draft is a tree of candidate tokens hanging off the root (the last emitted token):
`parents[i]` is the index of node i's parent, -1 for a child of the root; a chain has
parents[i] == i - 1. `q` optionally holds each node's draft distribution [n, V]; a
drafter without probabilities (n-gram, suffix) leaves it None and is treated as a point
mass, which keeps sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None

    @classmethod
    def chain(cls, tokens: list[int], q: torch.Tensor | None = None) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    """Drafters own their per-request state, keyed by request id."""

    name: str

    def begin(self, req: str, prompt_ids: list[int]) -> None: ...

    def propose(self, req: str, budget: int) -> Draft:
        """At most `budget` nodes continuing the request's current output."""
        ...

    def observe(self, req: str, emitted_ids: list[int]) -> None:
        """Tokens the target emitted this step (accepted drafts + bonus)."""
        ...

    def end(self, req: str) -> None: ...


def check_int(flag: str, value, low: int, why: str = "") -> None:
    """A drafter option that must be an integer >= low (bool is not an integer here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{flag} must be an integer >= {low}{why}, got {value!r}")
