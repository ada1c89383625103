"""specscope command line: one sub-command per verb."""

from __future__ import annotations

import json
import os
import platform
import shlex
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .drafters import METHODS, NoDrafter, make_drafter
from .drafters.options import help_text, parse_flags
from .engine import Completion, Engine, PromptError, encode_prompt
from .models import DEFAULT_MODEL, ModelSpecError, Target, UnsupportedArchitecture, load_target
from .sampling import SamplingParams
from .trace import TraceStore
from .workloads import Prompt, WorkloadError, load_workload, read_prompts_file

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Speculative decoding: draft, verify, measure, explain.")
err = Console(stderr=True)

# Errors a user can cause; anything else is a bug and keeps its traceback.
USER_ERRORS = (ModelSpecError, UnsupportedArchitecture, PromptError, WorkloadError, ValueError, KeyError, FileNotFoundError)


class UsageError(ValueError):
    pass


def fail(problem: Exception | str) -> None:
    # KeyError's str() adds quotes around the message; print what was raised.
    message = problem.args[0] if isinstance(problem, KeyError) and problem.args else str(problem)
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UsageError(f"unknown method {', '.join(unknown) or repr(text)} (accepted: {', '.join(METHODS)})")
    return methods


def hardware(target: Target) -> dict:
    import torch
    import transformers

    device = target.model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {
        "device": str(device), "device_name": name, "dtype": str(target.model.dtype).replace("torch.", ""),
        "torch": torch.__version__, "transformers": transformers.__version__, "cpu_threads": torch.get_num_threads(),
        "backend": target.backend,
    }


def greedy_references(target: Target, prompts: list[tuple[str, list[int]]], max_new_tokens: int,
                      on_done=None) -> dict[str, list[int]]:
    """The oracle's default continuation: the target's own greedy output."""
    engine = Engine(target, NoDrafter())
    refs = {}
    for rid, ids in prompts:
        refs[rid] = engine.generate_one(rid, ids, max_new_tokens).output_ids
        if on_done:
            on_done()
    return refs


def run_method(target, method, opts, sampling, prompts, max_new_tokens, store, workload, references, on_done=None):
    drafter = make_drafter(method, opts, target, references, seed=sampling.seed or 0, sampling=sampling)
    params = {**opts, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
              "seed": sampling.seed, "max_new_tokens": max_new_tokens}
    run_id = store.start_run(source="engine", model=target.spec, method=method, params=params,
                             hardware=hardware(target), workload=workload) if store else None
    engine = Engine(target, drafter, sampling, store=store, run_id=run_id)
    out: list[Completion] = []
    try:
        for rid, ids in prompts:
            out.append(engine.generate_one(rid, ids, max_new_tokens))
            if on_done:
                on_done()
    except BaseException:
        if store:
            store.finish_run(run_id, "partial" if out else "failed")
        raise
    if store:
        store.finish_run(run_id, "ok")
    return out


def is_main_rank() -> bool:
    """Under torchrun every rank runs the same loop; only rank 0 prints and records."""
    return os.environ.get("RANK", "0") == "0"


def encode_all(target: Target, prompts: list[Prompt], chat: bool) -> list[tuple[str, list[int]]]:
    encoded = []
    for p in prompts:
        ids = encode_prompt(target, p, chat)
        limit = target.model.max_seq_len
        if len(ids) + 1 > limit:
            raise PromptError(f"prompt {p.id} has {len(ids)} tokens; the model's context here is {limit} "
                              "(raise --max-seq-len up to the model's maximum, or shorten the prompt)")
        encoded.append((p.id, ids))
    return encoded


def completion_json(c: Completion, method: str, max_new_tokens: int) -> dict:
    return {
        "request_id": c.request_id, "method": method, "max_new_tokens": max_new_tokens,
        "prompt_ids": c.prompt_ids, "output_ids": c.output_ids,
        "text": c.text, "finish_reason": c.finish_reason, "accept_len": c.accept_len, "accept_rate": c.accept_rate,
        "tok_s": c.tok_s, "steps": len(c.steps), "wall_s": c.wall_s, "ttft_ms": c.ttft_ms,
    }


