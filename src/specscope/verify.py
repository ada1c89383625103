"""Acceptance of a draft tree against the target's logits.

Verify convention (DESIGN.md): the forward fed [root] + draft nodes, so logits row 0
scores the root's children and row i + 1 the children of node i; the bonus token is
drawn from the row of the last accepted node. A chain is the tree whose node i has
parent i - 1.
"""

from __future__ import annotations

import torch

from .drafters.base import Draft
from .sampling import SamplingParams, probs


def tree_mask(draft: Draft, device=None) -> torch.Tensor | None:
    """[1, 1 + n, 1 + n] bool, row i may see column j iff j is i or an ancestor of i
    (index 0 is the root). None for a chain, which the causal mask already covers."""
    if draft.is_chain:
        return None
    n = len(draft.tokens)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, parent in enumerate(draft.parents):
        if parent >= 0:
            mask[i + 1] |= mask[parent + 1]
    return mask[None].to(device)


def depths(draft: Draft) -> list[int]:
    """Depth of each node (children of the root have depth 1)."""
    out: list[int] = []
    for parent in draft.parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def children_of(draft: Draft) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, parent in enumerate(draft.parents):
        kids.setdefault(parent, []).append(i)
    return kids


def accept_greedy(draft: Draft, target_token) -> tuple[list[int], int]:
    """Longest root-to-node path whose tokens equal the target's choices.
    target_token(node, depth) gives the target's token after `node` (-1 = root), at the
    given depth of the path; returns (accepted node indices, bonus token)."""
    tokens = draft.tokens
    if draft.parents == list(range(-1, len(tokens) - 1)):
        # A chain (most drafts): node i's only child is i + 1, so walk it without
        # building the children map; replay calls this once per simulated step.
        i = 0
        while True:
            want = target_token(i - 1, i)
            if i == len(tokens) or tokens[i] != want:
                return list(range(i)), want
            i += 1
    kids = children_of(draft)
    node, path = -1, []
    while True:
        want = target_token(node, len(path))
        nxt = next((c for c in kids.get(node, ()) if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def verify(
    logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """logits [1 + n, V] → (accepted node indices root to leaf, next token).

    Greedy: follow the target's argmax down the tree. Sampling (SpecInfer): at a node try
    its children in order, accepting child s with probability min(1, p(s)/q_s(s)); after a
    rejection p ← norm(max(0, p − q_s)); if every child fails, draw from the residual p; at
    a leaf draw the bonus from p. Drafters without probabilities are point masses
    (q_s(s) = 1), so a rejected candidate is just removed from p. Either way the output
    is distributed exactly as the target's.
    """
    if params.greedy:
        targets = logits.argmax(dim=-1).tolist()  # the one host sync of a greedy step
        return accept_greedy(draft, lambda node, depth: targets[node + 1])

    p_all = probs(logits, params)
    kids = children_of(draft)
    node, path = -1, []
    while True:
        p = p_all[node + 1]
        for c in kids.get(node, ()):
            x = draft.tokens[c]
            q = None if draft.q is None else draft.q[c].to(p.device).float()
            q_x = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * q_x < float(p[x]):  # u < p/q without dividing by a zero q
                path.append(c)
                node = c
                break
            if q is None:
                p = p.clone()
                p[x] = 0.0
            else:
                p = (p - q).clamp_(min=0.0)
            p = p / p.sum()
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
