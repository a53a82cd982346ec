"""`jaxpar bench overhead|meshes|pipeline --quick` run as subprocesses and write SUITE.json of the documented
shape (timings are not asserted: tests never assert on wall-clock time)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from tests.support.helpers import SMALL, cpu_env, ok, run

PNG = b"\x89PNG\r\n\x1a\n"


def bench(suite: str, out: str, *args: str, timeout: float = 900, fast_compile=True) -> dict:
    """`jaxpar bench SUITE --quick --out OUT [ARGS]` on 8 simulated devices; returns SUITE.json."""
    cmd = [sys.executable, "-m", "jaxpar.cli", "bench", suite, "--quick", "--out", out, *args]
    env = cpu_env(fast_compile=fast_compile)
    text = ok(run(cmd, env=env, timeout=timeout, merge=True)).stdout
    assert "|---" in text  # the markdown table is printed
    path = os.path.join(out, f"{suite}.json")
    assert f"\nwrote {path}\n" in text  # and where its JSON went
    with open(path) as f:
        return json.load(f)


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_bench_overhead_quick(tmp_path):
    # gpt_tiny made smaller (the plain step takes its shapes from the parameters), compiled with
    # the tests' fast-compile flags like both steps it compares (8 steps of the small model each:
    # optimised code would take ~2.5x the CPU, nearly all of it compiling): what is compared and
    # written is the point here, not the model or how fast its steps run
    r = bench("overhead", str(tmp_path), *SMALL)
    assert r["suite"] == "overhead" and r["devices"] == 8
    assert r["overrides"] == list(SMALL[1::2])  # what was measured is recorded
    assert _positive(r["ratio"])  # top-level ratio: jaxpar step / plain jax.jit step
    assert _positive(r["median_step_s_jaxpar"]) and _positive(r["median_step_s_plain"])
    assert r["ratio"] == pytest.approx(r["median_step_s_jaxpar"] / r["median_step_s_plain"])
    assert r["reps"] >= 1
    assert r["max_loss_diff"] < 1e-3  # the two steps train the same model on the same data


@pytest.mark.slow
def test_bench_meshes_quick(tmp_path):
    r = bench(
        "meshes", str(tmp_path), "--recipe", "digits_mlp"
    )  # any recipe, from the command line
    assert r["suite"] == "meshes" and r["recipe"] == "digits_mlp" and r["layouts"]
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


@pytest.mark.slow
def test_bench_pipeline_quick(tmp_path):
    # narrower layers (--quick sets 4 of them) on shorter sequences: the schedules and the fit
    # are the point here, not the model.
    # Two schedules: one layer group per stage (v = 1) and two (v = 2), the two ways the bench
    # counts busy ticks and fits. The bench handles every schedule of one v alike (the F, B and
    # W ticks of a table, gpipe's included), so zero_bubble or 1f1b would run gpipe's path here
    # again; every schedule's table and step are the pipeline and schedule tests'.
    schedules = ("gpipe", "interleaved_1f1b")
    r = bench("pipeline", str(tmp_path), "--schedules", ",".join(schedules),
              "--set", "model.d_model=64", "--set", "model.d_mlp=128",
              "--set", "model.seq_len=32", "--set", "data.seq_len=32")  # fmt: skip
    rows = r["rows"]
    assert {(row["p"], row["m"], row["schedule"]) for row in rows} == {
        (2, m, s) for m in (2, 4) for s in schedules
    }  # quick: two m per schedule (the full run takes five)
    for row in rows:
        assert _positive(row["step_s_median"]) and _positive(row["step_s_min"])
        assert row["ticks"] >= 3 * row["m"] * row["v"] + row["p"] - 1  # F, B and W: a tick each
        assert 0 < row["bubble_predicted"] < 1 and math.isfinite(row["bubble_measured"])
    gpipe = [row for row in rows if row["schedule"] == "gpipe"]
    assert all(
        row["bubble_predicted"] == pytest.approx(row["bubble_gpipe_formula"]) for row in gpipe
    )
    assert {(f["p"], f["schedule"]) for f in r["fits"]} == {(2, row["schedule"]) for row in rows}
    st = r["stage_times"]  # per-stage time and the split recommended from it
    assert sum(st["recommended_split"]) == st["layers"] == 4 and len(st["even_stage_s"]) == 2
    assert max(st["recommended_stage_s"]) <= max(st["even_stage_s"])
    (record,) = tmp_path.glob("*-pipeline.md")  # the split as the flag that runs it
    split = ",".join(map(str, st["recommended_split"]))
    assert f"--set pipeline.stage_layers={split}" in record.read_text()
    blob = (tmp_path / "pipeline.png").read_bytes()  # measured vs predicted bubble, per p
    assert blob[:8] == PNG and len(blob) > 10_000
