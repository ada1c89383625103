"""The command line: real model runs, JSON output, and a clear one-line error with exit
code 2 for each kind of bad input."""

import json
import os
import shlex
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from specscope.cli import app
from specscope.trace import TraceStore

runner = CliRunner()


def invoke(*args, db):
    return runner.invoke(app, [*args, "--db", str(db)])


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "nope", "--prompt", "hi"], "unknown model 'nope'"),
    (["generate", "--model", "missing.gguf", "--prompt", "hi"], "GGUF file not found"),
    (["generate", "--model", "random:gpt2cfg", "--prompt", "hi"], "not supported by the native backend"),
    (["generate", "--prompt", "   "], "the prompt is empty"),
    (["generate", "--model", "random:tiny", "--max-seq-len", "8", "--prompt", "hello " * 20], "the model's context here is 8"),
    (["generate", "--prompt", "hi", "--k", "0"], "--k must be >= 1"),
    (["generate", "--prompt", "hi", "--method", "oracle", "--oracle-alpha", "1.5"], "--oracle-alpha must be in [0, 1]"),
    (["generate", "--prompt", "hi", "--method", "medusa"], "unknown method medusa (accepted: none, ngram, oracle, trie, suffix, draft-model, self-draft)"),
    (["generate", "--prompt", "hi", "--method", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min <= --ngram-max"),
    (["generate"], "exactly one of --prompt"),
    (["generate", "--prompts", "nofile.jsonl"], "nofile.jsonl"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["run", "--workload", "mmlu"], "unknown workload"),
    (["run", "--methods", "none,eagle"], "unknown method eagle"),
    (["run", "--num-prompts", "0"], "num_prompts"),
    (["generate", "--prompt", "hi", "--kk", "3"], "unknown option --kk (drafter options: --k,"),
    (["generate", "--prompt", "hi", "--k", "two"], "--k takes int values, got 'two'"),
    (["generate", "--prompt", "hi", "--branches", "0"], "--branches must be >= 1"),
])
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2cfg").write_text("")  # only so the random: path below can be built
    args = [a.replace("random:gpt2cfg", f"random:{tmp_path / 'gpt2.json'}") for a in args]
    (tmp_path / "gpt2.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}')
    result = invoke(*args, db=tmp_path / "t.db")
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.strip().count("\n") == 0 or "Usage" not in result.output


def test_generate_json_on_smollm2(tmp_path):
    """The installed console script, end to end, with a prompts file of chat and text prompts."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Name three colours."}]}) + "\n\n"
                       + json.dumps({"prompt": "def add(a, b):"}) + "\n")
    db = tmp_path / "trace.db"
    exe = os.path.join(os.path.dirname(sys.executable), "specscope")
    out = subprocess.run([exe, "generate", "--prompts", str(prompts), "--method", "ngram", "--k", "4",
                          "--max-new-tokens", "24", "--json", "--db", str(db)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        for key in ("prompt_ids", "output_ids", "text", "accept_len", "accept_rate", "tok_s", "steps", "wall_s"):
            assert key in row
        assert 1 <= len(row["output_ids"]) <= 24 and row["tok_s"] > 0 and row["steps"] >= 1
    # The chat prompt went through the template; the text prompt did too (chat by default).
    assert rows[0]["prompt_ids"][0] == 1  # <|im_start|>
    with TraceStore(db) as store:
        (run,) = store.runs()
        assert run["method"] == "ngram" and run["status"] == "ok" and run["params"]["k"] == 4
        steps = store.steps(run["id"])
        assert len(steps) == sum(r["steps"] for r in rows)
        assert [r["output_tokens"] for r in store.requests(run["id"])] == [len(r["output_ids"]) for r in rows]


def test_no_chat_feeds_raw_text(tmp_path):
    result = invoke("generate", "--prompt", "def add(a, b):", "--no-chat", "--max-new-tokens", "4", "--json",
                    db=tmp_path / "t.db")
    assert result.exit_code == 0, result.output
    row = json.loads(result.output.splitlines()[-1])
    from specscope.models.loading import gguf_as_hf_dir, load_tokenizer, smollm2_gguf

    tok = load_tokenizer(gguf_as_hf_dir(smollm2_gguf()))
    assert row["prompt_ids"] == tok("def add(a, b):").input_ids


@pytest.mark.slow
def test_run_compares_methods_on_a_workload(tmp_path):
    result = invoke("run", "--workload", "mixed", "--num-prompts", "2", "--max-new-tokens", "24",
                    "--methods", "none,ngram,oracle", "--json", db=tmp_path / "t.db")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.splitlines()[-1])
    methods = report["methods"]
    assert list(methods) == ["none", "ngram", "oracle"]
    assert methods["none"]["speedup"] == pytest.approx(1.0)
    assert methods["none"]["accept_len"] == 1.0 and methods["none"]["accept_rate"] is None
    # Oracle at alpha 1 replays the greedy output: every draft accepted.
    assert methods["oracle"]["accept_rate"] == 1.0 and methods["oracle"]["accept_len"] > 1.0
    assert methods["none"]["output_tokens"] == methods["ngram"]["output_tokens"] == methods["oracle"]["output_tokens"]
    assert set(methods["ngram"]["by_workload"]) == {"humaneval", "sharegpt"}
    words = shlex.split(report["command"])  # the command that reproduces the run, defaults included
    assert words[:2] == ["specscope", "run"]
    flags = dict(zip(words[2::2], words[3::2]))
    assert flags["--model"] == "smollm2-135m" and flags["--workload"] == "mixed" and flags["--num-prompts"] == "2"
    assert report["drafter_options"]["k"] == 8
    with TraceStore(tmp_path / "t.db") as store:
        assert sorted(r["method"] for r in store.runs()) == ["ngram", "none", "oracle"]
