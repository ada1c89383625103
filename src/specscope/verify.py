"""Acceptance of a draft against the target's logits.

Verify convention (DESIGN.md): the forward fed [root] + draft nodes, so logits[0] scores
depth-1 nodes, logits[i] the children of node i-1 (for a chain: draft token i), and the
bonus token is drawn from the logits at the last accepted node.
"""

from __future__ import annotations

import torch

from .drafters.base import Draft
from .sampling import SamplingParams, probs


def verify_chain(
    logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """logits [1 + n, V] for a chain of n drafts → (accepted drafts, next token).

    Greedy: accept while the draft equals the target's argmax. Sampling: accept draft x
    with probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)); if all
    are accepted draw the bonus from p. A draft without probabilities is a point mass
    (q(x) = 1), which keeps the output distribution exactly the target's.
    """
    if not draft.is_chain:
        raise ValueError("tree drafts are not verified yet; this verifier takes chains (parents[i] == i - 1)")
    n = len(draft.tokens)
    if params.greedy:
        targets = logits.argmax(dim=-1).tolist()  # the one host sync of the step
        accepted = 0
        while accepted < n and draft.tokens[accepted] == targets[accepted]:
            accepted += 1
        return accepted, targets[accepted]

    p = probs(logits, params)
    if n == 0:
        return 0, int(torch.multinomial(p[0], 1, generator=generator))
    tokens = torch.tensor(draft.tokens, device=p.device)
    rows = torch.arange(n, device=p.device)
    p_x = p[rows, tokens]
    q_x = torch.ones_like(p_x) if draft.q is None else draft.q.to(p.device)[rows, tokens].float()
    u = torch.rand(n, generator=generator, device=p.device)
    accept = (u * q_x < p_x).tolist()  # u < p/q without dividing by a zero q
    for i in range(n):
        if not accept[i]:
            residual = p[i].clone()
            if draft.q is None:
                residual[draft.tokens[i]] = 0.0
            else:
                residual = (residual - draft.q[i].to(p.device).float()).clamp_(min=0.0)
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return n, int(torch.multinomial(p[n], 1, generator=generator))
