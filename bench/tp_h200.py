"""Tensor-parallel verify on several GPUs: how much of a verify step is all-reduce.

    PYTHONPATH=src python3 bench/tp_h200.py --tp 1,2 --out bench/results/h200x2-2026-11-29.json

For each model (random weights at the real shapes, bf16, batch 1, `--ctx` cached tokens)
and each TP degree, one torchrun launch of this file measures the verify curve T = 1…64
of the native model's forward (CUDA events; the slowest rank's median):
  * `ms`: the forward with its collectives (2 all-reduces per layer, the embedding's
    all-reduce and the lm_head's all-gather), captured in a CUDA graph for this context
    length, as SGLang and vLLM run decode and verify steps;
  * `ms_no_comm`: the same graph with every collective replaced by a no-op on a tensor of
    the same shape, so `comm_ms = ms - ms_no_comm` is what communication adds to the step;
  * `nccl_kernel_ms` / `kernel_ms`: GPU time of NCCL kernels and of all kernels in one
    replay, from torch.profiler (an NCCL kernel's time includes waiting for the slower
    rank);
  * `ms_eager`: the forward without a graph, as the engine runs tensor parallelism today
    (host-bound: its launches, not its bytes, set the time);
  * at TP 1, `ms_fused_graph`: the fused-kernel graph the engine runs on one GPU (the
    fused kernels are single-GPU, so TP runs the plain eager kernels).
Then `specscope comm`'s all-reduce sweep at each model's hidden size (and `--comm-hidden`),
eager and in a CUDA graph. Everything goes into one JSON with the command, the GPUs and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

CURVE = [1, 2, 4, 8, 16, 32, 64]
# NVLink multicast stays off on shared hosts (it can take the host's GPUs down).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def child(args) -> None:
    """One torchrun rank (or the only process at TP 1): the verify curve of one model."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from specscope.models.loading import load_model
    from specscope.profile import time_fn

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device == "cuda"
    model, config, _ = load_model(args.model, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32,
                                  max_seq_len=args.ctx + max(CURVE), graphs=world == 1)
    inner = getattr(model, "inner", model)
    tp = getattr(inner, "tp", None)
    rank = tp.rank if tp else 0
    device = inner.device

    def slowest(ms: float) -> float:
        if not tp:
            return ms
        t = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def curve_point(fn, t: int) -> float:
        return slowest(statistics.median(time_fn(fn, device, reps=args.reps, warmup=3)))

    def kernel_ms(fn, reps: int = 5) -> tuple[float, float] | tuple[None, None]:
        if not cuda:
            return None, None
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        total = nccl = 0.0
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            total += us
            if "nccl" in e.key.lower():
                nccl += us
        return nccl / reps / 1e3, total / reps / 1e3

    def captured(fn):
        """fn as one CUDA graph replay: how a serving engine runs a decode/verify step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up outside the capture (NCCL's setup, the allocator)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    gen = torch.Generator().manual_seed(0)
    rows = []
    for t in CURVE:
        tokens = torch.randint(0, config.vocab_size, (1, t), generator=gen).to(device)
        positions = torch.arange(args.ctx, args.ctx + t, device=device)[None]
        # kv_len given: no host sync in the forward, so it can be captured (for this length)
        eager = lambda: inner(tokens, positions, [0], kv_len=args.ctx + t)  # noqa: E731
        row = {"tokens": t, "ctx": args.ctx}
        if tp:
            tp.take_stats()
            eager()
            stats = tp.take_stats()
            row.update(collectives=stats.count, comm_bytes=stats.bytes)
        step = captured(eager) if cuda else eager
        row["ms"] = curve_point(step, t)
        row["nccl_kernel_ms"], row["kernel_ms"] = kernel_ms(step)
        if cuda:
            row["ms_eager"] = curve_point(eager, t)
        if tp:
            real = tp.all_reduce, tp.all_gather_last
            tp.all_reduce = lambda x: x
            tp.all_gather_last = lambda x: torch.cat([x] * tp.world, dim=-1)
            row["ms_no_comm"] = curve_point(captured(eager) if cuda else eager, t)
            tp.all_reduce, tp.all_gather_last = real
            row["comm_ms"] = row["ms"] - row["ms_no_comm"]
            row["comm_share"] = row["comm_ms"] / row["ms"]
        elif cuda:
            row["ms_fused_graph"] = curve_point(lambda: model(tokens, positions, [0]), t)
        del step
        rows.append(row)
        if rank == 0:
            print(f"[{args.model} tp{world}] T={t}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)), file=sys.stderr, flush=True)
    if rank == 0:
        with open(args.child_out, "w") as f:
            json.dump({"model": args.model, "tp": world, "hidden": config.hidden_size,
                       "layers": config.num_hidden_layers, "rows": rows}, f)
    if tp:
        dist.destroy_process_group()


def launch(model: str, tp: int, args, out: str) -> dict:
    here = os.path.abspath(__file__)
    cmd = [sys.executable, here, "--child", "--model", model, "--ctx", str(args.ctx), "--reps", str(args.reps),
           "--device", args.device, "--child-out", out]
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", *cmd[1:]]
    started = time.time()
    proc = subprocess.run(cmd, env={**os.environ, **SAFE_ENV}, timeout=args.timeout)
    if proc.returncode != 0:
        return {"model": model, "tp": tp, "error": f"exit {proc.returncode}", "command": shlex.join(cmd)}
    with open(out) as f:
        result = json.load(f)
    result["wall_s"] = time.time() - started
    return result


def gpus() -> dict:
    import torch

    info = {"count": torch.cuda.device_count(),
            "names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    try:
        info["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                          timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        info["topology"] = f"nvidia-smi topo -m failed: {e}"
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="random:llama3-8b,random:qwen3-30b-a3b")
    p.add_argument("--tp", default="1,2", help="TP degrees to run (each needs that many GPUs)")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--comm-tokens", default=",".join(map(str, CURVE)))
    p.add_argument("--comm-hidden", default="7168", help="hidden sizes swept besides the models' (7168: DeepSeek-V3)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    p.add_argument("--device", default="cuda", help="cuda | cpu (cpu: gloo, a check of the script, not a measurement)")
    p.add_argument("--out", help="the JSON report (required)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if not args.out:
        p.error("--out is required")

    import torch
    import transformers

    from specscope.comm import payload_sizes, sweep

    os.environ.update(SAFE_ENV)
    degrees = [int(v) for v in args.tp.split(",")]
    available = torch.cuda.device_count() if args.device == "cuda" else os.cpu_count()
    if max(degrees) > available:
        sys.exit(f"--tp {args.tp} needs {max(degrees)} GPUs; this machine has {available}")
    report = {"command": shlex.join(["python3", "bench/tp_h200.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d"),
              "gpus": gpus(), "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
              "env": {k: os.environ.get(k) for k in SAFE_ENV}, "dtype": "bfloat16", "batch": 1,
              "curves": [], "comm": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    hidden_sizes = [int(h) for h in args.comm_hidden.split(",") if h]
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for tp in degrees:
                print(f"== {model} at TP {tp}", file=sys.stderr, flush=True)
                try:
                    result = launch(model, tp, args, os.path.join(tmp, "child.json"))
                except subprocess.TimeoutExpired:
                    result = {"model": model, "tp": tp, "error": f"timed out after {args.timeout} s"}
                report["curves"].append(result)
                if "hidden" in result and result["hidden"] not in hidden_sizes:
                    hidden_sizes.append(result["hidden"])
                save()  # nothing lost if a later launch fails
    tokens = [int(v) for v in args.comm_tokens.split(",")]
    for world in (d for d in degrees if d > 1):
        for hidden in hidden_sizes:
            print(f"== all-reduce sweep, {world} GPUs, hidden {hidden}", file=sys.stderr, flush=True)
            res = sweep(world, payload_sizes(hidden, tokens), iters=100, graph=args.device == "cuda")
            report["comm"].append({"hidden": hidden, **res})
            save()
    save()
    print(json.dumps({"curves": [{k: c.get(k) for k in ("model", "tp", "error", "wall_s")} for c in report["curves"]]}))


if __name__ == "__main__":
    main()
