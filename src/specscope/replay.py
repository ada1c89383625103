"""Offline replay: what a model-free drafter would have achieved on recorded token
streams, without running the model.

With greedy decoding the target's choice after any prefix of the output is the next
recorded token, so a step can be simulated exactly: the drafter proposes, the accepted
path is the longest one that agrees with the recorded output (the engine's own
`accept_greedy`), and the bonus is the next recorded token. Replay mirrors Engine._run
step by step — the same budget, the same drafter calls in the same order — so its
per-step (proposed, accepted) equal the engine's on the same prompts.

The one thing a recorded stream cannot tell: the engine stops at EOS (or a stop
string) after the step that emitted it, and if the draft ran correctly past that
token the engine counted those accepted drafts before cutting the output. Replay
only knows tokens up to the end of the stream and counts up to there.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .drafters.base import Draft, Drafter
from .verify import accept_greedy
from .workloads import read_jsonl

BIN_TOKENS = 256  # output positions per bin of the acceptance-by-position report
REQUEST_GROUPS = 10  # request-order groups (deciles) of the acceptance-by-order report


class ReplayError(ValueError):
    """A user-facing, one-line problem with the streams to replay."""


@dataclass
class Stream:
    """One recorded request: its prompt and the output the target produced from it."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    # The engine's max_new_tokens: it caps the last drafts of a request (budget =
    # remaining - 1). None: the stream's own length, exact for outputs cut at the limit.
    max_new_tokens: int | None = None


