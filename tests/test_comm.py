"""`specscope comm`: a real all-reduce sweep over two gloo processes on loopback."""

import json

import pytest
from typer.testing import CliRunner

from specscope.cli import app
from specscope.comm import bus_bandwidth, payload_sizes, sweep


def test_payloads_and_bus_bandwidth():
    assert payload_sizes(7168, [1, 8]) == [(14336, 1), (114688, 8)]  # 14 KiB per token at hidden 7168
    # nccl-tests: busbw = bytes / time × 2(n−1)/n; 8 ranks move 1.75× the algorithm bandwidth.
    assert bus_bandwidth(1_000_000_000, 1.0, 8) == pytest.approx(1.75)
    assert bus_bandwidth(1_000_000_000, 1.0, 2) == pytest.approx(1.0)


def test_gloo_sweep_two_processes():
    report = sweep(2, payload_sizes(64, [1, 16]), iters=5, warmup=1)
    assert report["backend"] == "gloo" and report["world"] == 2
    rows = report["results"]
    assert [r["bytes"] for r in rows] == [128, 2048] and [r["mode"] for r in rows] == ["eager", "eager"]
    for r in rows:
        assert 0 < r["median_us"] <= r["p90_us"] and r["busbw_GBps"] > 0


def test_comm_cli_json():
    result = CliRunner().invoke(app, ["comm", "--sizes", "1K,4K", "--iters", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [r["bytes"] for r in report["results"]] == [1024, 4096]


@pytest.mark.parametrize("args, message", [
    (["--world", "1"], "--world must be >= 2"),
    (["--sizes", "12,abc"], "--sizes takes a comma-separated list"),
    (["--tokens", ""], "--tokens is empty"),
    (["--iters", "0"], "--iters must be >= 1"),
])
def test_comm_bad_input(args, message):
    result = CliRunner().invoke(app, ["comm", *args])
    assert result.exit_code == 2 and message in result.output
