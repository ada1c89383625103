"""`specscope profile verify` on the CPU: the cost curve, bytes read, roofline, experts."""

import json

from typer.testing import CliRunner

from specscope.cli import app
from specscope.models.loading import load_model
from specscope.profile import kv_bytes, parse_ints, weight_bytes

runner = CliRunner()


def test_profile_verify_json_rows():
    res = runner.invoke(app, ["profile", "verify", "--model", "random:tiny-moe", "--tokens", "1,4", "--ctx", "8,32",
                              "--batch", "1,2", "--reps", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["device"] == "cpu" and out["copy_TBps"] > 0 and out["moe_layers"] == 2
    rows = out["rows"]
    assert [(r["batch"], r["ctx"], r["tokens"]) for r in rows] == [
        (b, c, t) for b in (1, 2) for c in (8, 32) for t in (1, 4)]
    for r in rows:
        assert r["ms"] > 0 and r["path"] == "eager" and 0 < r["roofline_frac"]
        assert r["roofline_ms"] > 0 and r["weight_bytes"] > out["dense_weight_bytes"]
        # one token touches exactly top-k experts per layer; more tokens touch more
        assert (r["experts_touched"] == 2.0) if r["batch"] * r["tokens"] == 1 else r["experts_touched"] >= 2.0
    assert rows[0]["kv_bytes"] < rows[2]["kv_bytes"]  # longer context, more KV read


def test_profile_table_and_errors():
    res = runner.invoke(app, ["profile", "verify", "--model", "random:tiny", "--tokens", "1,2", "--ctx", "16",
                              "--reps", "1"])
    assert res.exit_code == 0, res.output
    assert "roofline" in res.stdout and "verify cost" in res.stdout and " %" in res.stdout
    bad = runner.invoke(app, ["profile", "verify", "--model", "random:tiny", "--tokens", "1,x"])
    assert bad.exit_code == 2 and "--tokens" in bad.output
    too_long = runner.invoke(app, ["profile", "verify", "--model", "random:tiny", "--ctx", "4000", "--reps", "1"])
    assert too_long.exit_code == 2 and "exceeds" in too_long.output
    assert parse_ints("1, 2,8", "--tokens") == [1, 2, 8]


def test_bytes_model():
    model, _, _ = load_model("random:tiny", device="cpu", max_seq_len=64)
    wb = weight_bytes(model)
    # tied embeddings: the table is read once, as the lm_head
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert wb["dense"] == params and wb["per_expert"] == 0
    a = model.arch
    assert kv_bytes(model, 2, 10) == 2 * a.n_layers * 2 * a.n_kv_heads * a.head_dim * 10 * 4
