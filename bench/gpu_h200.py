"""GPU speed on one H200: decode and verify against the HBM roofline, dense and MoE.

    PYTHONPATH=src python3 bench/gpu_h200.py --out bench/results/h200-2026-11-29.json

One run, bf16, batch 1, a 1024-token prompt, 256 new tokens, random weights at the real
shapes (no checkpoints needed):
  * random:llama3-8b — `none` tok/s against the roofline, HF `generate` on the same
    config in the same run, the verify curve T = 1…64, `oracle --k 7` (α = 1) and
    `ngram`, with accept_len and the greedy mismatch against `none`;
  * random:qwen3-30b-a3b — `none` against its active-weight roofline, the verify curve,
    the distinct experts touched per T.
tok/s is the engine's (prefill included, as users see it); decode tok/s leaves the
prefill out and is what the roofline (a per-token floor) is compared with.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
import traceback

import torch

from specscope.drafters import NgramDrafter, NoDrafter, OracleDrafter
from specscope.engine import Engine
from specscope.models.loading import Target, load_model
from specscope.profile import copy_bandwidth, kernel_breakdown, kv_bytes, profile_verify, weight_bytes

PROMPT, NEW = 1024, 256
CURVE = [1, 2, 4, 8, 16, 32, 64]


class IdsOnly:
    """Random-weight models need no text: a tokenizer that decodes to nothing, no EOS."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, **kw):
        return ""


DEVICE = "cuda"


def target_for(spec: str, max_seq_len: int, graphs: bool = True) -> Target:
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    model, config, _ = load_model(spec, device=DEVICE, dtype=dtype, max_seq_len=max_seq_len, graphs=graphs)
    config.eos_token_id = None  # generate exactly NEW tokens
    return Target(spec=spec, backend="native", model=model, tokenizer=IdsOnly(), config=config)