def summarize(completions: list[Completion]) -> dict:
    steps = [s for c in completions for s in c.steps]
    tokens = sum(len(c.output_ids) for c in completions)
    wall = sum(c.wall_s for c in completions)
    proposed = sum(s.proposed for s in steps)
    return {
        "prompts": len(completions), "output_tokens": tokens, "wall_s": wall,
        "tok_s": tokens / wall if wall else 0.0, "steps": len(steps),
        "accept_len": sum(s.accepted + 1 for s in steps) / len(steps) if steps else None,
        "accept_rate": sum(s.accepted for s in steps) / proposed if proposed else None,
    }


# Shared options (typer reads these defaults as option declarations).
ModelOpt = typer.Option(DEFAULT_MODEL, "--model", help="smollm2-135m | HF checkpoint dir | file.gguf | random:<preset|config.json>")
BackendOpt = typer.Option("native", "--backend", help="native (fast, Llama family + Qwen3-MoE) | hf (transformers fallback)")
DeviceOpt = typer.Option(None, "--device", help="cpu | cuda (default: cuda when available)")
MaxSeqOpt = typer.Option(None, "--max-seq-len", help="KV cache length per slot (default: min(8192, model maximum))")
# Drafter options (--k, --ngram-max, ...) are not declared per command: they come from one
# table (drafters/options.py) shared with `replay`, and arrive here as extra arguments.
WITH_DRAFT_OPTIONS = {"allow_extra_args": True, "ignore_unknown_options": True}
MaxNewOpt = typer.Option(128, "--max-new-tokens", help="output tokens per prompt")
DbOpt = typer.Option(None, "--db", help="trace database (default ~/.specscope/specscope.db or $SPECSCOPE_DB)")
JsonOpt = typer.Option(False, "--json", help="machine-readable output")


def open_target(model, backend, device, max_seq_len) -> Target:
    if max_seq_len is not None and max_seq_len < 2:
        raise UsageError(f"--max-seq-len must be >= 2, got {max_seq_len}")
    return load_target(model, backend=backend, device=device, max_seq_len=max_seq_len)


@app.command(context_settings=WITH_DRAFT_OPTIONS, epilog=help_text())
def generate(
    ctx: typer.Context,
    model: str = ModelOpt,
    method: str = typer.Option("none", "--method", help=" | ".join(METHODS)),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="one text prompt"),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="JSONL: one {prompt} or {messages} per line"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"), top_k: int = typer.Option(0, "--top-k", help="0 = off"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    max_new_tokens: int = MaxNewOpt,
    no_chat: bool = typer.Option(False, "--no-chat", help="feed the text as is, without the chat template"),
    backend: str = BackendOpt, device: Optional[str] = DeviceOpt, max_seq_len: Optional[int] = MaxSeqOpt,
    db: Optional[Path] = DbOpt, as_json: bool = JsonOpt,
):
    """Generate with one method and print each completion."""
    try:
        method = parse_methods(method)
        if len(method) != 1:
            raise UsageError("--method takes one method; use `specscope run --methods` to compare several")
        method = method[0]
        opts = parse_flags(ctx.args)
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        if (prompt is None) == (prompts_file is None):
            raise UsageError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
        if max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        if prompt is not None and not prompt.strip():
            raise PromptError("the prompt is empty")
        prompts = [Prompt(id="prompt", text=prompt)] if prompt is not None else read_prompts_file(prompts_file)
        target = open_target(model, backend, device, max_seq_len)
        encoded = encode_all(target, prompts, chat=not no_chat)
        references = greedy_references(target, encoded, max_new_tokens) if method == "oracle" else None
        store = TraceStore(db) if is_main_rank() else None
        workload = "prompt" if prompt is not None else f"file:{prompts_file}"
        completions = run_method(target, method, opts, sampling, encoded, max_new_tokens, store, workload, references)
    except USER_ERRORS as e:
        fail(e)
    if not is_main_rank():
        return
    for c in completions:
        if as_json:
            print(json.dumps(completion_json(c, method, max_new_tokens)), flush=True)
        else:
            print(c.text)
            acc = f"{c.accept_len:.2f}" if c.accept_len is not None else "-"
            err.print(f"[dim]{c.request_id}: {len(c.output_ids)} tokens in {c.wall_s:.2f}s ({c.tok_s:.1f} tok/s), "
                      f"accept_len {acc}, finish {c.finish_reason}[/dim]")


