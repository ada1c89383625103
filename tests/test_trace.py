import sqlite3
import subprocess
import sys

import pytest

from specscope import trace
from specscope.trace import RequestRecord, Step, TraceStore

PARAMS = {"k": 4, "temperature": 0.0, "drafter": {"n": 3}}
HARDWARE = {"device": "cpu", "dtype": "float32", "torch": "2.x"}


def start(store, **kw):
    args = dict(source="engine", model="smollm2-135m", method="ngram", workload="humaneval")
    return store.start_run(**{**args, "params": PARAMS, "hardware": HARDWARE, **kw})


def test_round_trip(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    run_id = start(store, notes="first try")
    steps_b = [Step(i, 10 + i, 2, 4, i % 3, 0.5, 7.25, None) for i in range(3)]
    steps_a = [Step(0, 20, 2, 4, 4, None, None, None), Step(1, 25, 2, 4, 0, 0.1, 6.0, 0.2)]
    store.add_steps(run_id, "b", steps_b[:2])
    store.add_steps(run_id, "a", steps_a)
    store.add_steps(run_id, "b", steps_b[2:])  # written in batches as the engine goes
    store.add_steps(run_id, "b", [])
    store.add_request(run_id, RequestRecord("b", 30, 12, None, 41.5, 300.0, "ok"))
    store.add_request(run_id, RequestRecord("a", 31, 3, 1, None, None, "timeout", error="ran past 60 s"))
    store.add_samples(run_id, [{"t": 1.0, "accept_len": 1.95, "accept_rate": 0.49, "gen_tok_s": 178.86}, {"t": 2.0}])
    store.finish_run(run_id, "ok")

    run = store.run(run_id)
    assert run["id"] == run_id and run["status"] == "ok" and run["notes"] == "first try"
    assert run["params"] == PARAMS and run["hardware"] == HARDWARE
    described = (run["source"], run["model"], run["method"], run["workload"])
    assert described == ("engine", "smollm2-135m", "ngram", "humaneval")
    assert run["created_at"].endswith("+00:00")
    assert store.runs() == [run]

    assert store.requests(run_id) == [
        dict(run_id=run_id, request_id="b", prompt_tokens=30, output_tokens=12, reasoning_tokens=None,
             ttft_ms=41.5, e2e_ms=300.0, status="ok", error=None, prompt_ids=None, output_ids=None),
        dict(run_id=run_id, request_id="a", prompt_tokens=31, output_tokens=3, reasoning_tokens=1,
             ttft_ms=None, e2e_ms=None, status="timeout", error="ran past 60 s", prompt_ids=None, output_ids=None),
    ]

    def as_steps(rows):
        return [Step(**{k: v for k, v in r.items() if k not in ("run_id", "request_id")}) for r in rows]

    assert as_steps(store.steps(run_id, "b")) == steps_b
    assert as_steps(store.steps(run_id, "a")) == steps_a
    rows = store.steps(run_id)
    assert [(r["request_id"], r["step"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]
    assert store.steps(run_id, "nobody") == []

    samples = store.samples(run_id)
    assert samples[0] == dict(run_id=run_id, t=1.0, accept_len=1.95, accept_rate=0.49, gen_tok_s=178.86,
                              n_tokens=None, running_req=None)
    assert samples[1]["t"] == 2.0 and samples[1]["accept_len"] is None
    store.close()


def test_tables_and_columns_match_the_design(tmp_path):
    TraceStore(tmp_path / "t.db").close()
    db = sqlite3.connect(tmp_path / "t.db")

    def columns(table):
        return [r[1] for r in db.execute(f"PRAGMA table_info({table})")]

    assert columns("runs") == ["id", "created_at", "source", "model", "method", "params", "hardware",
                               "workload", "status", "notes"]
    assert columns("requests") == ["run_id", "request_id", "prompt_tokens", "output_tokens", "reasoning_tokens",
                                   "ttft_ms", "e2e_ms", "status", "error", "prompt_ids", "output_ids"]
    assert columns("steps") == ["run_id", "request_id", "step", "ctx_len", "batch", "proposed", "accepted",
                                "t_draft_ms", "t_verify_ms", "t_host_ms", "comm_count", "comm_bytes", "comm_ms"]
    assert columns("samples") == ["run_id", "t", "accept_len", "accept_rate", "gen_tok_s", "n_tokens", "running_req"]
    indexed = [[r[2] for r in db.execute(f"PRAGMA index_info({name})")]
               for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='index' AND tbl_name='steps'")]
    assert ["run_id", "request_id", "step"] in indexed
    db.close()


def test_token_ids_round_trip(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    run_id = start(store)
    store.add_request(run_id, RequestRecord("r", 3, 2, None, 1.0, 2.0, "ok", prompt_ids=[1, 2, 49151], output_ids=[7, 2]))
    (row,) = store.requests(run_id)
    assert (row["prompt_ids"], row["output_ids"]) == ([1, 2, 49151], [7, 2])
    assert store.db.execute("SELECT prompt_ids FROM requests").fetchone()[0] == "[1,2,49151]"  # compact JSON
    store.close()


def test_database_from_before_token_ids_gains_the_columns(tmp_path):
    """A file written by an older version: its requests table has no token-id columns."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(trace.SCHEMA.replace("    prompt_ids TEXT,\n    output_ids TEXT,\n", ""))
    db.execute("INSERT INTO runs (created_at, source, model, method, params, hardware, workload, status)"
               " VALUES ('2026-01-01', 'engine', 'm', 'ngram', '{}', '{}', 'w', 'ok')")
    db.execute("INSERT INTO requests (run_id, request_id, prompt_tokens, output_tokens, status) VALUES (1, 'old', 5, 6, 'ok')")
    db.commit()
    assert "prompt_ids" not in [r[1] for r in db.execute("PRAGMA table_info(requests)")]
    db.close()
    with TraceStore(path) as store:
        (row,) = store.requests(1)
        assert (row["request_id"], row["prompt_ids"], row["output_ids"]) == ("old", None, None)
        store.add_request(1, RequestRecord("new", 1, 1, None, None, None, "ok", prompt_ids=[4], output_ids=[5]))
        assert store.requests(1)[1]["output_ids"] == [5]
    TraceStore(path).close()  # reopening finds the columns and leaves them alone


def test_wal_mode_and_idempotent_schema(tmp_path):
    path = tmp_path / "sub" / "dir" / "t.db"  # parent directories are created
    store = TraceStore(path)
    run_id = start(store)
    store.finish_run(run_id)
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    again = TraceStore(path)  # reopening neither fails nor loses data
    assert [r["id"] for r in again.runs()] == [run_id]
    assert again.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    again.close()


def test_two_stores_on_one_file(tmp_path):
    path = tmp_path / "t.db"
    a, b = TraceStore(path), TraceStore(path)
    ra = start(a, method="none")
    rb = start(b, method="ngram")
    assert ra != rb
    a.add_steps(ra, "r0", [Step(0, 5, 1, 0, 0, None, 3.0, None)])
    b.add_steps(rb, "r0", [Step(0, 5, 1, 4, 2, 0.2, 3.1, None)])
    # Each sees the other's committed writes while both are open.
    assert [s["accepted"] for s in a.steps(rb)] == [2]
    assert [s["proposed"] for s in b.steps(ra)] == [0]
    a.finish_run(ra)
    assert b.run(ra)["status"] == "ok"
    # b did not start ra, so while ra was open b could only call it partial; now it is
    # finished, both agree. rb is live in b and shows as running there only.
    assert b.run(rb)["status"] == "running"
    assert a.run(rb)["status"] == "partial"
    b.finish_run(rb, "failed", notes="drafter crashed")
    assert a.run(rb)["status"] == "failed" and a.run(rb)["notes"] == "drafter crashed"
    a.close()
    b.close()


def test_run_left_running_by_a_dead_process_shows_as_partial(tmp_path):
    path = tmp_path / "t.db"
    code = (
        "import os, sys; from specscope.trace import TraceStore, Step\n"
        "s = TraceStore(sys.argv[1])\n"
        "r = s.start_run(source='replay', model='m', method='ngram', params={}, hardware={}, workload='w')\n"
        "s.add_steps(r, 'q', [Step(0, 1, 1, 2, 1, None, None, None)])\n"
        "os._exit(1)  # die without finishing the run or closing the store\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=False, timeout=60)
    store = TraceStore(path)
    (run,) = store.runs()
    assert run["status"] == "partial"
    assert store.run(run["id"])["status"] == "partial"
    assert len(store.steps(run["id"], "q")) == 1  # what finished before the crash is kept
    # The stored status is untouched, so the run can still be finished honestly.
    assert store.db.execute("SELECT status FROM runs").fetchone()[0] == "running"
    store.close()


def test_run_started_here_shows_as_running_until_finished(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    run_id = start(store)
    assert store.run(run_id)["status"] == "running"
    store.finish_run(run_id, "partial", notes="timed out after 3 of 8 prompts")
    run = store.run(run_id)
    assert (run["status"], run["notes"]) == ("partial", "timed out after 3 of 8 prompts")
    store.close()


def test_bad_values_name_the_accepted_ones(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    run_id = start(store)
    with pytest.raises(ValueError, match="bad final run status 'running'; accepted: ok, partial, failed"):
        store.finish_run(run_id, "running")
    with pytest.raises(ValueError, match="bad final run status 'done'; accepted: ok, partial, failed"):
        store.finish_run(run_id, "done")
    with pytest.raises(ValueError, match="bad request status 'weird'; accepted: ok, timeout, error, cancelled"):
        store.add_request(run_id, RequestRecord("r", 1, 1, None, None, None, "weird"))
    with pytest.raises(ValueError, match="bad run source 'bench'; accepted: engine, server, log, replay"):
        start(store, source="bench")
    with pytest.raises(ValueError, match=r"unknown sample fields \['tok_s'\]; accepted: t, accept_len"):
        store.add_samples(run_id, [{"t": 0.0, "tok_s": 3.0}])
    assert store.run(run_id)["status"] == "running"  # nothing was changed by the failed calls
    assert store.requests(run_id) == [] and store.samples(run_id) == []
    assert [r["id"] for r in store.runs()] == [run_id]
    store.close()


def test_unknown_runs_and_duplicate_requests(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    with pytest.raises(KeyError, match="no run 99"):
        store.run(99)
    with pytest.raises(KeyError, match="no run 99"):
        store.finish_run(99)
    with pytest.raises(sqlite3.IntegrityError):
        store.add_steps(99, "r", [Step(0, 1, 1, 1, 1, None, None, None)])
    run_id = start(store)
    store.add_request(run_id, RequestRecord("r", 1, 1, None, None, None, "ok"))
    with pytest.raises(sqlite3.IntegrityError):
        store.add_request(run_id, RequestRecord("r", 1, 2, None, None, None, "ok"))
    # The store stays usable after a rejected write.
    store.add_request(run_id, RequestRecord("s", 1, 1, None, None, None, "cancelled"))
    assert [r["request_id"] for r in store.requests(run_id)] == ["r", "s"]
    store.close()


def test_default_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSCOPE_DB", str(tmp_path / "env" / "x.db"))
    assert trace.default_db() == tmp_path / "env" / "x.db"
    with TraceStore() as store:
        assert store.path == tmp_path / "env" / "x.db"
    assert (tmp_path / "env" / "x.db").exists()
    monkeypatch.setenv("SPECSCOPE_DB", "~/somewhere.db")
    assert not str(trace.default_db()).startswith("~")
