"""`jaxpar bench context --quick`: per-device memory by ring size from the compiled step, and the
bytes attention sends over `context` equal to the count in theory (timings are not asserted)."""

from __future__ import annotations

import os

import pytest

from tests.bench.test_bench_quick import bench
from tests.support.helpers import SMALL


@pytest.mark.slow
def test_bench_context_quick(tmp_path):
    r = bench("context", str(tmp_path), *SMALL)
    rows = r["rows"]
    assert {(x["ring"], x["impl"]) for x in rows} == {
        (1, "ring"),
        (2, "ring"),
        (2, "allgather"),
        (4, "ring"),
        (4, "allgather"),
    }
    for x in rows:
        assert x["bytes_measured"] == x["bytes_theory"], x
        assert x["temps"] > 0 and x["peak"] >= x["temps"] and x["step_s"] > 0
    temps = {(x["ring"], x["impl"]): x["temps"] for x in rows}
    assert temps[(4, "ring")] < temps[(1, "ring")]  # the ring holds less of each sequence
    assert len({round(x["loss"], 4) for x in rows}) == 1  # every layout trains the same model
    dated = [f for f in os.listdir(tmp_path) if f.endswith("-context.md")]
    assert dated, os.listdir(tmp_path)