@app.command(context_settings=WITH_DRAFT_OPTIONS, epilog=help_text())
def run(
    ctx: typer.Context,
    model: str = ModelOpt,
    workload: str = typer.Option("mixed", "--workload", help="humaneval | sharegpt | mixed | file:PATH.jsonl"),
    methods: str = typer.Option("none,ngram,oracle", "--methods", help="comma-separated, from: " + ",".join(METHODS)),
    num_prompts: int = typer.Option(8, "--num-prompts"),
    max_new_tokens: int = MaxNewOpt,
    seed: int = typer.Option(0, "--seed", help="workload sample and oracle corruption seed"),
    backend: str = BackendOpt, device: Optional[str] = DeviceOpt, max_seq_len: Optional[int] = MaxSeqOpt,
    db: Optional[Path] = DbOpt, as_json: bool = JsonOpt,
):
    """Every method on the same prompts in one process: tok/s, accept_len, accept_rate, speedup."""
    try:
        method_list = parse_methods(methods)
        opts = parse_flags(ctx.args)
        if max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        prompts = load_workload(workload, num_prompts, seed=seed)
        target = open_target(model, backend, device, max_seq_len)
        encoded = encode_all(target, prompts, chat=True)
        store = TraceStore(db) if is_main_rank() else None
        results = compare(target, method_list, opts, encoded, prompts, max_new_tokens, store, workload,
                          seed=seed, quiet=as_json or not is_main_rank())
    except USER_ERRORS as e:
        fail(e)
    if not is_main_rank():
        return
    if as_json:
        print(json.dumps({"command": command_line(ctx), "model": model, "workload": workload,
                          "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "drafter_options": opts,
                          "hardware": hardware(target), "methods": results}))
    else:
        print_table(results, model, workload)


def command_line(ctx: typer.Context) -> str:
    """The command that reproduces this run, defaults spelled out (sys.argv is not ours under test runners)."""
    words = ["specscope", ctx.info_name]
    for name, value in ctx.params.items():
        if value is None or name in ("as_json", "db"):
            continue
        words += [f"--{name.replace('_', '-')}", str(value)]
    return shlex.join(words + ctx.args)


def parse_int_list(text: str, what: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        scale = units.get(part[-1].upper(), 1)
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) < 1:
            raise UsageError(f"{what} takes a comma-separated list of positive integers (K/M/G suffixes allowed), got '{part}'")
        values.append(int(digits) * scale)
    if not values:
        raise UsageError(f"{what} is empty")
    return values


