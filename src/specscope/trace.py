"""The trace: runs, requests and verify steps in one SQLite file.

Every source of evidence (engine, server benchmark, log file, replay) writes here and
every analysis reads from here. Records are committed as they happen, so a crash or a
timeout keeps everything that finished before it.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import astuple, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

SOURCES = ("engine", "server", "log", "replay")
RUN_STATUSES = ("running", "ok", "partial", "failed")
FINISH_STATUSES = ("ok", "partial", "failed")
REQUEST_STATUSES = ("ok", "timeout", "error", "cancelled")
SAMPLE_COLUMNS = ("t", "accept_len", "accept_rate", "gen_tok_s", "n_tokens", "running_req")


def default_db() -> Path:
    return Path(os.environ.get("SPECSCOPE_DB", "~/.specscope/specscope.db")).expanduser()


DEFAULT_DB = default_db()  # as seen at import; TraceStore() re-reads SPECSCOPE_DB


@dataclass
class Step:
    """One verify step of one request. Unknown times are None (NULL)."""

    step: int
    ctx_len: int
    batch: int
    proposed: int
    accepted: int
    t_draft_ms: float | None
    t_verify_ms: float | None
    t_host_ms: float | None
    # Collectives of the verify forward under tensor parallelism (None on one device):
    # calls, payload bytes, and milliseconds where they were timed.
    comm_count: int | None = None
    comm_bytes: int | None = None
    comm_ms: float | None = None


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    reasoning_tokens: int | None
    ttft_ms: float | None
    e2e_ms: float | None
    status: str  # ok | timeout | error | cancelled
    error: str | None = None
    # The token streams themselves, so `specscope replay --run ID` can re-simulate any
    # drafter on them offline. None where the source does not know them (servers, logs).
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None


STEP_COLUMNS = tuple(f.name for f in fields(Step))
REQUEST_COLUMNS = tuple(f.name for f in fields(RequestRecord))
ID_COLUMNS = ("prompt_ids", "output_ids")  # JSON lists of token ids, nullable

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at TEXT NOT NULL,
    source TEXT NOT NULL,
    model TEXT NOT NULL,
    method TEXT NOT NULL,
    params TEXT NOT NULL,
    hardware TEXT NOT NULL,
    workload TEXT NOT NULL,
    status TEXT NOT NULL,
    notes TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS requests (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    request_id TEXT NOT NULL,
    prompt_tokens INTEGER,
    output_tokens INTEGER,
    reasoning_tokens INTEGER,
    ttft_ms REAL,
    e2e_ms REAL,
    status TEXT NOT NULL,
    error TEXT,
    prompt_ids TEXT,
    output_ids TEXT,
    PRIMARY KEY (run_id, request_id)
);
CREATE TABLE IF NOT EXISTS steps (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    request_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    ctx_len INTEGER,
    batch INTEGER,
    proposed INTEGER,
    accepted INTEGER,
    t_draft_ms REAL,
    t_verify_ms REAL,
    t_host_ms REAL,
    comm_count INTEGER,
    comm_bytes INTEGER,
    comm_ms REAL
);
CREATE INDEX IF NOT EXISTS steps_run_request_step ON steps (run_id, request_id, step);
CREATE TABLE IF NOT EXISTS samples (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    t REAL,
    accept_len REAL,
    accept_rate REAL,
    gen_tok_s REAL,
    n_tokens INTEGER,
    running_req INTEGER
);
CREATE INDEX IF NOT EXISTS samples_run_t ON samples (run_id, t);
"""


def _check(value: str, accepted: tuple[str, ...], what: str) -> None:
    if value not in accepted:
        raise ValueError(f"bad {what} {value!r}; accepted: {', '.join(accepted)}")


