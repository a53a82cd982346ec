"""The documented entrypoint of one's own (docs/examples/custom_loop.py, the library API) run
under `jaxpar launch --nproc 2` with a worker killed: the restart restores the newest local
snapshot, and summary.json and the report account for it as for `jaxpar train`. A second launch
resumes the finished run with more steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.rundir.runlog import last_per_step, read_jsonl
from tests.support.helpers import REPO
from tests.support.launch_util import clean_env, kill_workers

SCRIPT = REPO / "docs" / "examples" / "custom_loop.py"


def _launch(run_dir, steps: int, *args: str) -> tuple[int, str, float]:
    """(exit code, output, seconds of the launch measured around it)."""
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", "2", "--devices-per-proc",
           "4", *args, "--run-dir", str(run_dir), "--", sys.executable, str(SCRIPT), "--mesh",
           "data=2,tensor=4", "--steps", str(steps)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=run_dir.parent, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"jaxpar launch timed out:\n{out[-4000:]}") from None
    finally:
        kill_workers(run_dir)
    return proc.returncode, out, time.monotonic() - t0


@pytest.mark.slow
def test_custom_loop_under_jaxpar_launch_recovers_and_is_accounted_like_train(tmp_path):
    run_dir = tmp_path / "mine"
    rc, out, measured = _launch(run_dir, 12, "--fault", "kill@6:process=1")
    assert rc == 0, out[-4000:]
    events = read_jsonl(str(run_dir / "events.jsonl"))
    lines = read_jsonl(str(run_dir / "metrics.jsonl"))
    assert list(last_per_step(lines)) == list(range(1, 13))
    assert all(0.0 <= m["accuracy"] <= 1.0 and m["lr"] is not None for m in lines if "loss" in m)
    assert [m["step"] for m in lines if "eval_loss" in m] == [12]
    assert (run_dir / "checkpoints" / "12").is_dir()
    starts = [e for e in events if e["event"] == "start"]
    assert [e["incarnation"] for e in starts] == [0, 1]
    assert starts[1]["path"] == "spare"  # a pre-started spare ran the script
    (restore,) = [e for e in events if e["event"] == "restore"]
    # from RAM, a step before the kill: which one depends on how far the asynchronous snapshot
    # writer had got (5 when idle; 3 seen on a loaded machine)
    assert restore["incarnation"] == 1 and restore["tier"] == "local", restore
    assert 1 <= restore["step"] < 6, restore

    with open(run_dir / "summary.json") as f:
        s = json.load(f)
    assert s["status"] == "completed" and s["restarts"] == 1
    # one timeline: the wall-clock is the launch's, not the incarnations' spans summed on top
    assert s["wall_s"] <= measured < 1.3 * s["wall_s"], (s["wall_s"], measured)
    (inc,) = s["incidents"]
    assert inc["cause"] == "signal" and inc["process"] == 1
    for phase in ("restore_s", "compile_s", "first_step_s", "recovery_s"):
        assert inc[phase] is not None and inc[phase] >= 0, (phase, inc)

    rep = subprocess.run([sys.executable, "-m", "jaxpar.cli", "report", str(run_dir)],
                         env=clean_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert rep.returncode == 0, rep.stderr[-4000:]
    md = (run_dir / "report" / "report.md").read_text()
    assert f"| restores | step {restore['step']} (incarnation 1) |" in md
    assert f"{s['wall_s']:.1f} s" in md and f"{s['goodput']:.1%}" in md

    rc, out, _ = _launch(run_dir, 14)  # more steps: resumes from step 12
    assert rc == 0, out[-4000:]
    lines = read_jsonl(str(run_dir / "metrics.jsonl"))
    assert list(last_per_step(lines)) == list(range(1, 15))
    events = read_jsonl(str(run_dir / "events.jsonl"))
    assert [e["nproc"] for e in events if e["event"] == "start"] == [2, 2, 2]
    assert [e["step"] for e in events if e["event"] == "restore"][-1] == 12
