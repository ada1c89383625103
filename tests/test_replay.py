"""Offline replay: exact against the engine step by step, from JSONL files, the trace
database and re-tokenised texts; the CLI, its grid, its reports and its errors."""

import json
import random

import pytest
from typer.testing import CliRunner

from specscope.cli import app
from specscope.drafters import Draft, NgramDrafter
from specscope.engine import Engine
from specscope.models.loading import PRESETS
from specscope.replay import ReplayError, Stream, read_streams, replay, streams_from_run
from specscope.trace import RequestRecord, TraceStore

runner = CliRunner()
MAX_NEW = 40


def random_prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]) for i in range(n)]


@pytest.fixture(scope="module")
def tiny_factory(tmp_path_factory):
    """A tiny random model with a small vocabulary (so n-grams repeat) built through the
    real `random:<config.json>` path; SmolLM2's tokenizer supplies EOS id 2, so some
    requests stop at EOS and others at the token limit."""
    import torch

    from specscope.models import load_target

    def make(max_seq_len=512):
        path = tmp_path_factory.mktemp("cfg") / "tiny.json"
        path.write_text(json.dumps(dict(PRESETS["tiny"], vocab_size=64, eos_token_id=None, bos_token_id=None)))
        return load_target(f"random:{path}", device="cpu", dtype=torch.float32, seed=5, max_seq_len=max_seq_len)

    return make


def engine_run(target, drafter, prompts, db):
    """The engine's greedy run, recorded in a trace store as `generate` records it."""
    with TraceStore(db) as store:
        run_id = store.start_run(source="engine", model=target.spec, method="ngram", params={"max_new_tokens": MAX_NEW},
                                 hardware={}, workload="random")
        done = Engine(target, drafter, store=store, run_id=run_id).generate(prompts, MAX_NEW)
        store.finish_run(run_id)
    return done, run_id


CASES = {
    "chain": (dict(k=6, n_min=1, n_max=3), 512),
    "tree": (dict(k=5, n_min=1, n_max=3, branches=3), 512),
    "context-capped": (dict(k=8, n_min=1, n_max=4), 56),  # room in the cache caps late drafts
}


@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_engine_step_by_step(tiny_factory, tmp_path, case):
    cfg, max_seq_len = CASES[case]
    target = tiny_factory(max_seq_len)
    prompts = random_prompts(30, 64, seed=7)
    done, run_id = engine_run(target, NgramDrafter(**cfg), prompts, tmp_path / "t.db")
    engine_steps = [[(s.proposed, s.accepted) for s in c.steps] for c in done]
    assert sum(a for steps in engine_steps for _, a in steps) > 0  # the drafter was exercised
    assert {c.finish_reason for c in done} >= ({"eos", "length"} if case != "context-capped" else {"length"})
    if case == "tree":
        assert any(p > cfg["k"] for steps in engine_steps for p, _ in steps)  # some drafts were trees
    room = max_seq_len if case == "context-capped" else None

    # From the JSONL that `generate --json` prints (with the run's token limit).
    traces = tmp_path / "out.jsonl"
    traces.write_text("".join(json.dumps({"request_id": c.request_id, "prompt_ids": c.prompt_ids,
                                          "output_ids": c.output_ids}) + "\n" for c in done))
    from_file = replay(NgramDrafter(**cfg), read_streams(traces, max_new_tokens=MAX_NEW), room)
    assert from_file.per_request() == engine_steps

    # From the trace database: token ids recorded by the engine, the limit from the run's params.
    with TraceStore(tmp_path / "t.db") as store:
        streams = streams_from_run(store, run_id)
        stored = [[(s["proposed"], s["accepted"]) for s in store.steps(run_id, c.request_id)] for c in done]
    assert [s.request_id for s in streams] == [c.request_id for c in done]
    assert stored == engine_steps
    assert replay(NgramDrafter(**cfg), streams, room).per_request() == engine_steps


@pytest.mark.slow
def test_replay_equals_engine_on_smollm2(smollm2):
    """The real model on chat prompts (the tiny models above cover EOS stops)."""
    from specscope.engine import encode_prompt
    from specscope.workloads import load_workload

    prompts = [(p.id, encode_prompt(smollm2, p)) for p in load_workload("mixed", 2, seed=1)]
    done = Engine(smollm2, NgramDrafter(k=8)).generate(prompts, 40)
    engine_steps = [[(s.proposed, s.accepted) for s in c.steps] for c in done]
    assert sum(a for steps in engine_steps for _, a in steps) > 0
    streams = [Stream(c.request_id, c.prompt_ids, c.output_ids, 40) for c in done]
    assert replay(NgramDrafter(k=8), streams).per_request() == engine_steps


