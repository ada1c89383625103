"""`specscope profile verify`: what one verify step of T tokens costs on this hardware.

Speculative decoding pays only while a forward of k+1 tokens costs about what a forward
of 1 token costs. This measures the curve — median forward time per (batch, T, context)
after warm-up (CUDA events on a GPU, wall clock on a CPU) — next to the floor it is up
against: the bytes one forward must read (every weight but the embedding table, only the
experts the tokens touch in a MoE, the live KV cache) over the memory bandwidth measured
in the same run by a device-to-device copy.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Optional

import torch
import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Measure forward costs on this hardware.")


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} needs integers >= 1, got {text!r}")
    return values


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, nbytes: int | None = None, reps: int = 10) -> float:
    """Bytes per second of a large device-to-device copy, counting read + write."""
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = time_fn(lambda: dst.copy_(src), device, reps=reps, warmup=2)
    del src, dst
    return 2 * nbytes / (statistics.median(times) * 1e-3)


def time_fn(fn, device, reps: int, warmup: int) -> list[float]:
    """Milliseconds per call: CUDA events around each call on a GPU, wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def native(model):
    return getattr(model, "inner", model)


def weight_bytes(model) -> dict:
    """Bytes a forward reads from the weights, split as the roofline needs them: dense
    (everything but the embedding table and the routed experts) and one routed expert."""
    from .models.llama import MoE

    m = native(model)
    seen, dense, expert, n_moe = set(), 0, 0, 0
    embed = m.embed.weight
    tied = m.lm_head.weight is embed
    for name, p in m.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embed and not tied:
            continue  # one row per token is read, not the table
        if name.endswith((".gate_up", ".down")):
            continue
        dense += p.numel() * p.element_size()
    for layer in m.layers:
        if isinstance(layer.mlp, MoE):
            n_moe += 1
            e = layer.mlp.gate_up.shape[0]
            expert = (layer.mlp.gate_up.numel() + layer.mlp.down.numel()) * layer.mlp.gate_up.element_size() // e
    return {"dense": dense, "per_expert": expert, "moe_layers": n_moe,
            "embed_row": embed.shape[1] * embed.element_size()}


def kv_bytes(model, batch: int, ctx: int) -> int:
    a = native(model).arch
    return batch * a.n_layers * 2 * a.n_kv_heads * a.head_dim * ctx * native(model).dtype.itemsize


def experts_touched(model, batch: int, t: int) -> list[int] | None:
    """Distinct experts per MoE layer in the last forward (reads back: call after timing)."""
    from .models.llama import MoE

    if getattr(model, "runs_fused", None) and model.runs_fused(batch, t):
        n = native(model)
        if not any(isinstance(layer.mlp, MoE) for layer in n.layers):
            return None
        return model.experts_touched.tolist()
    layers = [layer.mlp for layer in native(model).layers if isinstance(layer.mlp, MoE)]
    if not layers:
        return None
    return [int(mlp.last_touched) for mlp in layers]


def measure(model, batch: int, t: int, ctx: int, bandwidth: float, reps: int, warmup: int, seed: int = 0) -> dict:
    """One (batch, T, ctx) point: the forward of T new tokens per sequence after ctx
    cached ones (the cache content does not matter for time)."""
    device = model.device
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.vocab_size, (batch, t), generator=gen).to(device)
    positions = (torch.arange(ctx, ctx + t)[None].expand(batch, t)).contiguous().to(device)
    slots = list(range(batch))
    times = time_fn(lambda: model(tokens, positions, slots), device, reps=reps, warmup=warmup)
    wb = weight_bytes(model)
    touched = experts_touched(model, batch, t)
    weights = wb["dense"] + batch * t * wb["embed_row"] + (sum(touched) * wb["per_expert"] if touched else 0)
    kv = kv_bytes(model, batch, ctx + t)
    ms = statistics.median(times)
    floor_ms = (weights + kv) / bandwidth * 1e3
    row = {
        "batch": batch, "tokens": t, "ctx": ctx, "ms": ms, "ms_min": min(times), "ms_max": max(times),
        "weight_bytes": weights, "kv_bytes": kv, "roofline_ms": floor_ms, "roofline_frac": floor_ms / ms,
        "tok_s": batch * t / (ms * 1e-3),
        "path": "graph" if getattr(model, "runs_fused", None) and model.runs_fused(batch, t) and getattr(model, "use_graphs", False)
        else "fused" if getattr(model, "runs_fused", None) and model.runs_fused(batch, t) else "eager",
    }
    if touched is not None:
        row["experts_touched"] = sum(touched) / len(touched)
    return row


def kernel_breakdown(model, t: int, ctx: int, reps: int = 5) -> dict | None:
    """GPU time per kernel of one fused forward of T tokens (torch.profiler, no graph), next
    to the same forward's graph replay: what the weights' kernels take, what the rest
    takes, and what is left between kernels."""
    fused = getattr(model, "fused", None)
    if fused is None or model.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    dev = model.device
    tokens = torch.randint(0, model.vocab_size, (1, t), device=dev)
    positions = torch.arange(ctx, ctx + t, device=dev)[None]
    slots = torch.zeros(1, dtype=torch.int32, device=dev)
    nvalid = torch.full((1,), t, dtype=torch.int32, device=dev)
    with torch.inference_mode():
        for _ in range(2):
            fused(tokens, positions, slots, nvalid)
        sync(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fused(tokens, positions, slots, nvalid)
            sync(dev)
    kernels: dict[str, list] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us <= 0:
            continue
        name = e.key.split("(")[0][:60]
        k = kernels.setdefault(name, [0, 0.0])
        k[0] += e.count // reps
        k[1] += us / reps / 1e3
    total = sum(v[1] for v in kernels.values())
    return {"tokens": t, "ctx": ctx, "kernel_ms_total": total,
            "kernels": {k: {"calls": v[0], "ms": v[1]} for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][1])}}


