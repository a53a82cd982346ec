"""`jaxpar tune`: enumeration of layouts, pruning with reasons, figures read from compiled
programs, the prediction's overlap rule, rank correlation, and bad input as one line."""

from __future__ import annotations

import json
import math

import pytest

from jaxpar import cli
from jaxpar.config import apply_overrides, resolve_recipe, validate
from jaxpar.engine import collectives
from jaxpar.tools import hardware, tune


def gpt(*sets):
    return validate(apply_overrides(resolve_recipe("gpt_tiny"), list(sets)))


def test_factorizations_cover_every_mesh_once():
    got = tune.factorizations(8, 3)
    assert len(got) == 10 and len(set(got)) == 10
    assert all(math.prod(f) == 8 for f in got)
    assert (2, 2, 2) in got and (8, 1, 1) in got and (1, 1, 8) in got


def test_setting_variants_follow_the_config_and_the_mesh():
    cfg = gpt()
    base, variants = tune.setting_variants(cfg, {"data": 8})
    assert base == {"model.remat": "none", "train.microbatches": 1}
    assert "pipeline.schedule" not in {k for v in variants for k in v}
    base, variants = tune.setting_variants(cfg, {"data": 4, "pipeline": 2})
    assert base["pipeline.schedule"] == "gpipe" and base["pipeline.microbatches"] == 2
    from jaxpar.config import RANGES

    schedules = {v["pipeline.schedule"] for v in variants}
    assert schedules == set(RANGES["pipeline.schedule"])  # every allowed schedule, from the config


def test_pruning_reasons():
    cfg = gpt()  # global batch 32, 4 layers
    assert "does not split 64 ways" in tune.check_layout(cfg, {"data": 8, "fsdp": 8}, {})
    why = tune.check_layout(cfg, {"data": 8}, {"train.microbatches": 8})
    assert why == "batch too small: 4 rows per replica for 8 microbatches"
    why = tune.check_layout(cfg, {"pipeline": 8}, {"pipeline.microbatches": 8})
    assert why == "pipeline: 4 layers do not split into 8 stages x 1 groups"
    why = tune.check_layout(cfg, {"data": 8, "pipeline": 2}, {"pipeline.microbatches": 8})
    assert why == "batch too small: 4 rows per replica for 8 pipeline microbatches"
    assert tune.check_layout(cfg, {"data": 4, "tensor": 2}, {}) is None


def _layout(**kw):
    lay = tune.Layout({"data": 4, "tensor": 2}, {})
    lay.flops, lay.memory = 2e12, {"peak": 10 * 2**30}
    for k, v in kw.items():
        setattr(lay, k, v)
    return lay


def test_prediction_hides_batch_axis_traffic_and_exposes_the_rest():
    prof = hardware.PROFILES["h100x8"]
    compute = 2e12 / (prof.peak_flops * prof.efficiency)
    dp = _layout(axis_bytes={"data": 1e9}, axis_count={"data": 1})
    tune.predict(dp, prof)
    comm = 1e9 / prof.intra_bw + prof.latency_s
    hidden = min(comm, prof.overlap * compute)
    assert dp.predicted_step_s == pytest.approx(compute + comm - hidden + dp.split["overhead"])
    tp = _layout(axis_bytes={"tensor": 1e9}, axis_count={"tensor": 1})
    tune.predict(tp, prof)
    assert tp.predicted_step_s == pytest.approx(compute + comm + tp.split["overhead"])
    assert tp.bottleneck in ("compute", "tensor communication")
    # the data axis crosses hosts when the layout spans more devices than an island
    assert tune.crosses_hosts("data", {"data": 4, "fsdp": 8}, 8)
    assert not tune.crosses_hosts("fsdp", {"data": 4, "fsdp": 8}, 8)
    assert not tune.crosses_hosts("tensor", {"tensor": 16}, 8)


def test_a_layout_over_the_profiles_memory_does_not_fit():
    lay = _layout(memory={"peak": 200 * 2**30})
    tune.predict(lay, hardware.PROFILES["h100x8"])
    assert not lay.fits and lay.bottleneck == "memory"
    msg = tune.no_fit_message(gpt(), [lay], hardware.PROFILES["h100x8"])
    assert "200.00 GiB per device" in msg and "model.remat=block" in msg and "\n" not in msg


