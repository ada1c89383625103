"""Tile sweep for the skinny GEMM (models/kernels.py:linear) on the weight shapes of
llama3-8b and qwen3-30b-a3b, the way the forward runs them: fused prologue/epilogue,
weights rotated through more than L2 holds, launches captured in a CUDA graph.

    PYTHONPATH=src python3 bench/gemv_sweep.py --out sweep.json

Prints the best (BN, BK, warps, stages) per (N, K, tile height) as a `TUNED` table for
kernels.py, with the bandwidth each reached.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from specscope.models import kernels as K

# name: (N out, K, flags). gate_up's weight has 2N rows (gate; up).
SHAPES = {
    "llama3-8b.gate_up": (14336, 4096, "silu"),
    "llama3-8b.down": (4096, 14336, "res"),
    "llama3-8b.qkv": (6144, 4096, "norm"),
    "llama3-8b.wo": (4096, 4096, "res"),
    "llama3-8b.lm_head": (128256, 4096, "head"),
    "qwen3-30b-a3b.qkv": (5120, 2048, "norm"),
    "qwen3-30b-a3b.wo": (2048, 4096, "res"),
    "qwen3-30b-a3b.lm_head": (151936, 2048, "head"),
}


SPLIT_SHAPES = ("llama3-8b.qkv", "llama3-8b.wo", "qwen3-30b-a3b.qkv", "qwen3-30b-a3b.wo")


def configs(bm: int, name: str = ""):
    """(BN, BK, warps, stages, split-K parts). Split-K only for the small matrices, whose
    few output tiles leave SMs idle (wave quantization) without it."""
    out = []
    if bm == 16:
        splits = (1, 2, 4) if name in SPLIT_SHAPES else (1,)
        for bn in (16, 32, 64):
            for bk in (256, 512):
                for stages in (3, 5):
                    for sp in splits:
                        out.append((bn, bk, 4, stages, sp))
        return out + [(128, 128, 8, 4, 1)]
    for bn in (32, 64, 128):
        out += [(bn, 128, 4, 3, 1), (bn, 128, 4, 5, 1), (bn, 256, 4, 3, 1)]
    return out


def fits(bm, cfg, flags):
    return K.smem_bytes(bm, cfg[0], cfg[1], cfg[3], 2 if flags == "silu" else 1) <= K.SMEM_BUDGET


def run_one(n, k, flags, m, cfg, ws, x, norm, res):
    kw = dict(config=cfg)
    if flags == "norm":
        kw.update(norm=norm)
    elif flags == "res":
        kw.update(residual=res)
    elif flags == "silu":
        kw.update(norm=norm, silu_mul=True)
    elif flags == "head":
        kw.update(norm=norm, out_dtype=torch.float32)
    return lambda w: K.linear(x, w, **kw)


def time_config(fn, ws, weight_bytes):
    launches = max(len(ws), 8)
    fn(ws[0])  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            fn(ws[i % len(ws)])
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / launches)
    ms = statistics.median(times)
    return ms, weight_bytes / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_sweep.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--bms", default="16,32,64", help="tile heights to sweep")
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    results, best = [], {}
    t0 = time.time()
    for name in args.shapes.split(","):
        n, k, flags = SHAPES[name]
        rows = 2 * n if flags == "silu" else n
        weight_bytes = rows * k * 2
        copies = max(1, math.ceil(200e6 / weight_bytes))
        ws = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        norm = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
        for bm, ms_ in ((16, (1, 16)), (32, (32,)), (64, (64,))):
            if str(bm) not in args.bms.split(","):
                continue
            scores = {}
            for cfg in configs(bm, name):
                if not fits(bm, cfg, flags):
                    continue
                per_m = {}
                for m in ms_:
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    res = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
                    try:
                        ms, tbps = time_config(run_one(n, k, flags, m, cfg, ws, x, norm, res), ws, weight_bytes)
                    except Exception as e:  # a tile that does not fit (shared memory) is just skipped
                        print(f"{name} M={m} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    per_m[m] = (ms, tbps)
                    results.append(dict(shape=name, n=n, k=k, m=m, bm=bm, config=cfg, ms=ms, tbps=tbps))
                if len(per_m) == len(ms_):
                    scores[cfg] = sum(v[0] for v in per_m.values())
            if scores:
                cfg = min(scores, key=scores.get)
                best[(n, k, bm)] = cfg
                got = [r["tbps"] for r in results if r["shape"] == name and r["bm"] == bm and r["config"] == cfg]
                print(f"{name:24s} BM={bm:2d} best {cfg} -> {', '.join(f'{t:.2f}' for t in got)} TB/s "
                      f"(before {K.linear_config(n, k, bm)}) [{time.time() - t0:.0f}s]", flush=True)
        del ws
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after every shape: a timeout keeps what finished
            json.dump(dict(results=results, best={f"{n},{k},{bm}": c for (n, k, bm), c in best.items()}), f)
    print("TUNED = {")
    for (n, k, bm), cfg in best.items():
        print(f"    ({n}, {k}, {bm}): {cfg},")
    print("}")
    with open(args.out, "w") as f:
        json.dump(dict(results=results, best={f"{n},{k},{bm}": c for (n, k, bm), c in best.items()},
                       device=torch.cuda.get_device_name(), torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    main()
