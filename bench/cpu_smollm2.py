"""CPU benchmark: specscope `none` / `ngram` against transformers `generate` (plain and
prompt lookup) on SmolLM2-135M, fp32, greedy, same prompts, one process.

    .venv/bin/python bench/cpu_smollm2.py [--num-prompts 8] [--max-new-tokens 128] [--threads N]

Method notes (also written into the JSON):
- Every method stops at EOS. tok/s = generated tokens (EOS included, as both libraries
  return it) / wall seconds of the generate call, summed over the prompts of a workload.
  Equal work is checked rather than forced: the output-equality section shows whether
  both sides produced the same tokens, hence the same count.
- tok/cpu-s (tokens per CPU second of this process) is a cross-check for a shared machine:
  with --threads 1 it leaves out the time other processes held the core.
- Methods are interleaved prompt by prompt (their order rotating from one prompt to the
  next), so machine noise lands on all of them alike. Each method is warmed up once first.
- accept_len: for specscope, Completion's own (tokens per verify step, prefill excluded).
  transformers has no prefill-only pass in assisted decoding (its first forward verifies
  the prompt's candidates too), so there accept_len = generated tokens / forward passes,
  counted with a forward hook on the model. tokens_per_forward = generated tokens / all
  forward passes (prefill included) is given for every method on one footing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from specscope.drafters import NgramDrafter, NoDrafter
from specscope.engine import Engine, encode_prompt
from specscope.models.loading import gguf_as_hf_dir, load_target, smollm2_gguf
from specscope.workloads import load_workload

WORKLOADS = ("humaneval", "sharegpt")
CLI_K, CLI_NGRAM_MIN, CLI_NGRAM_MAX = 8, 1, 4  # specscope's CLI defaults (cli.py KOpt, NMinOpt, NMaxOpt)
HF_LOOKUP = 10  # prompt_lookup_num_tokens


def git_state() -> str:
    """HEAD's commit, with '+dirty' when src/ differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src"]).returncode != 0
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Runner:
    """One method: run(ids, max_new) -> (output ids, target forward passes, accept_len stats)."""

    def __init__(self, name: str, describe: str):
        self.name, self.describe = name, describe


class Ours(Runner):
    def __init__(self, name, describe, target, make_drafter):
        super().__init__(name, describe)
        self.engine = Engine(target, make_drafter())
        self.split = {"prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "host_s": 0.0}

    def run(self, rid, ids, max_new):
        c = self.engine.generate_one(rid, ids, max_new)
        if rid != "warmup":  # where the engine's time goes (its own per-step timers)
            self.split["prefill_s"] += c.ttft_ms / 1e3
            for s in c.steps:
                self.split["draft_s"] += s.t_draft_ms / 1e3
                self.split["verify_s"] += s.t_verify_ms / 1e3
                self.split["host_s"] += s.t_host_ms / 1e3
        steps = len(c.steps)
        return c.output_ids, steps + 1, (sum(s.accepted + 1 for s in c.steps), steps)


class HF(Runner):
    def __init__(self, name, describe, model, eos, **gen_kwargs):
        super().__init__(name, describe)
        self.model, self.eos, self.kwargs = model, eos, gen_kwargs
        self.forwards = 0
        model.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def run(self, rid, ids, max_new):
        x = torch.tensor([ids])
        self.forwards = 0
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                      eos_token_id=self.eos, pad_token_id=self.eos[0], **self.kwargs)
        new = out[0, len(ids):].tolist()
        return new, self.forwards, (len(new), self.forwards)