def profile_verify(model, tokens: list[int], ctxs: list[int], batches: list[int], reps: int | None = None,
                   warmup: int = 3, on_row=None) -> dict:
    device = model.device
    reps = reps or (20 if device.type == "cuda" else 5)
    if max(batches) > model.num_slots:
        raise ValueError(f"batch {max(batches)} needs {max(batches)} cache slots; the model has {model.num_slots}")
    if max(ctxs) + max(tokens) > model.max_seq_len:
        raise ValueError(f"context {max(ctxs)} + {max(tokens)} tokens exceeds the cache ({model.max_seq_len})")
    bandwidth = copy_bandwidth(device)
    rows = []
    for b in batches:
        for ctx in ctxs:
            for t in tokens:
                rows.append(measure(model, b, t, ctx, bandwidth, reps, warmup))
                if on_row:
                    on_row(rows[-1])
    wb = weight_bytes(model)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(model.dtype).replace("torch.", ""), "torch": torch.__version__,
        "copy_TBps": bandwidth / 1e12, "dense_weight_bytes": wb["dense"], "expert_bytes": wb["per_expert"],
        "moe_layers": wb["moe_layers"], "reps": reps, "rows": rows,
    }


@app.command()
def verify(
    model: str = typer.Option("smollm2-135m", "--model", help="smollm2-135m | HF checkpoint dir | file.gguf | random:<preset|config.json>"),
    tokens: str = typer.Option("1,2,4,8,16,32,64", "--tokens", help="verify widths T (tokens per forward)"),
    ctx: str = typer.Option("1024,8192", "--ctx", help="cached context lengths"),
    batch: str = typer.Option("1", "--batch", help="sequences per forward"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda (default: cuda when available)"),
    reps: Optional[int] = typer.Option(None, "--reps", help="timed forwards per point (default 20 on GPU, 5 on CPU)"),
    no_graphs: bool = typer.Option(False, "--no-graphs", help="eager forward on GPU (no CUDA graphs / fused kernels)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
):
    """Median forward time per (batch, T, ctx), bytes read, and the HBM roofline."""
    from rich.console import Console
    from rich.table import Table

    from .models import ModelSpecError, UnsupportedArchitecture
    from .models.loading import load_model

    err = Console(stderr=True)
    try:
        ts, cs, bs = parse_ints(tokens, "--tokens"), parse_ints(ctx, "--ctx"), parse_ints(batch, "--batch")
        if reps is not None and reps < 1:
            raise ValueError(f"--reps must be >= 1, got {reps}")
        m, _, _ = load_model(model, device=device, num_slots=max(bs), max_seq_len=max(cs) + max(ts),
                             graphs=not no_graphs)
        if max(cs) + max(ts) > m.max_seq_len:
            raise ValueError(f"context {max(cs)} + {max(ts)} tokens exceeds the model's {m.max_seq_len} positions")
        result = profile_verify(m, ts, cs, bs, reps=reps,
                                on_row=None if as_json else lambda r: err.print(
                                    f"[dim]batch {r['batch']} T {r['tokens']} ctx {r['ctx']}: {r['ms']:.3f} ms[/dim]"))
    except (ModelSpecError, UnsupportedArchitecture, ValueError, KeyError, FileNotFoundError) as e:
        err.print(f"[red]error:[/red] {str(e).strip(chr(39))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    result["model"] = model
    if as_json:
        print(json.dumps(result))
        return
    unit = "TB/s" if m.device.type == "cuda" else "GB/s"
    bw = result["copy_TBps"] * (1 if unit == "TB/s" else 1e3)
    table = Table(title=f"{model} · verify cost · {result['device']} {result['dtype']} · copy {bw:.2f} {unit}")
    cols = ["batch", "T", "ctx", "ms", "× T=1", "weights GB", "KV GB", "roofline ms", "of roofline"]
    moe = any("experts_touched" in r for r in result["rows"])
    if moe:
        cols.insert(6, "experts")
    for c in cols:
        table.add_column(c, justify="right")
    base = {}
    for r in result["rows"]:
        key = (r["batch"], r["ctx"])
        base.setdefault(key, r["ms"] if r["tokens"] == min(ts) else None)
        rel = f"{r['ms'] / base[key]:.2f}" if base[key] else "-"
        vals = [str(r["batch"]), str(r["tokens"]), str(r["ctx"]), f"{r['ms']:.3f}", rel, f"{r['weight_bytes'] / 1e9:.2f}",
                f"{r['kv_bytes'] / 1e9:.3f}", f"{r['roofline_ms']:.3f}", f"{100 * r['roofline_frac']:.0f} %"]
        if moe:
            vals.insert(6, f"{r.get('experts_touched', 0):.1f}")
        table.add_row(*vals)
    Console().print(table)