def prompt_ids(vocab: int, n: int = PROMPT, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_engine(target, drafter, prompt, new=NEW) -> dict:
    engine = Engine(target, drafter)
    c = engine.generate_one("p0", prompt, new)
    decode_s = c.wall_s - c.ttft_ms / 1e3
    steps = c.steps
    return {
        "output_ids": c.output_ids, "tokens": len(c.output_ids), "wall_s": c.wall_s, "ttft_ms": c.ttft_ms,
        "tok_s": c.tok_s, "decode_tok_s": (len(c.output_ids) - 1) / decode_s, "steps": len(steps),
        "accept_len": c.accept_len, "accept_rate": c.accept_rate,
        "step_ms_median": statistics.median(s.t_draft_ms + s.t_verify_ms + s.t_host_ms for s in steps) if steps else None,
        "verify_ms_median": statistics.median(s.t_verify_ms for s in steps) if steps else None,
    }


def mismatch(a: list[int], b: list[int]) -> dict:
    n = min(len(a), len(b))
    diff = [i for i in range(n) if a[i] != b[i]]
    return {"rate": len(diff) / n if n else None, "first": diff[0] if diff else None, "compared": n}


def methods(target, vocab: int, out: dict, quick: bool) -> None:
    prompt = prompt_ids(vocab)
    new = 64 if quick else NEW
    # Warm-up: capture the graph buckets these runs use (T = 1…16) and compile kernels;
    # the KV entries written here are overwritten by the prefills below.
    for t in (1, 2, 4, 8, 16, len(prompt)):  # the last one: a full-length (eager) prefill
        target.model(torch.tensor([prompt[:t]], device=DEVICE), torch.arange(t, device=DEVICE)[None], [0])
    Engine(target, NoDrafter()).generate_one("w", prompt[:64], 8)
    Engine(target, OracleDrafter({"w": list(range(16))}, vocab, k=7)).generate_one("w", prompt[:64], 16)
    Engine(target, NgramDrafter(k=8)).generate_one("w", prompt[:64] * 2, 16)
    none = run_engine(target, NoDrafter(), prompt, new)
    out["none"] = {k: v for k, v in none.items() if k != "output_ids"}
    ref = none["output_ids"]
    for name, drafter in (("oracle_k7", OracleDrafter({"p0": ref}, vocab, k=7, alpha=1.0)), ("ngram", NgramDrafter(k=8))):
        r = run_engine(target, drafter, prompt, new)
        r["mismatch_vs_none"] = mismatch(ref, r.pop("output_ids"))
        r["speedup"] = r["tok_s"] / none["tok_s"]
        r["decode_speedup"] = r["decode_tok_s"] / none["decode_tok_s"]
        out[name] = r
        print(f"  {name}: {r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x), accept_len {r['accept_len']:.2f}, "
              f"mismatch {r['mismatch_vs_none']}", flush=True)


def roofline(model, bandwidth: float, active_experts: int | None = None) -> dict:
    wb = weight_bytes(model)
    weights = wb["dense"] + wb["embed_row"] + (wb["moe_layers"] * active_experts * wb["per_expert"] if active_experts else 0)
    kv = kv_bytes(model, 1, PROMPT + NEW // 2)  # average context over the run
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes_per_token": weights + kv,
            "ms_per_token": (weights + kv) / bandwidth * 1e3, "tok_s": bandwidth / (weights + kv)}


def hf_generate(config_spec: str, quick: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from specscope.models.loading import resolve

    config, _, _ = resolve(config_spec)
    with torch.device(DEVICE):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval()
    ids = torch.tensor([prompt_ids(config.vocab_size)], device=DEVICE)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        hf.generate(ids[:, :64], max_new_tokens=4, min_new_tokens=4, **kw)
        new = 32 if quick else NEW
        sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        sync()
        wall = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    del hf
    return {"tokens": n, "wall_s": wall, "tok_s": n / wall}


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer tokens: a smoke test of the whole script")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: hf,llama,moe")
    ap.add_argument("--llama", default="random:llama3-8b", help="the dense model (a smaller one for smoke tests)")
    ap.add_argument("--moe", default="random:qwen3-30b-a3b", help="the MoE model")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    global DEVICE
    DEVICE = args.device
    dev = torch.device(DEVICE)
    res: dict = {
        "date": time.strftime("%Y-%m-%d"), "command": "PYTHONPATH=src python3 bench/gpu_h200.py " + " ".join(
            f"--{k} {v}" if not isinstance(v, bool) else f"--{k}" for k, v in vars(args).items() if v),
        "hardware": {"device": torch.cuda.get_device_name(dev) if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                     "cuda": torch.version.cuda, "python": platform.python_version()},
        "setup": {"dtype": "bfloat16", "batch": 1, "prompt_tokens": PROMPT, "new_tokens": NEW, "weights": "random"},
        "errors": {},
    }
    import transformers
    import triton

    res["hardware"].update(transformers=transformers.__version__, triton=triton.__version__)
    bw = copy_bandwidth(dev)
    res["copy_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    def part(name, fn):
        if name in skip:
            return
        t0 = time.time()
        try:
            fn()
        except Exception:
            res["errors"][name] = traceback.format_exc()
            print(res["errors"][name], flush=True)
        free()
        print(f"[{name}: {time.time() - t0:.0f}s]", flush=True)

    def hf():
        res["hf_generate"] = hf_generate(args.llama, args.quick)
        print(f"HF generate: {res['hf_generate']['tok_s']:.1f} tok/s", flush=True)

    def llama():
        t = target_for(args.llama, max_seq_len=8192 + 128)
        out = res["llama3-8b"] = {"roofline": roofline(t.model, bw)}
        methods(t, t.model.vocab_size, out, args.quick)
        print(f"  none: {out['none']['tok_s']:.1f} tok/s, decode {out['none']['decode_tok_s']:.1f} "
              f"(roofline {out['roofline']['tok_s']:.0f})", flush=True)
        out["verify_curve"] = profile_verify(t.model, CURVE, [1024] if args.quick else [1024, 8192], [1])
        for r in out["verify_curve"]["rows"]:
            print(f"  verify T={r['tokens']:2d} ctx={r['ctx']}: {r['ms']:.3f} ms ({100 * r['roofline_frac']:.0f} % of roofline)")
        out["kernels"] = [kernel_breakdown(t.model, n, 1024) for n in (1, 8)]
        # The same forward without graphs and fused kernels (the eager native model).
        eager = getattr(t.model, "inner", t.model)
        out["eager_verify_curve"] = profile_verify(eager, [1, 8], [1024], [1], reps=5)

    def moe():
        t = target_for(args.moe, max_seq_len=2048)
        a = t.model.arch
        out = res["qwen3-30b-a3b"] = {"roofline": roofline(t.model, bw, active_experts=a.experts_per_token)}
        methods(t, t.model.vocab_size, out, args.quick)
        print(f"  none: {out['none']['tok_s']:.1f} tok/s, decode {out['none']['decode_tok_s']:.1f} "
              f"(active-weight roofline {out['roofline']['tok_s']:.0f})", flush=True)
        out["verify_curve"] = profile_verify(t.model, CURVE, [1024], [1])
        out["kernels"] = [kernel_breakdown(t.model, n, 1024) for n in (1, 8)]
        for r in out["verify_curve"]["rows"]:
            print(f"  verify T={r['tokens']:2d}: {r['ms']:.3f} ms, experts/layer {r.get('experts_touched', 0):.1f} "
                  f"({100 * r['roofline_frac']:.0f} % of roofline)")

    def show_kernels(name):
        for kb in (res.get(name) or {}).get("kernels") or []:
            if not kb:
                continue
            ms = {r["tokens"]: r["ms"] for r in res[name]["verify_curve"]["rows"] if r["ctx"] == 1024}
            print(f"  {name} T={kb['tokens']}: kernels {kb['kernel_ms_total']:.3f} ms of {ms.get(kb['tokens'], 0):.3f} ms (graph)")
            for k, v in list(kb["kernels"].items())[:8]:
                print(f"    {v['ms']:.3f} ms  {v['calls']:4d}x  {k}")

    part("hf", hf)
    part("llama", llama)
    part("moe", moe)
    show_kernels("llama3-8b")
    show_kernels("qwen3-30b-a3b")

    L, Q = res.get("llama3-8b", {}), res.get("qwen3-30b-a3b", {})

    def curve_ms(d):
        return {r["tokens"]: r["ms"] for r in d.get("verify_curve", {}).get("rows", []) if r["ctx"] == 1024}

    def g(d, *keys):
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d

    v = curve_ms(L)
    res["summary"] = {
        "copy_TBps": res["copy_TBps"],
        "roofline_tok_s": g(L, "roofline", "tok_s"),
        "none_tok_s": g(L, "none", "tok_s"),
        "none_decode_tok_s": g(L, "none", "decode_tok_s"),
        "none_frac_of_roofline": (g(L, "none", "decode_tok_s") or 0) / (g(L, "roofline", "tok_s") or 1),
        "hf_generate_tok_s": g(res, "hf_generate", "tok_s"),
        "oracle_k7_tok_s": g(L, "oracle_k7", "tok_s"),
        "oracle_k7_speedup": g(L, "oracle_k7", "speedup"),
        "oracle_k7_accept_len": g(L, "oracle_k7", "accept_len"),
        "ngram_tok_s": g(L, "ngram", "tok_s"),
        "ngram_accept_len": g(L, "ngram", "accept_len"),
        "verify_ms": v,
        "verify_t8_over_t1": v[8] / v[1] if 1 in v and 8 in v else None,
        "verify_t32_over_t1": v[32] / v[1] if 1 in v and 32 in v else None,
        "moe_none_tok_s": g(Q, "none", "tok_s"),
        "moe_none_decode_tok_s": g(Q, "none", "decode_tok_s"),
        "moe_roofline_tok_s": g(Q, "roofline", "tok_s"),
        "moe_frac_of_roofline": (g(Q, "none", "decode_tok_s") or 0) / (g(Q, "roofline", "tok_s") or 1),
        "moe_verify_ms": curve_ms(Q),
        "moe_experts_touched": {r["tokens"]: r.get("experts_touched") for r in g(Q, "verify_curve", "rows") or []},
        "mismatch_vs_none": {f"{m}/{k}": g(d, k, "mismatch_vs_none", "rate") for m, d in
                             (("llama3-8b", L), ("qwen3-30b-a3b", Q)) for k in ("oracle_k7", "ngram")},
    }
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