def test_spearman_and_the_measured_spread():
    assert tune.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert tune.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    ranked = [_layout(predicted_step_s=i) for i in range(10)]
    picks = tune.measure_picks(ranked, 4)
    assert picks[:2] == ranked[:2] and picks[-1] is ranked[-1] and len(picks) == 4


def test_kernel_count_multiplies_loop_bodies():
    hlo = """HloModule m

%body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %a = f32[2]{0} add(%x, %x)
  %b = f32[2]{0} multiply(%a, %a)
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  %w = (s32[]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %y = f32[2]{0} negate(%x)
}
"""
    assert tune.kernel_count(hlo) == 2 * 3 + 1 + 1


@pytest.mark.slow
def test_tune_compiles_and_ranks_real_layouts(tmp_path):
    """digits_mlp on 2 devices: every supported axis enumerated, the pipeline axis pruned with
    the model's reason, memory read from each compiled program, the JSON keys of --out."""
    out = tmp_path / "tune.json"
    cfg = validate(resolve_recipe("digits_mlp"))
    lines = []
    res = tune.tune(cfg, 2, "h100x8", out=str(out), log=lines.append)
    data = json.loads(out.read_text())
    meshes = {x["mesh"] for x in data["layouts"]}
    assert {"data=2", "fsdp=2", "tensor=2"} <= meshes
    assert any("axis pipeline" in p["reason"] for p in data["pruned"])
    for x in data["layouts"]:
        assert {"mesh", "settings", "fits", "predicted_step_s", "memory_bytes"} <= set(x)
        assert x["memory_bytes"] == x["memory"]["peak"] > 0
    by = {x["mesh"]: x for x in data["layouts"] if x["settings"]["train.microbatches"] == 1}
    # FSDP holds half the parameters and optimizer state of data parallelism per device
    assert by["fsdp=2"]["memory"]["arguments"] < by["data=2"]["memory"]["arguments"]
    assert set(by["data=2"]["collective_bytes"]) == {"data"}
    assert res["winner_command"].startswith("jaxpar train --recipe digits_mlp --mesh ")
    assert (tmp_path / "tune.png").stat().st_size > 0
    assert any(line.startswith("winner: jaxpar train") for line in lines)


def test_memory_matches_the_compiled_program(tmp_path):
    cfg = validate(resolve_recipe("digits_mlp"))
    import jax

    lay = tune.Layout({"fsdp": 2}, {"train.microbatches": 1})
    s, compiled = tune.compile_layout(cfg, lay, jax.devices()[:2], str(tmp_path))
    assert lay.memory == collectives.memory(compiled)
    assert lay.flops > 0 and lay.kernels > 0 and "fsdp" in lay.axis_bytes


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--hardware", "tpu9"], "unknown hardware profile 'tpu9'; use one of h100x8"),
        (["--devices", "64"], "--devices 64: this machine has 8 devices"),
        (["--out", "/proc/x.json"], "--out /proc/x.json is under /proc, a kernel filesystem"),
        (["--out", "{tmp}"], "is a folder; name a file in it"),
        (["--out", "{tmp}/file/x.json"], "file is a file, not a folder"),
        (["--axes", "data,bogus"], "--axes: unknown mesh axis 'bogus'"),
    ],
)
def test_bad_input_is_one_line(capsys, tmp_path, argv, needle):
    """Refused before any layout is compiled (an --out that cannot be written included)."""
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    args = ["tune", "--recipe", "gpt_tiny", "--devices", "8", *argv]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_device_count_with_no_valid_layout_is_one_line(capsys):
    """3 devices: gpt_tiny's batch of 32, 4 heads, 2 layers (--set: each layer more is traced
    again while the axes are probed) and 64 positions divide by none."""
    argv = ["tune", "--recipe", "gpt_tiny", "--devices", "3", "--hardware", "h100x8",
            "--set", "model.n_layers=2"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "no valid layout of gpt_tiny on 3 devices" in err and err.count("\n") == 1
