"""The documented entrypoint of one's own (docs/examples/custom_loop.py, the library API) run
under `jaxpar launch --nproc 2`, then resumed from its checkpoint by a second launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from jaxpar.rundir.runlog import read_jsonl
from tests.support.helpers import REPO
from tests.support.launch_util import clean_env, kill_workers

SCRIPT = REPO / "docs" / "examples" / "custom_loop.py"


def _launch(run_dir, steps: int) -> tuple[int, str]:
    # no failure in these runs: no spares
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", "2", "--devices-per-proc",
           "4", "--no-spares", "--run-dir", str(run_dir), "--", sys.executable, str(SCRIPT), "--mesh",
           "data=2,tensor=4", "--steps", str(steps)]  # fmt: skip
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
    return proc.returncode, out


@pytest.mark.slow
def test_custom_loop_under_jaxpar_launch_trains_and_resumes(tmp_path):
    run_dir = tmp_path / "mine"
    rc, out = _launch(run_dir, 3)
    assert rc == 0, out[-4000:]
    lines = read_jsonl(str(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3]
    assert [m["step"] for m in lines if "eval_loss" in m] == [3]
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in lines if "loss" in m)
    assert (run_dir / "checkpoints" / "3").is_dir()

    rc, out = _launch(run_dir, 5)  # the same command, more steps: resumes from step 3
    assert rc == 0, out[-4000:]
    lines = read_jsonl(str(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3, 4, 5]
    starts = [e for e in read_jsonl(str(run_dir / "events.jsonl")) if e["event"] == "start"]
    assert [e["nproc"] for e in starts] == [2, 2]
