"""Drafters, one file each, behind the protocol in base.py."""

from ..sampling import SamplingParams
from .base import Draft, Drafter
from .draft_model import DraftModelDrafter, self_draft
from .ngram import NgramDrafter
from .none import NoDrafter
from .oracle import OracleDrafter
from .suffix import SuffixDrafter
from .trie import TrieDrafter

METHODS = ("none", "ngram", "oracle", "trie", "suffix", "draft-model", "self-draft")


def make_drafter(method: str, options: dict, target=None, references: dict[str, list[int]] | None = None,
                 seed: int = 0, sampling: SamplingParams = SamplingParams()) -> Drafter:
    """A drafter for `method` from the shared option table (drafters/options.py)."""
    o = options
    if method == "none":
        return NoDrafter()
    if method == "ngram":
        return NgramDrafter(k=o["k"], n_min=o["ngram_min"], n_max=o["ngram_max"], branches=o["branches"])
    if method == "oracle":
        return OracleDrafter(references or {}, target.model.vocab_size, k=o["k"], alpha=o["oracle_alpha"], seed=seed)
    if method == "trie":
        return TrieDrafter(max_trie_depth=o["max_trie_depth"], max_bfs_breadth=o["max_bfs_breadth"],
                           num_draft_tokens=o["num_draft_tokens"], match_type=o["match_type"],
                           capacity=o["capacity"], insert_prompt=o["insert_prompt"],
                           min_bfs_breadth=o["min_bfs_breadth"])
    if method == "suffix":
        return SuffixDrafter(max_depth=o["suffix_max_depth"], max_spec_factor=o["max_spec_factor"],
                             min_token_prob=o["min_token_prob"], max_spec_tokens=o["max_spec_tokens"],
                             tree=o["suffix_tree"])
    if method == "draft-model":
        if not o["draft_model"]:
            raise ValueError("--method draft-model needs --draft-model SPEC (a model sharing the target's tokenizer)")
        from ..models import load_target

        draft = load_target(o["draft_model"], device=str(target.model.device), dtype=target.model.dtype,
                            num_slots=target.model.num_slots, max_seq_len=target.model.max_seq_len)
        return DraftModelDrafter(draft, target, k=o["k"], sampling=sampling, seed=seed)
    if method == "self-draft":
        layers = o["draft_layers"] or max(1, target.config.num_hidden_layers // 4)
        return self_draft(target, layers, k=o["k"], sampling=sampling, seed=seed)
    raise ValueError(f"unknown method {method} (accepted: {', '.join(METHODS)})")


__all__ = ["Draft", "Drafter", "DraftModelDrafter", "self_draft", "NgramDrafter", "NoDrafter", "OracleDrafter", "SuffixDrafter", "TrieDrafter",
           "METHODS", "make_drafter"]
