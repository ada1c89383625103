"""Draft-model speculation: a smaller model with the target's tokenizer proposes k tokens
autoregressively. `self_draft` builds one from the target's own first layers plus its
final norm and lm_head (LayerSkip-style early exit), so a single checkpoint gets a
model-based drafter.

The draft model keeps its own KV cache, one slot per request, under the engine's
convention: entries at or past the position a forward starts at are stale. Catching up
after a verify step therefore feeds only the committed tokens the draft has not cached
(the bonus token, plus the last accepted draft, which was proposed but never fed), and a
rejected draft's entries are simply overwritten. The catch-up forward also yields the
first draft token, so a proposal of k tokens costs k draft forwards.

Greedy targets get argmax drafts (point masses, q = None). Sampling targets get tokens
sampled from the draft's own distribution, returned as q: verification then accepts a
token with min(1, p/q) instead of p, lossless either way but accepted more often.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..models.loading import Target
from ..sampling import SamplingParams, probs
from .base import Draft

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id")


def tokenizer_mismatch(draft_tok, target_tok) -> str | None:
    """What differs between two tokenizers (vocabulary, special tokens), or None."""
    if draft_tok is target_tok:
        return None
    problems = []
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if dv != tv:
        only_draft = sorted(set(dv) - set(tv))
        only_target = sorted(set(tv) - set(dv))
        moved = sorted(t for t in set(dv) & set(tv) if dv[t] != tv[t])
        what = [f"{len(dv)} vs {len(tv)} tokens"]
        if only_draft:
            what.append(f"{len(only_draft)} only in the draft's (e.g. {only_draft[:3]})")
        if only_target:
            what.append(f"{len(only_target)} only in the target's (e.g. {only_target[:3]})")
        if moved:
            what.append(f"{len(moved)} with different ids (e.g. {moved[0]!r}: {dv[moved[0]]} vs {tv[moved[0]]})")
        problems.append("vocabulary: " + ", ".join(what))
    for name in SPECIAL_IDS:
        d, t = getattr(draft_tok, name, None), getattr(target_tok, name, None)
        if d != t:
            problems.append(f"{name} {d} vs {t}")
    d, t = sorted(draft_tok.all_special_tokens), sorted(target_tok.all_special_tokens)
    if d != t:
        problems.append(f"special tokens {d} vs {t}")
    return "; ".join(problems) or None


@dataclass
class _Request:
    slot: int
    tokens: list[int]  # committed: prompt + emitted
    cached: int = 0  # leading committed tokens whose KV entries in the draft cache are valid
    fed: list[int] = field(default_factory=list)  # drafts fed in the last proposal, in order


class DraftModelDrafter:
    name = "draft-model"

    def __init__(self, draft: Target, target: Target, k: int = 4, sampling: SamplingParams = SamplingParams(),
                 seed: int = 0):
        if k < 1:
            raise ValueError(f"--k must be >= 1, got {k}")
        problem = tokenizer_mismatch(draft.tokenizer, target.tokenizer)
        if problem:
            raise ValueError(
                f"draft model {draft.spec} cannot draft for {target.spec}: their tokenizers differ ({problem}); "
                "a draft model must share the target's tokenizer"
            )
        self.model, self.k, self.sampling = draft.model, k, sampling
        # Same tokenizer, but the embedding tables may be padded to different sizes: drafts
        # are drawn from the target's id range only, and q is padded out to it.
        self.vocab = min(draft.model.vocab_size, target.model.vocab_size)
        self.pad = target.model.vocab_size - self.vocab
        self.generator = torch.Generator(device=self.model.device).manual_seed(seed)
        self.free_slots = list(range(self.model.num_slots))
        self.state: dict[str, _Request] = {}

    def begin(self, req: str, prompt_ids: list[int]) -> None:
        if not self.free_slots:
            raise RuntimeError(
                f"the draft model's {self.model.num_slots} KV slot(s) are all in use; "
                "give it as many slots as the target"
            )
        self.state[req] = _Request(self.free_slots.pop(0), list(prompt_ids))

    def propose(self, req: str, budget: int) -> Draft:
        r = self.state[req]
        ctx = len(r.tokens)
        # The last draft is never fed, so n drafts need ctx + n - 1 cache entries.
        n = min(self.k, budget, self.model.max_seq_len - ctx + 1)
        if n < 1:
            return Draft()
        dev = self.model.device
        # At least one token must go in to get logits; re-feeding a cached one is harmless.
        start = min(r.cached, ctx - 1)
        positions = torch.arange(start, ctx + n - 1, device=dev)[None]
        new = torch.tensor([r.tokens[start:]], device=dev)
        if self.pad:
            # Ids past a smaller draft table (padding rows the target emitted) would index
            # out of range; any stand-in only costs draft quality, never correctness.
            new.clamp_(max=self.model.vocab_size - 1)
        logits = self.model(new, positions[:, : ctx - start], [r.slot], last_only=True)
        r.cached = ctx
        drafted, qs = [], []
        for i in range(n):
            x, q = self._pick(logits[0, -1])
            drafted.append(x)
            qs.append(q)
            if i + 1 < n:
                j = ctx - start + i
                logits = self.model(x.view(1, 1), positions[:, j : j + 1], [r.slot])
        tokens = torch.stack(drafted).tolist()  # the one host sync of a proposal
        r.fed = tokens[:-1]
        return Draft.chain(tokens, None if self.sampling.greedy else torch.stack(qs))

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next draft token (a device scalar, no sync) and the distribution it came from."""
        logits = logits[: self.vocab]
        if self.sampling.greedy:
            return logits.argmax(), None
        p = probs(logits, self.sampling)
        x = torch.multinomial(p, 1, generator=self.generator)[0]
        return x, F.pad(p, (0, self.pad)) if self.pad else p

    def observe(self, req: str, emitted_ids: list[int]) -> None:
        r = self.state[req]
        if r.cached == len(r.tokens):
            # Drafts the target emitted were fed at the very positions they now hold.
            m = 0
            while m < min(len(r.fed), len(emitted_ids)) and r.fed[m] == emitted_ids[m]:
                m += 1
            r.cached += m
        r.fed = []
        r.tokens.extend(emitted_ids)

    def end(self, req: str) -> None:
        r = self.state.pop(req, None)
        if r is not None:
            self.model.reset_slot(r.slot)
            self.free_slots.append(r.slot)


