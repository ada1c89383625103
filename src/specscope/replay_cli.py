"""`specscope replay`: simulate model-free drafters on recorded token streams.

Registered by cli.py, which declares the drafter flags (--k, --ngram-max, ...) once for
every command (drafters/options.py); they reach this command as extra arguments. cli.py
is imported only inside the command, so either module can be imported first.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .drafters import METHODS, make_drafter
from .drafters.options import BY_FLAG, BY_NAME, convert, parse_flags
from .replay import BIN_TOKENS, ReplayError, expand_grid, read_streams, replay, streams_from_run

# Drafters that need no model, so a recorded stream is all they see, and the shared
# options (drafters/options.py) each one reads: what --grid may vary and `params` reports.
REPLAY_OPTIONS = {
    "ngram": ("k", "ngram_min", "ngram_max", "branches"),
    "trie": ("max_trie_depth", "max_bfs_breadth", "min_bfs_breadth", "num_draft_tokens", "match_type", "capacity",
             "insert_prompt"),
    "suffix": ("suffix_max_depth", "max_spec_factor", "min_token_prob", "max_spec_tokens", "suffix_tree"),
}
REPLAY_DRAFTERS = tuple(m for m in REPLAY_OPTIONS if m in METHODS)


def replay_command(
    ctx: typer.Context,
    run: Optional[int] = typer.Option(None, "--run", help="replay a run from the trace database"),
    traces: Optional[Path] = typer.Option(
        None, "--traces", help="JSONL, one request per line: prompt_ids + output_ids (as `generate --json` prints), "
                               "or prompt + output texts (tokenised with --model's tokenizer)"),
    drafter: str = typer.Option("ngram", "--drafter", help=" | ".join(REPLAY_DRAFTERS)),
    grid: list[str] = typer.Option([], "--grid", help="name=v1,v2,... over a drafter option (repeatable: the cartesian product)"),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", help="the limit the outputs were generated with; it caps the last drafts of a request "
                                       "(default: the run's own, else each request's output length)"),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="the engine's context per slot, which caps drafts near it (default: no cap)"),
    model: str = typer.Option("smollm2-135m", "--model", help="whose tokenizer encodes text traces (weights are not loaded)"),
    no_chat: bool = typer.Option(False, "--no-chat", help="encode text prompts as they are, without the chat template"),
    bin_tokens: int = typer.Option(BIN_TOKENS, "--bin", help="output tokens per bin of the acceptance-by-position report"),
    db: Optional[Path] = typer.Option(None, "--db", help="trace database (default ~/.specscope/specscope.db or $SPECSCOPE_DB)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per configuration"),
):
    """Exact offline simulation of greedy decoding with a model-free drafter on recorded
    token streams: accept_len, accept_rate, acceptance by output position and by request
    order, per drafter configuration. No model forward."""
    from .cli import USER_ERRORS, fail

    try:
        if (run is None) == (traces is None):
            raise ReplayError("give exactly one of --run ID or --traces FILE.jsonl")
        if drafter not in REPLAY_DRAFTERS:
            raise ReplayError(f"unknown drafter {drafter!r} (accepted: {', '.join(REPLAY_DRAFTERS)})")
        for name, value, low in (("--max-new-tokens", max_new_tokens, 1), ("--max-seq-len", max_seq_len, 2),
                                 ("--bin", bin_tokens, 1)):
            if value is not None and value < low:
                raise ReplayError(f"{name} must be >= {low}, got {value}")
        base = parse_flags(ctx.args)
        varied = parse_grid(grid)
        # An option the drafter does not read would make a silent no-op of a flag or a grid.
        given = [BY_FLAG[a.partition("=")[0]].name for a in ctx.args if a.partition("=")[0] in BY_FLAG]
        for name in [*given, *varied]:
            if name not in REPLAY_OPTIONS[drafter]:
                raise ReplayError(f"{BY_NAME[name].flag} does not apply to the {drafter} drafter "
                                  f"(its options: {', '.join(BY_NAME[n].flag for n in REPLAY_OPTIONS[drafter])})")
        configs = expand_grid(base, varied)
        for c in configs:
            make_drafter(drafter, c)  # bad combinations fail before any work
        if run is not None:
            from .trace import TraceStore

            with TraceStore(db) as store:
                streams = streams_from_run(store, run, max_new_tokens)
            source = f"run:{run}"
        else:
            streams = read_streams(traces, text_encoder(model, chat=not no_chat), max_new_tokens)
            source = f"traces:{traces}"
        results = []
        for c in configs:
            rec = replay(make_drafter(drafter, c), streams, max_seq_len)  # fresh: global state must not carry over
            params = {n: c[n] for n in REPLAY_OPTIONS[drafter]}
            results.append({"drafter": drafter, "params": params, "grid": {n: c[n] for n in varied}, "source": source,
                            **rec.summary(bin_tokens)})
    except USER_ERRORS as e:
        fail(e)
    if as_json:
        for r in results:
            print(json.dumps(r), flush=True)
    else:
        print_tables(results, bin_tokens)


def parse_grid(items: list[str]) -> dict[str, list]:
    """["k=2,4,8", "ngram-max=2,4"] → {"k": [2, 4, 8], "ngram_max": [2, 4]}. Names are the
    drafter options' (k, ngram_max, or their flags --ngram-max); values are checked as the
    flags' are."""
    grid: dict[str, list] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        option = BY_NAME.get(name) or BY_FLAG.get(name) or BY_FLAG.get("--" + name)
        if not sep:
            raise ReplayError(f"--grid takes name=v1,v2,...; got {item!r}")
        if option is None:
            raise ReplayError(f"unknown --grid option {name!r} (drafter options: {', '.join(BY_NAME)})")
        if option.name in grid:
            raise ReplayError(f"--grid {option.name} is given twice")
        texts = [v.strip() for v in values.split(",")]
        if not all(texts):
            raise ReplayError(f"--grid {option.name} needs comma-separated values, got {values!r}")
        grid[option.name] = [convert(option, v) for v in texts]
    return grid