def aggregate(rows: list[dict]) -> dict:
    tokens = sum(r["output_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    emitted, steps = sum(r["acc"][0] for r in rows), sum(r["acc"][1] for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    # CPU seconds per wall second per torch thread: well below 1 means another process took the cores.
    cpu = sum(r["cpu_s"] for r in rows)
    cpu_util = cpu / (wall * torch.get_num_threads()) if wall else None
    return {"prompts": len(rows), "output_tokens": tokens, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
            "cpu_util": cpu_util, "tok_s": tokens / wall if wall else 0.0, "tok_per_cpu_s": tokens / cpu if cpu else 0.0,
            "accept_len": emitted / steps if steps else None, "forwards": forwards,
            "tokens_per_forward": tokens / forwards if forwards else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per workload (HumanEval, ShareGPT)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own choice)")
    ap.add_argument("--out", type=Path, default=Path(f"bench/results/cpu-smollm2-{datetime.date.today()}.json"))
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    console = Console(width=130)

    target = load_target("smollm2-135m", device="cpu", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(gguf_as_hf_dir(smollm2_gguf()), dtype=torch.float32).eval()
    eos = sorted(target.eos_ids)
    prompts = [p for w in WORKLOADS for p in load_workload(w, args.num_prompts)]
    encoded = [(p.id, p.workload, encode_prompt(target, p)) for p in prompts]

    ngram = lambda k: (lambda: NgramDrafter(k=k, n_min=CLI_NGRAM_MIN, n_max=CLI_NGRAM_MAX))  # noqa: E731
    runners: list[Runner] = [
        HF("hf_generate", "transformers generate, greedy", hf, eos),
        HF("hf_prompt_lookup", f"transformers generate, prompt_lookup_num_tokens={HF_LOOKUP} "
           "(max_matching_ngram_size 2, its default)", hf, eos, prompt_lookup_num_tokens=HF_LOOKUP),
        Ours("ours_none", "specscope none", target, NoDrafter),
        Ours("ours_ngram_k8", f"specscope ngram, CLI defaults k={CLI_K} n={CLI_NGRAM_MIN}..{CLI_NGRAM_MAX}", target,
             ngram(CLI_K)),
        Ours("ours_ngram_k10", f"specscope ngram k={HF_LOOKUP} n={CLI_NGRAM_MIN}..{CLI_NGRAM_MAX} (k as HF)", target,
             ngram(HF_LOOKUP)),
    ]

    for r in runners:  # warm-up: first calls pay allocator and kernel set-up
        r.run("warmup", encoded[0][2], min(32, args.max_new_tokens))

    load_start = os.getloadavg()
    per_prompt, outputs = [], {r.name: {} for r in runners}
    for i, (rid, workload, ids) in enumerate(encoded):
        row = {"id": rid, "workload": workload, "prompt_tokens": len(ids), "methods": {}}
        order = runners[i % len(runners):] + runners[: i % len(runners)]
        for r in order:
            t0, c0 = time.perf_counter(), time.process_time()
            out, forwards, acc = r.run(rid, ids, args.max_new_tokens)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            outputs[r.name][rid] = out
            row["methods"][r.name] = {"output_tokens": len(out), "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                                      "forwards": forwards, "acc": acc, "eos": bool(out and out[-1] in eos)}
        per_prompt.append(row)
        console.print(f"[dim]{i + 1}/{len(encoded)} {rid}: " + ", ".join(
            f"{n} {m['output_tokens'] / m['wall_s']:.1f}" for n, m in row["methods"].items()) + " tok/s[/dim]")
    load_end = os.getloadavg()

    results = {}
    for r in runners:
        rows = {w: [p["methods"][r.name] for p in per_prompt if p["workload"] == w] for w in WORKLOADS}
        results[r.name] = {"describe": r.describe, "all": aggregate(sum(rows.values(), [])),
                           **{w: aggregate(rows[w]) for w in WORKLOADS}}
        if isinstance(r, Ours):
            results[r.name]["engine_time_split"] = {k: round(v, 3) for k, v in r.split.items()}
    for p in per_prompt:
        for m in p["methods"].values():
            emitted, steps = m.pop("acc")
            m["accept_len"] = emitted / steps if steps else None

    def same(a: str, b: str) -> dict:
        diffs = {}
        for rid, _, _ in encoded:
            x, y = outputs[a][rid], outputs[b][rid]
            if x != y:
                diffs[rid] = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        return {"match": len(encoded) - len(diffs), "of": len(encoded), "first_divergence": diffs}

    equality = {"ours_none_vs_hf_generate": same("ours_none", "hf_generate"),
                "ours_ngram_k8_vs_ours_none": same("ours_ngram_k8", "ours_none"),
                "ours_ngram_k10_vs_ours_none": same("ours_ngram_k10", "ours_none"),
                "hf_prompt_lookup_vs_hf_generate": same("hf_prompt_lookup", "hf_generate")}

    scopes = ("all",) + WORKLOADS
    pairs = (("ours_none", "hf_generate"), ("ours_ngram_k8", "hf_prompt_lookup"), ("ours_ngram_k10", "hf_prompt_lookup"),
             ("ours_ngram_k8", "ours_none"), ("hf_prompt_lookup", "hf_generate"))
    # tok_s (wall clock) is the measure; tok_per_cpu_s is a cross-check that another process on the
    # machine disturbs less (with one thread it counts only the time this process ran).
    ratios, ratios_cpu = ({f"{a}/{b}": {w: results[a][w][key] / results[b][w][key] for w in scopes} for a, b in pairs}
                          for key in ("tok_s", "tok_per_cpu_s"))
    goals = {f"{pair} >= {need}x ({w})": {"met": ratios[pair][w] >= need, "met_by_cpu_time": ratios_cpu[pair][w] >= need}
             for pair, w, need in (("ours_none/hf_generate", "all", 1.2),
                                   ("ours_ngram_k8/hf_prompt_lookup", "humaneval", 1.3),
                                   ("ours_ngram_k10/hf_prompt_lookup", "humaneval", 1.3))}

    report = {
        "benchmark": "cpu_smollm2", "date": str(datetime.date.today()),
        "command": shlex.join([os.path.relpath(sys.executable), *sys.argv]), "git": git_state(),
        "hardware": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "loadavg_start": load_start, "loadavg_end": load_end},
        "settings": {"model": "smollm2-135m (GGUF Q4_1 de-quantised, fp32; same weights for both)", "dtype": "float32",
                     "greedy": True, "num_prompts_per_workload": args.num_prompts,
                     "max_new_tokens": args.max_new_tokens, "eos_ids": eos, "stop": "EOS or max_new_tokens",
                     "timing": "perf_counter around each generate call; prompt-major, rotating method order; "
                               "one warm-up per method",
                     "accept_len": "specscope: tokens per verify step, prefill excluded (Completion.accept_len); "
                                   "transformers: generated tokens / forward passes (forward hook; its first "
                                   "forward is prefill + verify)"},
        "methods": results, "ratios": ratios,
        "ratios_by_cpu_time": ratios_cpu, "goals": goals, "equality": equality, "per_prompt": per_prompt,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")

    table = Table(title=f"SmolLM2-135M fp32 · CPU ({cpu_model()}, {torch.get_num_threads()} threads) · "
                        f"{args.num_prompts}+{args.num_prompts} prompts · {args.max_new_tokens} new tokens")
    for col in ("method", "workload", "tok/s", "tok/cpu-s", "accept_len", "tokens", "wall s", "cpu util"):
        table.add_column(col, justify="left" if col in ("method", "workload") else "right")
    for r in runners:
        for w in scopes:
            s = results[r.name][w]
            acc = "-" if s["accept_len"] is None else f"{s['accept_len']:.2f}"
            table.add_row(r.name, w, f"{s['tok_s']:.1f}", f"{s['tok_per_cpu_s']:.1f}", acc, str(s["output_tokens"]),
                          f"{s['wall_s']:.1f}", f"{s['cpu_util']:.2f}")
    console.print(table)
    for name, by in ratios.items():
        console.print(f"{name}: " + ", ".join(f"{w} {v:.2f}x" for w, v in by.items())
                      + "  (by CPU time: " + ", ".join(f"{w} {v:.2f}x" for w, v in ratios_cpu[name].items()) + ")")
    for name, g in goals.items():
        console.print(f"goal {name}: " + ("[green]met[/green]" if g["met"] else "[red]not met[/red]")
                      + f" (by CPU time: {'met' if g['met_by_cpu_time'] else 'not met'})")
    for name, e in equality.items():
        console.print(f"equal outputs {name}: {e['match']}/{e['of']}")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