@app.command()
def comm(
    world: int = typer.Option(2, "--world", help="processes (one per GPU on a GPU machine; gloo on CPU otherwise)"),
    sizes: Optional[str] = typer.Option(None, "--sizes", help="payload bytes, e.g. 14K,112K,1M"),
    hidden: int = typer.Option(7168, "--hidden", help="model hidden size (payload = tokens × hidden × 2 bytes)"),
    tokens: str = typer.Option("1,2,4,8,16,32,64", "--tokens", help="verify widths to size the payloads"),
    graph: bool = typer.Option(False, "--graph", help="also time all-reduces captured in a CUDA graph"),
    iters: int = typer.Option(50, "--iters"),
    as_json: bool = JsonOpt,
):
    """All-reduce latency and bus bandwidth for tensor-parallel payloads."""
    from .comm import payload_sizes, sweep

    try:
        if iters < 1:
            raise UsageError(f"--iters must be >= 1, got {iters}")
        if sizes is not None:
            payloads = [(b, None) for b in parse_int_list(sizes, "--sizes")]
        else:
            if hidden < 1:
                raise UsageError(f"--hidden must be >= 1, got {hidden}")
            payloads = payload_sizes(hidden, parse_int_list(tokens, "--tokens"))
        report = sweep(world, payloads, iters=iters, graph=graph)
    except USER_ERRORS as e:
        fail(e)
    if as_json:
        print(json.dumps(report))
        return
    table = Table(title=f"all-reduce · {report['backend']} · world {report['world']}")
    for col in ("bytes", "tokens", "mode", "median µs", "p90 µs", "busbw GB/s"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(str(r["bytes"]), str(r["tokens"] or "-"), r["mode"], f"{r['median_us']:.1f}",
                      f"{r['p90_us']:.1f}", f"{r['busbw_GBps']:.2f}")
    Console().print(table)


def compare(target, methods, opts, encoded, prompts, max_new_tokens, store, workload, seed=0, quiet=False) -> dict:
    sampling = SamplingParams(seed=seed)
    workload_of = {p.id: p.workload for p in prompts}
    need_refs = "oracle" in methods
    total = len(methods) * len(encoded) + (len(encoded) if need_refs else 0)
    results: dict[str, dict] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=err, disable=quiet, transient=False) as bar:
        task = bar.add_task("warm-up", total=total)
        warm = encoded[:1]
        for method in methods:  # first calls pay allocator and kernel set-up; keep them out of the numbers
            refs = {rid: ids[:8] for rid, ids in warm} if method == "oracle" else None
            Engine(target, make_drafter(method, opts, target, refs), sampling).generate(warm, 8)
        references = None
        if need_refs:
            bar.update(task, description="oracle references (greedy)")
            references = greedy_references(target, encoded, max_new_tokens, on_done=lambda: bar.advance(task))
        for method in methods:
            bar.update(task, description=method)
            done = run_method(target, method, opts, sampling, encoded, max_new_tokens, store, workload, references,
                              on_done=lambda: bar.advance(task))
            summary = summarize(done)
            by_workload = {}
            for name in sorted({workload_of[c.request_id] for c in done}):
                by_workload[name] = summarize([c for c in done if workload_of[c.request_id] == name])
            summary["by_workload"] = by_workload
            results[method] = summary
    if "none" in results:
        base = results["none"]
        for r in results.values():
            r["speedup"] = r["tok_s"] / base["tok_s"] if base["tok_s"] else None
            for name, w in r["by_workload"].items():
                b = base["by_workload"].get(name, {}).get("tok_s")
                w["speedup"] = w["tok_s"] / b if b else None
    return results


def print_table(results: dict, model: str, workload: str) -> None:
    table = Table(title=f"{model} · {workload}")
    for col in ("method", "workload", "tok/s", "accept_len", "accept_rate", "speedup"):
        table.add_column(col, justify="left" if col in ("method", "workload") else "right")

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for method, r in results.items():
        rows = [("all", r)] + (list(r["by_workload"].items()) if len(r["by_workload"]) > 1 else [])
        for name, s in rows:
            table.add_row(method, name, fmt(s["tok_s"], ".1f"), fmt(s["accept_len"], ".2f"),
                          fmt(s["accept_rate"], ".2f"), fmt(s.get("speedup"), ".2f") + ("×" if s.get("speedup") else ""))
    Console().print(table)


from .profile import app as profile_app  # noqa: E402

app.add_typer(profile_app, name="profile")

from .replay_cli import replay_command; app.command("replay", context_settings=WITH_DRAFT_OPTIONS, epilog=help_text())(replay_command)  # noqa: E402,E702
