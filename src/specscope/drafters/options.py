"""Drafter options: one table shared by `generate`, `run` and `replay`, so every command
takes the same `--flag value` for the same drafter setting, and `replay --grid` names them
the same way. Values are checked by the drafters' constructors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftOption:
    name: str  # attribute name; the flag is --name-with-dashes
    type: type
    default: object
    help: str
    low: float | None = None  # inclusive bounds, checked for every command
    high: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


DRAFT_OPTIONS = [
    DraftOption("k", int, 8, "draft tokens per step (ngram, oracle, draft models)", low=1),
    DraftOption("ngram_min", int, 1, "ngram: shortest suffix to match", low=1),
    DraftOption("ngram_max", int, 4, "ngram: longest suffix to match", low=1),
    DraftOption("branches", int, 1, "ngram: continuations merged into a draft tree (1 = chain)", low=1),
    DraftOption("oracle_alpha", float, 1.0, "oracle: probability each replayed draft token is kept", low=0, high=1),
    # trie: SGLang NGRAM's flags, same names and defaults
    DraftOption("max_trie_depth", int, 18, "trie: tokens of recent context inserted and matched"),
    DraftOption("max_bfs_breadth", int, 10, "trie: widest BFS level of a draft tree"),
    DraftOption("min_bfs_breadth", int, 1, "trie: narrowest BFS level of a draft tree"),
    DraftOption("num_draft_tokens", int, 12, "trie: verify tokens per step, the root included (SGLang's meaning)"),
    DraftOption("match_type", str, "bfs", "trie: bfs (recency) | prob (frequency)"),
    DraftOption("capacity", int, 10_000_000, "trie: nodes kept before LRU eviction"),
    DraftOption("insert_prompt", bool, False, "trie: also insert prompts (SGLang does not)"),
    # suffix: SuffixDecoding
    DraftOption("suffix_max_depth", int, 24, "suffix: deepest match + draft the suffix trees keep"),
    DraftOption("max_spec_factor", float, 1.0, "suffix: draft length up to this × match length"),
    DraftOption("min_token_prob", float, 0.1, "suffix: prune draft nodes below this estimated probability"),
    DraftOption("max_spec_tokens", int, 12, "suffix: draft tree nodes per step"),
    DraftOption("suffix_tree", bool, True, "suffix: tree drafts (false: best path only)"),
    # draft models
    DraftOption("draft_model", str, "", "draft-model: the drafter's --model spec (same tokenizer as the target)"),
    DraftOption("draft_layers", int, 0, "self-draft: target layers the drafter runs (0: a quarter of them)", low=0),
]
BY_NAME = {o.name: o for o in DRAFT_OPTIONS}
BY_FLAG = {o.flag: o for o in DRAFT_OPTIONS}


def defaults() -> dict:
    return {o.name: o.default for o in DRAFT_OPTIONS}


def convert(option: DraftOption, text: str):
    value = _convert(option, text)
    if option.low is not None and option.high is not None and not option.low <= value <= option.high:
        raise ValueError(f"{option.flag} must be in [{option.low}, {option.high}], got {text}")
    if option.low is not None and value < option.low:
        raise ValueError(f"{option.flag} must be >= {option.low}, got {text}")
    if option.high is not None and value > option.high:
        raise ValueError(f"{option.flag} must be <= {option.high}, got {text}")
    return value


def _convert(option: DraftOption, text: str):
    if option.type is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{option.flag} takes true or false, got '{text}'")
    try:
        return option.type(text)
    except ValueError:
        raise ValueError(f"{option.flag} takes {option.type.__name__} values, got '{text}'") from None


def parse_flags(args: list[str]) -> dict:
    """['--k', '4', '--ngram-max=3'] → defaults updated with {'k': 4, 'ngram_max': 3}."""
    values = defaults()
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        option = BY_FLAG.get(flag)
        if option is None:
            raise ValueError(f"unknown option {args[i]} (drafter options: {', '.join(BY_FLAG)})")
        if inline:
            text = inline
        elif option.type is bool and (i + 1 == len(args) or args[i + 1].startswith("--")):
            text = "true"  # a bare boolean flag switches it on
        elif i + 1 < len(args):
            i += 1
            text = args[i]
        else:
            raise ValueError(f"{flag} needs a value")
        values[option.name] = convert(option, text)
        i += 1
    return values


def help_text() -> str:
    return "Drafter options: " + "; ".join(f"{o.flag} ({o.default}): {o.help}" for o in DRAFT_OPTIONS)