def self_draft(target: Target, layers: int, k: int = 4, sampling: SamplingParams = SamplingParams(),
               seed: int = 0) -> DraftModelDrafter:
    """A drafter running the target's first `layers` layers, final norm and lm_head. The
    weights are the target's own tensors (no copy); the KV cache is separate, because
    the draft's entries past the committed length would otherwise overwrite the target's."""
    from ..models.cuda_graphs import wrap
    from ..models.llama import Transformer

    if target.backend != "native":
        raise ValueError(f"self-draft needs the native backend (--backend native), not '{target.backend}': "
                         "it runs a truncated copy of the native model")
    full = getattr(target.model, "inner", target.model)  # the CUDA-graph runner wraps it
    n_layers = full.arch.n_layers
    if not 1 <= layers < n_layers:
        raise ValueError(f"--draft-layers must be between 1 and {n_layers - 1} for {target.spec} "
                         f"({n_layers} layers), got {layers}")
    config = copy.deepcopy(full.config)
    config.num_hidden_layers = layers
    # On the meta device nothing is allocated; every parameter is then the target's.
    model = Transformer(config, dtype=full.dtype, device="meta")
    for name, module in model.named_modules():
        source = full.get_submodule(name)
        for pname in list(module._parameters):
            setattr(module, pname, source._parameters[pname])
    model.setup_cache(full.num_slots, full.max_seq_len)
    model.eval()
    draft = Target(spec=f"{target.spec}[:{layers} layers]", backend="native", model=wrap(model),
                   tokenizer=target.tokenizer, config=config)
    drafter = DraftModelDrafter(draft, target, k, sampling, seed)
    drafter.name = "self-draft"
    return drafter