@dataclass
class Replay:
    """Per-step records of one drafter configuration, as flat lists in step order."""

    request: list[int] = field(default_factory=list)  # index of the stream, in replay order
    pos: list[int] = field(default_factory=list)  # output index of the step's first emitted token
    proposed: list[int] = field(default_factory=list)  # draft nodes
    accepted: list[int] = field(default_factory=list)  # accepted draft nodes (bonus excluded)
    requests: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0

    def per_request(self) -> list[list[tuple[int, int]]]:
        """(proposed, accepted) of every step, one list per request, for comparison with
        the engine's Steps."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.requests)]
        for r, p, a in zip(self.request, self.proposed, self.accepted):
            out[r].append((p, a))
        return out

    def summary(self, bin_tokens: int = BIN_TOKENS, groups: int = REQUEST_GROUPS) -> dict:
        proposed, accepted = np.asarray(self.proposed), np.asarray(self.accepted)
        out = {
            "requests": self.requests, "output_tokens": self.output_tokens,
            **_rates(proposed, accepted),
            "replay_s": self.wall_s,
            "replay_tok_s": self.output_tokens / self.wall_s if self.wall_s > 0 else None,
        }
        # Does the drafter need context to warm up? Acceptance against output position
        # (of the step's first emitted token); bins without steps are left out.
        bins = np.asarray(self.pos, dtype=np.int64) // bin_tokens
        out["by_position"] = []
        for b in np.unique(bins).tolist():
            sel = bins == b
            out["by_position"].append({"start": b * bin_tokens, "end": (b + 1) * bin_tokens,
                                       **_rates(proposed[sel], accepted[sel])})
        # Does a global cache learn across requests? Acceptance against request order, in
        # `groups` runs of consecutive requests (deciles), or one per request if fewer.
        n, g_count = self.requests, min(groups, self.requests)
        group_of = np.asarray(self.request, dtype=np.int64) * g_count // max(n, 1)
        out["by_request"] = []
        for g in range(g_count):
            first, last = -(-g * n // g_count), -(-(g + 1) * n // g_count) - 1  # requests r with r * G // n == g
            sel = group_of == g
            out["by_request"].append({"first": first, "last": last, **_rates(proposed[sel], accepted[sel])})
        return out


def _rates(proposed: np.ndarray, accepted: np.ndarray) -> dict:
    steps, n_prop, n_acc = len(proposed), int(proposed.sum()), int(accepted.sum())
    return {
        "steps": steps, "proposed": n_prop, "accepted": n_acc,
        "accept_len": (n_acc + steps) / steps if steps else None,  # bonus included, as the engine counts
        "accept_rate": n_acc / n_prop if n_prop else None,
        "drafted_frac": int((proposed > 0).sum()) / steps if steps else None,  # steps with any draft
    }


def replay(drafter: Drafter, streams: list[Stream], max_seq_len: int | None = None) -> Replay:
    """Every stream in order through one drafter, as Engine._run does with greedy
    sampling. A drafter with state shared across requests sees them in this order.
    max_seq_len: the engine's cache length per slot, which caps drafts near the end of
    the context (None: no cap)."""
    rec = Replay(requests=len(streams))
    # Bound methods and list appends hoisted out of the loop: the loop is the benchmark.
    propose, observe = drafter.propose, drafter.observe
    add_req, add_pos, add_prop, add_acc = rec.request.append, rec.pos.append, rec.proposed.append, rec.accepted.append
    empty = Draft()
    t0 = time.perf_counter()
    for index, s in enumerate(streams):
        rid, out = s.request_id, s.output_ids
        n_out = len(out)
        limit = n_out if s.max_new_tokens is None else s.max_new_tokens
        if limit < n_out:
            raise ReplayError(f"request {rid} has {n_out} output tokens, more than its max_new_tokens {limit}")
        rec.output_tokens += n_out
        # The cache holds the prompt and every output token but the root: room after the
        # root for draft nodes is max_seq_len - (len(prompt) + pos - 1) - 1.
        room0 = None if max_seq_len is None else max_seq_len - len(s.prompt_ids)
        pos = 1  # the first output token comes from prefill, not from a step

        def target(node: int, depth: int) -> int:
            # The target's greedy choice after the root's path of `depth` accepted nodes
            # is the recorded token there; past the end of the stream nothing is known
            # (-1 matches no draft token).
            i = pos + depth
            return out[i] if i < n_out else -1

        drafter.begin(rid, list(s.prompt_ids))  # a copy: the next configuration replays the same streams
        try:
            if n_out:
                observe(rid, out[:1])
            while pos < n_out:
                budget = limit - pos - 1  # Engine: min(remaining - 1, room)
                if room0 is not None:
                    budget = min(budget, room0 - pos)
                draft = propose(rid, budget) if budget > 0 else empty
                path, _ = accept_greedy(draft, target)
                a = len(path)
                add_req(index)
                add_pos(pos)
                add_prop(len(draft.tokens))  # not len(draft): Draft.__len__ is a Python call
                add_acc(a)
                emitted = out[pos : pos + a + 1]  # accepted drafts + bonus, as recorded
                pos += a + 1
                observe(rid, emitted)
        finally:
            drafter.end(rid)
    rec.wall_s = time.perf_counter() - t0
    return rec


# ---------------------------------------------------------------------------- grids


def expand_grid(base: dict, grid: dict[str, list]) -> list[dict]:
    """The cartesian product of the grid's values over the base options, in the order
    the grid names and values were given (the last name varies fastest)."""
    names = list(grid)
    return [{**base, **dict(zip(names, values))} for values in itertools.product(*(grid[n] for n in names))]


# ---------------------------------------------------------------------------- sources


def streams_from_run(store, run_id: int, max_new_tokens: int | None = None) -> list[Stream]:
    """The completed requests of a recorded run, in the order they ran. The run's own
    max_new_tokens (in its params) is the default limit."""
    run = store.run(run_id)  # KeyError "no run N in PATH" when absent
    limit = max_new_tokens if max_new_tokens is not None else run["params"].get("max_new_tokens")
    rows = [r for r in store.requests(run_id) if r["status"] == "ok"]
    streams = [Stream(r["request_id"], r["prompt_ids"], r["output_ids"], limit)
               for r in rows if r["prompt_ids"] is not None and r["output_ids"] is not None]
    if not streams:
        why = "no completed requests" if not rows else "no token ids (it was recorded before they were stored)"
        raise ReplayError(f"run {run_id} has {why}; nothing to replay")
    return streams


def read_streams(path: str | Path, encode=None, max_new_tokens: int | None = None) -> list[Stream]:
    """Streams from a JSONL file, one request per line: `prompt_ids` and `output_ids`
    (what `specscope generate --json` prints), or texts — `prompt` (or chat `messages`)
    and `output` — which `encode(obj) -> (prompt_ids, output_ids)` tokenises. Optional
    per line: `request_id`, `max_new_tokens`. The file is checked whole before anything
    is encoded, so a typo on the last line costs no tokenizer load."""
    records = [(where, _check_record(obj, where)) for where, _, obj in read_jsonl(
        path, ReplayError, "traces", "requests", "prompt_ids and output_ids (or prompt and output)")]
    streams = []
    for where, obj in records:
        if "prompt_ids" in obj:
            prompt_ids, output_ids = obj["prompt_ids"], obj["output_ids"]
        elif encode is None:
            raise ReplayError(f"{where}: text traces need a tokenizer")
        else:
            try:
                prompt_ids, output_ids = encode(obj)
            except ValueError as e:
                raise ReplayError(f"{where}: {e}") from None
            if not output_ids:
                raise ReplayError(f'{where}: "output" encodes to no tokens')
        limit = obj.get("max_new_tokens", max_new_tokens)
        if limit is not None and limit < len(output_ids):
            raise ReplayError(f"{where}: {len(output_ids)} output tokens, more than max_new_tokens {limit}")
        streams.append(Stream(str(obj.get("request_id", where.rsplit(":", 1)[1])), prompt_ids, output_ids, limit))
    return streams


def _check_record(obj: dict, where: str) -> dict:
    if "prompt_ids" in obj or "output_ids" in obj:
        for key in ("prompt_ids", "output_ids"):
            ids = obj.get(key)
            if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
                raise ReplayError(f'{where}: "{key}" must be a non-empty list of token ids (integers >= 0)')
    elif ("prompt" in obj or "messages" in obj) and "output" in obj:
        if not isinstance(obj["output"], str) or not obj["output"]:
            raise ReplayError(f'{where}: "output" must be a non-empty string')
    else:
        raise ReplayError(f'{where}: needs "prompt_ids" and "output_ids", or "prompt" (or "messages") and "output"')
    limit = obj.get("max_new_tokens")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ReplayError(f'{where}: "max_new_tokens" must be an integer >= 1')
    return obj
