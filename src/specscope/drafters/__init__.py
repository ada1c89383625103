"""Drafters, one file each, behind the protocol in base.py."""

from .base import Draft, Drafter
from .draft_model import DraftModelDrafter, self_draft
from .ngram import NgramDrafter
from .none import NoDrafter
from .oracle import OracleDrafter

METHODS = ("none", "ngram", "oracle")


def make_drafter(method: str, options: dict, target=None, references: dict[str, list[int]] | None = None,
                 seed: int = 0) -> Drafter:
    """A drafter for `method` from the shared option table (drafters/options.py)."""
    if method == "none":
        return NoDrafter()
    if method == "ngram":
        return NgramDrafter(k=options["k"], n_min=options["ngram_min"], n_max=options["ngram_max"],
                            branches=options["branches"])
    if method == "oracle":
        return OracleDrafter(references or {}, target.model.vocab_size, k=options["k"],
                             alpha=options["oracle_alpha"], seed=seed)
    raise ValueError(f"unknown method {method} (accepted: {', '.join(METHODS)})")


__all__ = ["Draft", "Drafter", "DraftModelDrafter", "self_draft", "NgramDrafter", "NoDrafter", "OracleDrafter", "METHODS", "make_drafter"]
