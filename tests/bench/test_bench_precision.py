"""`jaxpar bench precision --quick`: four variants (fp32/bf16 x remat off/on) of gpt_tiny made small
(helpers.SMALL) on one device, in one subprocess; checks precision.json's shape and the
deterministic memory figures (timings are not asserted: tests never assert on wall-clock time)."""

from __future__ import annotations

import math

import pytest

from tests.bench.test_bench_quick import bench
from tests.support.helpers import SMALL


@pytest.mark.slow
def test_bench_precision_quick(tmp_path):
    r = bench("precision", str(tmp_path), *SMALL)  # one narrow block: the variants compile fast
    assert r["suite"] == "precision" and r["recipe"] == "gpt_tiny" and r["devices"] == 1
    assert r["overrides"] == list(SMALL[1::2])
    rows = {(row["compute"], row["remat"]): row for row in r["rows"]}
    assert set(rows) == {("float32", "none"), ("float32", "block"), ("bfloat16", "none"),
                         ("bfloat16", "block")}  # fmt: skip
    for row in r["rows"]:
        assert row["median_step_s"] > 0 and row["tokens_per_s"] > 0
        assert row["mfu"] is None  # CPU: no peak FLOP/s
        assert math.isfinite(row["loss"]) and row["temp_bytes"] > 0 and row["argument_bytes"] > 0
    base = rows[("float32", "none")]
    assert base["saved_ratio"] == 1.0 and base["step_ratio"] == 1.0
    # Remat keeps a fraction of the activations; the state (arguments) does not change.
    assert rows[("float32", "block")]["saved_bytes"] < 0.5 * base["saved_bytes"]
    assert rows[("bfloat16", "none")]["argument_bytes"] == base["argument_bytes"]
    # Same data and model: bf16 trains within 2e-2 of fp32, remat within roundoff.
    assert abs(rows[("bfloat16", "none")]["loss"] - base["loss"]) <= 2e-2 * base["loss"]
    assert abs(rows[("float32", "block")]["loss"] - base["loss"]) <= 1e-5
