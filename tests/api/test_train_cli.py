"""`python -m train` and `jaxpar inspect` as a user runs them: subprocesses on 8 CPU devices.

Checks the run-directory contract of docs/design.md (config.json, metrics.jsonl, events.jsonl,
incarnation, summary.json) on a 12-step run of gpt_tiny made small (helpers.SMALL: the contract,
not the model, is the point) with evaluation every 6 steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest

from tests.support.helpers import SMALL, ok, run, train_cmd

pytestmark = pytest.mark.slow

TIMEOUT_S = 300  # each command; on 8 simulated devices (tests.support.helpers.cpu_env)


def _jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("gpt_tiny") / "run")
    cmd = train_cmd(run_dir, "--set", "train.eval_every=6", *SMALL, steps=12)
    proc = ok(run(cmd, timeout=TIMEOUT_S))
    return run_dir, proc


def test_exits_cleanly_and_says_where_the_run_is(gpt_run):
    run_dir, proc = gpt_run
    assert "Traceback" not in proc.stderr
    assert f"run directory: {os.path.abspath(run_dir)}" in proc.stdout
    assert "final loss" in proc.stdout and "after 12 steps" in proc.stdout


def test_config_json_is_the_resolved_config(gpt_run):
    run_dir, _ = gpt_run
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["name"] == "gpt_tiny"
    assert cfg["train"]["steps"] == 12 and cfg["train"]["eval_every"] == 6
    assert cfg["model"]["_class"] == "jaxpar.models.gpt:GPTConfig"
    assert cfg["model"]["n_layers"] == 1 and cfg["model"]["d_model"] == 64  # --set (SMALL)
    assert cfg["mesh_resolved"] == "data=8,fsdp=1,tensor=1,pipeline=1"  # no --mesh: all on data


def test_metrics_jsonl_has_one_line_per_step_and_eval_lines(gpt_run):
    run_dir, _ = gpt_run
    lines = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    train = [x for x in lines if "loss" in x]
    evals = [x for x in lines if "eval_loss" in x]
    assert len(train) + len(evals) == len(lines)
    assert [x["step"] for x in train] == list(range(1, 13))
    required = {"step", "loss", "step_time_s", "tokens_per_s", "mfu", "incarnation", "time"}
    for x in train:
        assert required <= x.keys(), x
        assert math.isfinite(x["loss"]) and x["step_time_s"] > 0 and x["tokens_per_s"] > 0
        assert x["mfu"] is None  # CPU: peak FLOP/s unknown
        assert x["incarnation"] == 0
    times = [x["time"] for x in lines]
    assert times == sorted(times) and times[0] > 1.6e9  # unix seconds, in order
    assert [x["step"] for x in evals] == [6, 12]
    for x in evals:
        assert "loss" not in x and math.isfinite(x["eval_loss"])
        assert {"incarnation", "time"} <= x.keys()
    # Full float precision, not a rounded display value.
    assert any(len(repr(x["loss"]).split(".")[-1]) > 6 for x in train)


def test_eval_step_goes_through_the_compiled_program_cache(gpt_run):
    # a restarted group loads the eval step from RUN_DIR/compiled/ instead of compiling it again
    run_dir, _ = gpt_run
    names = os.listdir(os.path.join(run_dir, "compiled"))
    assert any(n.startswith("eval_step-") for n in names), names


def test_loss_falls(gpt_run):
    run_dir, _ = gpt_run
    lines = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    losses = [x["loss"] for x in lines if "loss" in x]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    evals = [x["eval_loss"] for x in lines if "eval_loss" in x]
    assert evals[1] < evals[0], evals


def test_events_incarnation_and_summary(gpt_run):
    run_dir, _ = gpt_run
    events = _jsonl(os.path.join(run_dir, "events.jsonl"))
    for e in events:
        assert {"event", "time", "incarnation"} <= e.keys() and e["incarnation"] == 0, e
    names = [e["event"] for e in events]
    for name in ("start", "compiled", "done"):
        assert names.count(name) == 1, names
    assert names.index("start") < names.index("compiled") < names.index("done")
    start = events[names.index("start")]
    assert start["nproc"] == 1 and start["mesh"] == "data=8,fsdp=1,tensor=1,pipeline=1"
    assert events[names.index("compiled")]["seconds"] > 0
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)

    with open(os.path.join(run_dir, "incarnation")) as f:
        assert f.read().strip() == "0"

    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    keys = {"steps", "final_loss", "wall_s", "restarts", "goodput", "lost_steps", "mttr_s"}
    assert keys | {"median_tokens_per_s"} <= summary.keys(), summary
    last = [x for x in _jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss" in x][-1]
    assert summary["steps"] == 12 and summary["final_loss"] == last["loss"]
    assert summary["restarts"] == 0 and summary["lost_steps"] == 0
    assert summary["mttr_s"] is None  # nothing failed
    assert 0 < summary["goodput"] <= 1 and summary["wall_s"] > 0
    assert summary["median_tokens_per_s"] > 0


def test_digits_mlp_on_dp2_tp4(tmp_path):
    run_dir = str(tmp_path / "run")
    cmd = train_cmd(run_dir, "--recipe", "digits_mlp", "--mesh", "dp2_tp4", steps=5)
    proc = ok(run(cmd, timeout=TIMEOUT_S))
    assert "after 5 steps" in proc.stdout
    lines = [x for x in _jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss" in x]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
    assert all(x["samples_per_s"] > 0 and "tokens_per_s" not in x for x in lines)
    assert all(0 <= x["accuracy"] <= 1 for x in lines)
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["mesh_resolved"] == "data=2,fsdp=1,tensor=4,pipeline=1"


def test_inspect_prints_specs_and_the_tensor_all_reduces():
    exe = shutil.which("jaxpar")
    cmd = [exe] if exe else [sys.executable, "-m", "jaxpar.cli"]
    cmd += ["inspect", "--recipe", "gpt_tiny", "--mesh", "dp2_tp4"]
    out = ok(run(cmd, timeout=TIMEOUT_S)).stdout
    assert "PartitionSpec" in out
    rows = [line for line in out.splitlines() if line.startswith("| ['blocks']['w_in']")]
    assert len(rows) == 1 and "(None, None, 'tensor')" in rows[0], rows
    assert any(line.startswith("| all-reduce | tensor |") for line in out.splitlines()), out
    assert any(line.startswith("| all-reduce | data |") for line in out.splitlines()), out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "data=3"], "has 3 positions but there are 8 devices"),
        (["--set", "optim.lr=fast"], "--set optim.lr=fast: expected float"),
    ],
)
def test_user_errors_exit_nonzero_with_the_message(args, message, tmp_path):
    cmd = [sys.executable, "-m", "train", *args, "--steps", "1", "--run-dir", str(tmp_path / "r")]
    proc = run(cmd, timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
