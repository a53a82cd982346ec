"""`jaxpar bench moe --quick`: MoE vs dense tokens/s, the all-to-all bytes of the compiled program
against theory, dropped assignments by capacity factor (timings are not asserted)."""

from __future__ import annotations

import json
import math
import os

import pytest

from jaxpar.bench import harness

SMALL = ("model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.d_mlp=64",
         "model.seq_len=32", "data.seq_len=32", "data.global_batch=16")  # fmt: skip


@pytest.mark.slow
def test_bench_moe_quick(tmp_path, capsys):
    b = harness.Bench.create("gpt_moe", SMALL, quick=True, out_dir=str(tmp_path))
    r = harness.run_suite("moe", b)
    assert r["layouts"] == {"moe": "data=-1,expert=4", "dense": "data=-1"}
    assert r["active_params"] < r["moe_params"]
    # per MoE layer a token also passes the router [D, E] and a second expert's output bias
    assert r["active_params"] - r["dense_params"] == 2 * (64 * 8 + 64)
    ratio = r["tokens_per_s_ratio"]
    assert math.isfinite(ratio) and ratio > 0
    a2a = r["all_to_all"]
    # dispatch and return, forward and backward, in each of the 2 MoE layers
    assert a2a["ops"] == a2a["theory_ops"] == 8
    assert a2a["measured_bytes"] == pytest.approx(a2a["theory_slots_bytes"], rel=1e-9)
    assert a2a["theory_tokens_bytes"] < a2a["theory_slots_bytes"]  # capacity factor 1.25
    drops = r["dropped_by_capacity"]
    assert set(drops) == {"1.0", "2.0"} and 0 <= drops["2.0"] <= drops["1.0"] <= 1
    with open(tmp_path / "moe.json") as f:
        assert json.load(f)["suite"] == "moe"
    (record,) = [p for p in os.listdir(tmp_path) if p.endswith("-moe.md")]
    text = (tmp_path / record).read_text()
    assert "jaxpar bench moe" in text and "MoE / dense tokens/s" in text
