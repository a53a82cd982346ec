"""`jaxpar launch` when the run directory's disk fills mid-run: real workers on a small tmpfs."""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from jaxpar.rundir.runlog import read_jsonl_counted
from tests.support.launch_util import Launch, losses, train_cmd

pytestmark = pytest.mark.slow

NPROC = ["--nproc", "2", "--devices-per-proc", "1", "--backoff", "0.2"]


def committed(run_dir) -> list[int]:
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def test_launch_disk_full_mid_run_stops_with_one_line_and_resumes(small_fs, tmp_path):
    """The finding was a 4-process job; 2 processes show the same thing here (a save whose
    shards are written by several processes and committed by process 0, a supervisor, a group
    to stop): the disk fills after the first committed checkpoints, and the job stops at once
    with one line naming ENOSPC and the directory — no wait in orbax's wait_until_finished, no
    "preempted" — the committed checkpoints restore, and no 0-byte temporary file is left."""
    run_dir = small_fs / "run"
    # 21 steps (the disk fills at ~7 checkpoints of ~0.8 MB): the learning rate decays over 21 steps, as in
    # the resumed run, whose processes load the programs this run compiled
    cmd = train_cmd(21, 1, "--set", "ckpt.keep=100")
    run = Launch(run_dir, NPROC, cmd, log_dir=tmp_path)
    try:
        code = run.wait(600)
    finally:
        run.close()
    out = run.output()
    assert code == 46, out  # jaxpar launch gives up with the workers' EXIT_NO_SPACE
    lines = [x for x in out.splitlines() if "ENOSPC" in x]
    assert len(lines) == 1 and str(run_dir) in lines[0], out  # the worker's line, relayed once
    assert "no space left on device (ENOSPC)" in lines[0], out
    (gave_up,) = run.events("gave_up")
    assert "ran out of disk space" in gave_up["reason"] and str(run_dir) in gave_up["reason"]
    assert not run.events("preempted") and not run.events("restart"), out
    assert [f["cause"] for f in run.events("failure")] == ["exit"], out  # not a hang
    assert "Traceback" not in out and "Event loop is closed" not in out, out
    steps = committed(run_dir)
    assert steps, f"nothing committed before the disk filled:\n{out}"
    leftovers = [
        p for p in glob.glob(f"{run_dir}/**/*", recursive=True)
        if "tmp" in os.path.basename(p) and (os.path.isdir(p) or os.path.getsize(p) == 0)
    ]  # fmt: skip
    assert not leftovers, leftovers
    assert read_jsonl_counted(str(run_dir / "events.jsonl"))[1] <= 1  # at most one torn line
    # the committed checkpoint restores: resume on a disk with room, one step further
    roomy = tmp_path / "roomy"
    shutil.copytree(run_dir, roomy, ignore=shutil.ignore_patterns("lock"))
    again = Launch(roomy, NPROC, train_cmd(steps[-1] + 1, 0), log_dir=tmp_path, name="again")
    try:
        assert again.wait(600) == 0, again.output()
    finally:
        again.close()
    assert again.events("restore")[-1]["step"] == steps[-1]
    assert max(losses(roomy)) == steps[-1] + 1