@pytest.mark.parametrize("name", ["TrieDrafter", "SuffixDrafter"])
def test_global_drafters_replay_exactly_in_request_order(tiny_factory, tmp_path, name):
    """Drafters that share state across requests (SGLang's trie, SuffixDecoding's global
    tree): replay feeds them the requests in the recorded order, as the engine did."""
    import specscope.drafters

    cls = getattr(specscope.drafters, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in specscope.drafters")
    prompts = random_prompts(20, 64, seed=11)
    done, run_id = engine_run(tiny_factory(), cls(), prompts, tmp_path / "t.db")
    engine_steps = [[(s.proposed, s.accepted) for s in c.steps] for c in done]
    assert sum(a for steps in engine_steps for _, a in steps) > 0
    with TraceStore(tmp_path / "t.db") as store:
        assert replay(cls(), streams_from_run(store, run_id)).per_request() == engine_steps
    # Through the CLI, with a grid over the drafter's own options: its defaults are the engine's run.
    drafter, grid = {"TrieDrafter": ("trie", "num_draft_tokens=4,12"), "SuffixDrafter": ("suffix", "max_spec_tokens=4,12")}[name]
    result = runner.invoke(app, ["replay", "--run", str(run_id), "--db", str(tmp_path / "t.db"), "--drafter", drafter,
                                 "--grid", grid, "--json"])
    assert result.exit_code == 0, result.output
    small, default = [json.loads(line) for line in result.stdout.splitlines()]
    steps = [s for c in done for s in c.steps]
    assert default["accept_len"] == pytest.approx(sum(s.accepted + 1 for s in steps) / len(steps))
    assert max(s.proposed for s in steps) > 3 and small["proposed"] < default["proposed"]


def test_summary_and_position_bins():
    # prompt 5 6 7 8, output 5 6 7 8 9 with k=2 and unigrams:
    # step 1 (pos 1): "5" matched in the prompt → draft [6, 7], both accepted, bonus 8;
    # step 2 (pos 4): one token left → no budget, empty draft, emits 9.
    rec = replay(NgramDrafter(k=2, n_min=1, n_max=1), [Stream("a", [5, 6, 7, 8], [5, 6, 7, 8, 9])])
    assert (rec.pos, rec.proposed, rec.accepted) == ([1, 4], [2, 0], [2, 0])
    s = rec.summary(bin_tokens=2)
    assert (s["steps"], s["accept_len"], s["accept_rate"], s["drafted_frac"]) == (2, 2.0, 1.0, 0.5)
    assert [(b["start"], b["end"], b["steps"], b["accept_len"]) for b in s["by_position"]] == [(0, 2, 1, 3.0), (4, 6, 1, 1.0)]
    assert s["output_tokens"] == 5 and s["requests"] == 1

    # A long repetitive stream: acceptance by position warms up once the context repeats.
    rng = random.Random(0)
    phrase = [rng.randrange(1000) for _ in range(300)]
    long = replay(NgramDrafter(k=8), [Stream("b", [1, 2, 3], phrase * 3)]).summary()
    bins = long["by_position"]
    assert [b["start"] for b in bins] == [0, 256, 512, 768]
    assert sum(b["steps"] for b in bins) == long["steps"]
    assert bins[0]["accept_len"] < 1.5 < bins[-1]["accept_len"]
    # With a limit above the stream's length (a request that stopped at EOS) the last
    # steps may still draft; past the end nothing is accepted.
    tail = replay(NgramDrafter(k=8), [Stream("b", [1, 2, 3], phrase * 3, max_new_tokens=2000)])
    assert tail.proposed[-1] > 0 and tail.output_tokens == 900


class SharedMemory:
    """A global drafter: one table shared by every request, keyed by the last token. Not
    one of ours — replay must work with any object that follows the Drafter protocol."""

    name = "shared"

    def __init__(self, k=4):
        self.k, self.next, self.ctx = k, {}, {}

    def begin(self, req, prompt_ids):
        self.ctx[req] = list(prompt_ids)

    def propose(self, req, budget):
        out, last = [], self.ctx[req][-1]
        while len(out) < min(self.k, budget) and last in self.next:
            last = self.next[last]
            out.append(last)
        return Draft.chain(out)

    def observe(self, req, emitted_ids):
        ctx = self.ctx[req]
        for t in emitted_ids:
            self.next[ctx[-1]] = t
            ctx.append(t)

    def end(self, req):
        del self.ctx[req]  # the shared table stays


def test_global_drafter_learns_across_requests_in_order():
    rng = random.Random(1)
    answer = rng.sample(range(10_000), 61)  # distinct: nothing repeats within a request; 12 steps of k + 1
    streams = [Stream(f"q{i}", [rng.randrange(10_000, 20_000)], answer) for i in range(20)]
    s = replay(SharedMemory(), streams).summary()
    groups = s["by_request"]
    assert len(groups) == 10 and (groups[0]["first"], groups[-1]["last"]) == (0, 19)
    assert [g["first"] for g in groups] == list(range(0, 20, 2))
    assert groups[0]["accept_len"] < groups[-1]["accept_len"] == 5.0  # k=4 and all accepted
    # A fresh drafter per request would not learn: the order matters.
    assert replay(SharedMemory(), streams[:1]).summary()["accept_len"] == 1.0


def test_text_traces_are_retokenised_with_the_models_tokenizer(tmp_path):
    from specscope.models.loading import gguf_as_hf_dir, load_tokenizer, smollm2_gguf
    from specscope.replay_cli import text_encoder

    tok = load_tokenizer(gguf_as_hf_dir(smollm2_gguf()))
    output = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    path = tmp_path / "texts.jsonl"
    path.write_text(json.dumps({"prompt": "Write add and sub.", "output": output}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Again."}], "output": output}) + "\n")
    streams = read_streams(path, text_encoder("smollm2-135m", chat=True))
    chat = tok.apply_chat_template([{"role": "user", "content": "Write add and sub."}], add_generation_prompt=True,
                                   tokenize=False)
    assert streams[0].prompt_ids == tok(chat, add_special_tokens=False).input_ids
    assert streams[0].output_ids == streams[1].output_ids == tok(output, add_special_tokens=False).input_ids
    with pytest.raises(ReplayError, match=r"texts.jsonl:2: prompt on this line is a chat \(messages\); --no-chat"):
        read_streams(path, text_encoder("smollm2-135m", chat=False))
    path.write_text(path.read_text().split("\n")[0])
    raw = read_streams(path, text_encoder("smollm2-135m", chat=False))
    assert raw[0].prompt_ids == tok("Write add and sub.").input_ids

    result = runner.invoke(app, ["replay", "--traces", str(path), "--k", "4", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["output_tokens"] == len(streams[0].output_ids) and row["accept_len"] > 1.0


def test_cli_json_grid_and_run(tiny_factory, tmp_path):
    target = tiny_factory()
    prompts = random_prompts(12, 64, seed=3)
    done, run_id = engine_run(target, NgramDrafter(k=4, n_min=1, n_max=2), prompts, tmp_path / "t.db")
    traces = tmp_path / "out.jsonl"
    traces.write_text("".join(json.dumps({"prompt_ids": c.prompt_ids, "output_ids": c.output_ids}) + "\n"
                              for c in done))

    result = runner.invoke(app, ["replay", "--traces", str(traces), "--grid", "k=1,4", "--grid", "ngram-max=1,2",
                                 "--max-new-tokens", str(MAX_NEW), "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["params"]["k"], r["params"]["ngram_max"]) for r in rows] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert all(r["grid"] == {"k": r["params"]["k"], "ngram_max": r["params"]["ngram_max"]} for r in rows)
    for key in ("accept_len", "accept_rate", "steps", "params", "drafted_frac", "by_position", "by_request"):
        assert all(key in r for r in rows)
    # The k=4, n-gram 1..2 configuration is the one the engine ran: same numbers.
    steps = [s for c in done for s in c.steps]
    assert rows[3]["steps"] == len(steps)
    assert rows[3]["accept_len"] == pytest.approx(sum(s.accepted + 1 for s in steps) / len(steps))
    assert rows[3]["accept_rate"] == pytest.approx(sum(s.accepted for s in steps) / sum(s.proposed for s in steps))

    # The same run from the database, in the table form.
    result = runner.invoke(app, ["replay", "--run", str(run_id), "--db", str(tmp_path / "t.db"), "--k", "4",
                                 "--ngram-max", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["accept_len"] == pytest.approx(rows[3]["accept_len"])
    result = runner.invoke(app, ["replay", "--run", str(run_id), "--db", str(tmp_path / "t.db"), "--grid", "k=2,4"])
    assert result.exit_code == 0, result.output
    assert "replay · ngram" in result.stdout and "k=2" in result.stdout and "k=4" in result.stdout


@pytest.fixture
def bad_inputs(tmp_path):
    def jsonl(name, *lines):
        (tmp_path / name).write_text("\n".join(lines) + "\n")

    good = json.dumps({"prompt_ids": [1, 2], "output_ids": [3, 4, 5]})
    jsonl("broken.jsonl", good, "{not json")
    jsonl("keys.jsonl", json.dumps({"prompt_ids": [1, 2]}))
    jsonl("ids.jsonl", json.dumps({"prompt_ids": [1, -2], "output_ids": [3]}))
    jsonl("strs.jsonl", json.dumps({"prompt_ids": ["a"], "output_ids": [3]}))
    jsonl("array.jsonl", "[1, 2]")
    jsonl("empty.jsonl", "")
    jsonl("limit.jsonl", good)
    jsonl("good.jsonl", good)
    with TraceStore(tmp_path / "t.db") as store:
        old = store.start_run(source="server", model="m", method="ngram", params={}, hardware={}, workload="w")
        store.add_request(old, RequestRecord("r", 3, 4, None, None, None, "ok"))  # no token ids
        store.finish_run(old)
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["--run", "99"], "no run 99 in"),
    (["--run", "1"], "run 1 has no token ids"),
    (["--traces", "broken.jsonl"], "broken.jsonl:2: invalid JSON"),
    (["--traces", "keys.jsonl"], '"output_ids" must be a non-empty list of token ids'),
    (["--traces", "ids.jsonl"], '"prompt_ids" must be a non-empty list of token ids'),
    (["--traces", "strs.jsonl"], '"prompt_ids" must be a non-empty list'),
    (["--traces", "array.jsonl"], "expected a JSON object"),
    (["--traces", "empty.jsonl"], "no requests in file"),
    (["--traces", "missing.jsonl"], "no such traces file"),
    (["--traces", "limit.jsonl", "--max-new-tokens", "2"], "3 output tokens, more than max_new_tokens 2"),
    (["--traces", "good.jsonl", "--grid", "depth=1,2"], "unknown --grid option 'depth'"),
    (["--traces", "good.jsonl", "--grid", "k=1,x"], "--k takes int values, got 'x'"),
    (["--traces", "good.jsonl", "--grid", "k=0,4"], "--k must be >= 1"),
    (["--traces", "good.jsonl", "--grid", "k"], "--grid takes name=v1,v2"),
    (["--traces", "good.jsonl", "--grid", "k=1", "--grid", "k=2"], "--grid k is given twice"),
    (["--traces", "good.jsonl", "--grid", "ngram_min=3", "--ngram-max", "2"], "--ngram-min <= --ngram-max"),
    (["--traces", "good.jsonl", "--depth", "3"], "unknown option --depth"),
    (["--traces", "good.jsonl", "--drafter", "eagle3"], "unknown drafter 'eagle3'"),
    (["--traces", "good.jsonl", "--drafter", "trie", "--grid", "k=1,2"], "--k does not apply to the trie drafter"),
    (["--traces", "good.jsonl", "--drafter", "suffix", "--ngram-max", "2"], "--ngram-max does not apply to the suffix"),
    (["--traces", "good.jsonl", "--run", "1"], "exactly one of --run ID or --traces"),
    ([], "exactly one of --run ID or --traces"),
])
def test_bad_input_is_one_clear_line_and_exit_2(bad_inputs, monkeypatch, args, message):
    monkeypatch.chdir(bad_inputs)
    result = runner.invoke(app, ["replay", *args, "--db", str(bad_inputs / "t.db")])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output and result.output.strip().count("\n") == 0


def test_text_traces_without_a_tokenizer_are_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "output": "hello"}) + "\n")
    with pytest.raises(ReplayError, match="text traces need a tokenizer"):
        read_streams(path)
