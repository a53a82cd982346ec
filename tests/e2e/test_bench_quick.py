"""`jaxpar bench overhead|meshes --quick` run as subprocesses and write SUITE.json of the documented
shape (timings are not asserted: tests never assert on wall-clock time)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false "
    "intra_op_parallelism_threads=1",
}


def bench(suite: str, out: str, timeout: float = 900) -> dict:
    """`jaxpar bench SUITE --quick --out OUT` in its own process group; returns SUITE.json."""
    args = [sys.executable, "-m", "jaxpar.cli", "bench", suite, "--quick", "--out", out]
    proc = subprocess.Popen(
        args, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        raise AssertionError(f"bench {suite} timed out after {timeout}s:\n{text[-4000:]}") from None
    assert proc.returncode == 0, text[-4000:]
    assert "|---" in text  # the markdown table is printed
    with open(os.path.join(out, f"{suite}.json")) as f:
        return json.load(f)


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_bench_overhead_quick(tmp_path):
    r = bench("overhead", str(tmp_path))
    assert r["suite"] == "overhead" and r["devices"] == 8
    assert _positive(r["ratio"])  # top-level ratio: jaxpar step / plain jax.jit step
    assert _positive(r["median_step_s_jaxpar"]) and _positive(r["median_step_s_plain"])
    assert r["ratio"] == pytest.approx(r["median_step_s_jaxpar"] / r["median_step_s_plain"])
    assert r["reps"] >= 1
    assert r["max_loss_diff"] < 1e-3  # the two steps train the same model on the same data


@pytest.mark.slow
def test_bench_meshes_quick(tmp_path):
    r = bench("meshes", str(tmp_path))
    assert r["suite"] == "meshes" and r["layouts"]
    devices = [row["devices"] for row in r["layouts"]]
    assert devices[0] == 1 and max(devices) == 8
    for row in r["layouts"]:
        assert {"mesh", "devices", "median_step_s", "per_s", "collective_bytes"} <= set(row)
        assert _positive(row["median_step_s"]) and _positive(row["per_s"])
        assert isinstance(row["collective_bytes"], int) and row["collective_bytes"] >= 0
        assert isinstance(row["collectives"], list | dict)  # per (kind, axes, dtype)
    one = next(row for row in r["layouts"] if row["devices"] == 1)
    assert one["collective_bytes"] == 0  # one device: nothing to communicate
    assert all(row["collective_bytes"] > 0 for row in r["layouts"] if row["devices"] > 1)