class TraceStore:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_db()
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # A generous busy timeout: a benchmark and a reader may share the file.
        self.db = sqlite3.connect(str(self.path), timeout=30.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL under WAL: a power loss may lose the last commits, never corrupt the file.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self._add_missing_columns()
        self.db.commit()
        # Runs this instance started and has not finished. Any other run still marked
        # "running" belongs to a process we cannot see, most likely one that died, so
        # readers report it as partial.
        self._live: set[int] = set()

    def _add_missing_columns(self) -> None:
        # Files written before a column existed stay readable (and writable): CREATE TABLE
        # IF NOT EXISTS leaves an old table as it was, so add what is missing.
        for table, columns in (("requests", {c: "TEXT" for c in ID_COLUMNS}),
                               ("steps", {"comm_count": "INTEGER", "comm_bytes": "INTEGER", "comm_ms": "REAL"})):
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for column, kind in columns.items():
                if column in have:
                    continue
                try:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                except sqlite3.OperationalError as e:
                    if "duplicate column" not in str(e):  # another process added it first
                        raise

    # ------------------------------------------------------------------ writing

    def start_run(
        self, *, source: str, model: str, method: str, params: dict, hardware: dict, workload: str, notes: str = ""
    ) -> int:
        _check(source, SOURCES, "run source")
        created_at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        with self.db:  # commits, or rolls back on error
            cur = self.db.execute(
                "INSERT INTO runs (created_at, source, model, method, params, hardware, workload, status, notes)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, 'running', ?)",
                (created_at, source, model, method, _dumps(params), _dumps(hardware), workload, notes),
            )
        run_id = cur.lastrowid
        self._live.add(run_id)
        return run_id

    def add_steps(self, run_id: int, request_id: str, steps: list[Step]) -> None:
        if not steps:
            return
        with self.db:
            self.db.executemany(
                f"INSERT INTO steps (run_id, request_id, {', '.join(STEP_COLUMNS)})"
                f" VALUES (?, ?, {', '.join('?' * len(STEP_COLUMNS))})",
                [(run_id, request_id, *astuple(s)) for s in steps],
            )

    def add_request(self, run_id: int, rec: RequestRecord) -> None:
        _check(rec.status, REQUEST_STATUSES, "request status")
        with self.db:
            self.db.execute(
                f"INSERT INTO requests (run_id, {', '.join(REQUEST_COLUMNS)})"
                f" VALUES (?, {', '.join('?' * len(REQUEST_COLUMNS))})",
                (run_id, *(_ids_json(getattr(rec, c)) if c in ID_COLUMNS else getattr(rec, c)
                           for c in REQUEST_COLUMNS)),
            )

    def add_samples(self, run_id: int, samples: list[dict]) -> None:
        if not samples:
            return
        for s in samples:
            unknown = set(s) - set(SAMPLE_COLUMNS)
            if unknown:
                raise ValueError(f"unknown sample fields {sorted(unknown)}; accepted: {', '.join(SAMPLE_COLUMNS)}")
        with self.db:
            self.db.executemany(
                f"INSERT INTO samples (run_id, {', '.join(SAMPLE_COLUMNS)})"
                f" VALUES (?, {', '.join('?' * len(SAMPLE_COLUMNS))})",
                [(run_id, *(s.get(c) for c in SAMPLE_COLUMNS)) for s in samples],
            )

    def finish_run(self, run_id: int, status: str = "ok", notes: str | None = None) -> None:
        _check(status, FINISH_STATUSES, "final run status")
        with self.db:
            if notes is None:
                cur = self.db.execute("UPDATE runs SET status = ? WHERE id = ?", (status, run_id))
            else:
                cur = self.db.execute("UPDATE runs SET status = ?, notes = ? WHERE id = ?", (status, notes, run_id))
        if cur.rowcount == 0:
            raise KeyError(f"no run {run_id} in {self.path}")
        self._live.discard(run_id)

    # ------------------------------------------------------------------ reading

    def runs(self) -> list[dict]:
        return [self._run_dict(r) for r in self.db.execute("SELECT * FROM runs ORDER BY id")]

    def run(self, run_id: int) -> dict:
        row = self.db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(f"no run {run_id} in {self.path}")
        return self._run_dict(row)

    def requests(self, run_id: int) -> list[dict]:
        """Requests of a run in the order they were recorded."""
        rows = self.db.execute("SELECT * FROM requests WHERE run_id = ? ORDER BY rowid", (run_id,))
        out = []
        for r in rows:
            rec = dict(r)
            for c in ID_COLUMNS:
                rec[c] = json.loads(rec[c]) if rec[c] is not None else None
            out.append(rec)
        return out

    def steps(self, run_id: int, request_id: str | None = None) -> list[dict]:
        """Steps of a run (or of one request), ordered by request_id, then step."""
        if request_id is None:
            rows = self.db.execute("SELECT * FROM steps WHERE run_id = ? ORDER BY request_id, step", (run_id,))
        else:
            rows = self.db.execute(
                "SELECT * FROM steps WHERE run_id = ? AND request_id = ? ORDER BY step", (run_id, request_id)
            )
        return [dict(r) for r in rows]

    def samples(self, run_id: int) -> list[dict]:
        """Aggregate samples of a run (from log files), ordered by time."""
        rows = self.db.execute("SELECT * FROM samples WHERE run_id = ? ORDER BY t, rowid", (run_id,))
        return [dict(r) for r in rows]

    def _run_dict(self, row: sqlite3.Row) -> dict:
        run = dict(row)
        run["params"] = json.loads(run["params"])
        run["hardware"] = json.loads(run["hardware"])
        if run["status"] == "running" and run["id"] not in self._live:
            run["status"] = "partial"
        return run

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ids_json(ids: list[int] | None) -> str | None:
    # Compact separators: token lists are the bulk of a request row.
    return None if ids is None else json.dumps([int(t) for t in ids], separators=(",", ":"))


def _dumps(obj: dict) -> str:
    # default=str keeps values such as torch.dtype or Path readable instead of failing
    # a run at its very start.
    return json.dumps(obj, sort_keys=True, default=str)
