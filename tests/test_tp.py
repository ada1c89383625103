"""Tensor parallelism on CPU: two gloo processes on loopback hold half of every layer each;
their logits and greedy speculative outputs must equal a single process's."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from specscope.comm import free_port
from specscope.drafters import NgramDrafter, NoDrafter
from specscope.engine import Engine
from specscope.models import load_target
from specscope.models.loading import PRESETS

PROMPTS = [("a", [5, 9, 3, 5, 9, 3, 5, 9]), ("b", [17, 2, 33, 4, 17, 2])]


def run_model(spec, out_path):
    target = load_target(spec, device="cpu", dtype=torch.float32, max_seq_len=128, seed=4)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
    logits = target.model(ids, torch.arange(11)[None], [0])
    outputs = {}
    for name, drafter in (("none", NoDrafter()), ("ngram", NgramDrafter(k=4, n_min=1, n_max=3, branches=2))):
        outputs[name] = [c.output_ids for c in Engine(target, drafter).generate(PROMPTS, 24)]
    stats = target.model.tp.take_stats() if getattr(target.model, "tp", None) else None
    target.model(ids[:, :1], torch.tensor([[0]]), [0])
    one = target.model.tp.take_stats() if stats else None
    torch.save({"logits": logits, "outputs": outputs, "per_forward": one and (one.count, one.bytes)}, out_path)


def _rank(rank, world, port, spec, out_dir):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    run_model(spec, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-moe"])
def test_two_rank_tp_equals_single_process(tmp_path, preset):
    cfg = dict(PRESETS[preset], vocab_size=64, eos_token_id=None, bos_token_id=None)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    spec = f"random:{path}"
    run_model(spec, tmp_path / "single.pt")
    mp.spawn(_rank, args=(2, free_port(), spec, str(tmp_path)), nprocs=2, join=True)
    single = torch.load(tmp_path / "single.pt")
    for rank in (0, 1):
        sharded = torch.load(tmp_path / f"rank{rank}.pt")
        rel = ((sharded["logits"] - single["logits"]).norm() / single["logits"].norm()).item()
        assert rel <= 1e-5
        assert sharded["outputs"] == single["outputs"]
        # 2 all-reduces per layer + the embedding's, and the lm_head gather, for one token.
        count, nbytes = sharded["per_forward"]
        layers = cfg["num_hidden_layers"]
        assert count == 2 * layers + 2
        assert nbytes == (2 * layers + 1) * cfg["hidden_size"] * 4 + (cfg["vocab_size"] // 2) * 4


def test_indivisible_heads_are_a_clear_error(tmp_path):
    cfg = dict(PRESETS["tiny"], num_attention_heads=3, num_key_value_heads=3, head_dim=16, hidden_size=48)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    from specscope.models.llama import Transformer
    from specscope.models.loading import config_from_dict
    from specscope.models.tp import TPGroup, shard

    with pytest.raises(ValueError, match=r"attention heads \(3\) divisible by 2"):
        shard(Transformer(config_from_dict(cfg)), TPGroup(0, 2))


def test_torchrun_cli_matches_single_process(tmp_path):
    """`torchrun -m specscope generate` on two CPU ranks prints one result, rank 0's, equal
    to the single-process output."""
    import subprocess
    import sys

    bindir = os.path.dirname(sys.executable)
    args = ["generate", "--model", "random:tiny", "--prompt", "one two one two one", "--method", "ngram",
            "--max-new-tokens", "12", "--json", "--db", str(tmp_path / "t.db")]
    single = subprocess.run([os.path.join(bindir, "specscope"), *args], capture_output=True, text=True, timeout=300)
    tp = subprocess.run([os.path.join(bindir, "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
                         "-m", "specscope", *args], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0 and tp.returncode == 0, tp.stderr[-2000:]
    (line,) = tp.stdout.splitlines()
    assert json.loads(line)["output_ids"] == json.loads(single.stdout)["output_ids"]
    # Rank 0 recorded every verify step's collectives: 2 per layer + embedding + lm_head gather.
    from specscope.trace import TraceStore

    with TraceStore(tmp_path / "t.db") as store:
        tp_run = max(r["id"] for r in store.runs())
        steps = store.steps(tp_run)
    layers = PRESETS["tiny"]["num_hidden_layers"]
    assert steps and all(s["comm_count"] == 2 * layers + 2 and s["comm_bytes"] > 0 for s in steps)