def text_encoder(model: str, chat: bool):
    """encode(obj) -> (prompt_ids, output_ids) for text traces, with the tokenizer loaded on
    first use. Prompts go through the chat template as `generate` feeds them; outputs are
    encoded as they are, without special tokens."""
    state = {}

    def encode(obj: dict) -> tuple[list[int], list[int]]:
        from .engine import encode_prompt
        from .workloads import Prompt, _check_messages

        if "tokenizer" not in state:
            state["tokenizer"] = load_tokenizer_only(model)
        tok = state["tokenizer"]
        if "messages" in obj:
            prompt = Prompt(id="on this line", messages=_check_messages(obj["messages"], "messages"))
        elif isinstance(obj["prompt"], str):
            prompt = Prompt(id="on this line", text=obj["prompt"])
        else:
            raise ValueError('"prompt" must be a string')
        prompt_ids = encode_prompt(SimpleNamespace(tokenizer=tok), prompt, chat)
        return prompt_ids, tok(obj["output"], add_special_tokens=False).input_ids

    return encode


def load_tokenizer_only(spec: str):
    """The tokenizer of a --model spec without building the model (random models use
    SmolLM2's, as load_target does)."""
    from .models.loading import DEFAULT_MODEL, ModelSpecError, gguf_as_hf_dir, load_tokenizer, smollm2_gguf

    if spec == DEFAULT_MODEL or spec.startswith("random:"):
        return load_tokenizer(gguf_as_hf_dir(smollm2_gguf()))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"GGUF file not found: {spec}")
        return load_tokenizer(gguf_as_hf_dir(path))
    if not path.is_dir():
        raise ModelSpecError(f"unknown model '{spec}': expected '{DEFAULT_MODEL}', a Hugging Face checkpoint "
                             "directory, a .gguf file or random:<preset|config.json>")
    return load_tokenizer(path)


def print_tables(results: list[dict], bin_tokens: int) -> None:
    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    def label(r):
        return " ".join(f"{k}={v}" for k, v in r["grid"].items()) or "-"

    console = Console()
    first = results[0]
    fixed = " ".join(f"{k}={v}" for k, v in first["params"].items() if k not in first["grid"])
    table = Table(title=f"replay · {first['drafter']} ({fixed}) · {first['source']} · {first['requests']} requests, "
                        f"{first['output_tokens']} output tokens")
    for col in ("grid", "accept_len", "accept_rate", "drafted", "steps", "replay tok/s"):
        table.add_column(col, justify="left" if col == "grid" else "right")
    for r in results:
        table.add_row(label(r), fmt(r["accept_len"]), fmt(r["accept_rate"]), fmt(r["drafted_frac"]),
                      str(r["steps"]), fmt(r["replay_tok_s"], ",.0f"))
    console.print(table)

    # Warm-up (does the drafter need context?) and learning across requests (global caches).
    for key, order, title, head in (
        ("by_position", "start", f"accept_len by output position ({bin_tokens}-token bins)", lambda b: f"{b['start']}-"),
        ("by_request", "first", "accept_len by request order", lambda b: f"#{b['first']}-{b['last']}"),
    ):
        # Configurations may differ in which bins have steps: show the union, in order.
        bins = sorted({b[order]: b for r in results for b in r[key]}.values(), key=lambda b: b[order])
        table = Table(title=title)
        table.add_column("grid")
        for b in bins:
            table.add_column(head(b), justify="right")
        for r in results:
            cells = {head(b): fmt(b["accept_len"]) for b in r[key]}
            table.add_row(label(r), *(cells.get(head(b), "-") for b in bins))
        console.print(table)
