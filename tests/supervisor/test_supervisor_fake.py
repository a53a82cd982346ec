"""The supervisor's behaviour with real processes and signals but a fake worker (no jax), so each
case takes seconds: crash loop with backoff, a usage error is not retried, hang detection with
stack dumps, SIGTERM to the supervisor passed on as a preemption notice.

The fake worker (launch_util.FAKE_WORKER) follows the worker contract.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from jaxpar.rundir.runlog import TMP_SUFFIX
from tests.support.launch_util import Launch, clean_env, fake_cmd  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _fake(tmp_path, mode: str, steps: int, *args: str, env=None) -> Launch:
    cmd = fake_cmd(tmp_path, mode, steps)
    return Launch(tmp_path / "run", ["--nproc", "2", "--backoff", "0.2", *args], cmd, env=env)


def test_crash_loop_gives_up_with_backoff(tmp_path):
    run = _fake(tmp_path, "crash", 10, "--max-restarts", "9")
    try:
        rc = run.wait(60)
    finally:
        run.close()
    assert rc == 1
    assert "crash loop" in run.output()
    (g,) = run.events("gave_up")
    assert "same failure (exit) at step 3 3 times" in g["reason"]
    assert [r["backoff_s"] for r in run.events("restart")] == [0.0, 0.2]  # at once, then back off
    assert [f["code"] for f in run.events("failure")] == [3, 3, 3]
    assert run.summary()["status"] == "gave_up"


def test_usage_error_is_not_restarted(tmp_path):
    run = _fake(tmp_path, "usage", 10)
    try:
        rc = run.wait(60)
    finally:
        run.close()
    assert rc == 1 and run.events("restart") == []
    assert "code 2" in run.events("gave_up")[0]["reason"]


def test_hang_detected_dumped_restarted(tmp_path):
    run = _fake(tmp_path, "hang", 8, "--hang-timeout", "1.5")
    try:
        assert run.wait(60) == 0, run.output()
    finally:
        run.close()
    (f,) = run.events("failure")
    assert (f["cause"], f["process"], f["step"]) == ("hang", 1, 4)
    (dump,) = run.events("stacks_dumped")
    text = (run.run_dir / "stacks" / "inc0-proc1.txt").read_text()
    assert "in stuck_here" in text, dump
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == 8 and s["restarts"] == 1
    assert s["incidents"][0]["detect_s"] == pytest.approx(1.5, abs=1.0)


def test_sigterm_to_supervisor_is_a_preemption(tmp_path):
    env = clean_env()
    env["FAKE_STEP_S"] = "0.5"
    run = _fake(tmp_path, "train", 1000, env=env)
    try:
        deadline = time.time() + 60
        while not (run.run_dir / "heartbeats" / "proc1.json").exists():
            assert time.time() < deadline and run.proc.poll() is None, run.output()
            time.sleep(0.1)
        run.proc.send_signal(signal.SIGTERM)
        rc = run.wait(60)
    finally:
        run.close()
    assert rc == 42, run.output()
    assert run.summary()["status"] == "preempted"
    assert run.events("restart") == []


def _wait_for_heartbeat(run: Launch, process: int, step: int, timeout: float = 60) -> int:
    """The os pid of `process` once its heartbeat reaches `step`."""
    path = run.run_dir / "heartbeats" / f"proc{process}.json"
    deadline = time.time() + timeout
    while True:
        assert time.time() < deadline and run.proc.poll() is None, run.output()
        try:
            hb = json.loads(path.read_text())
            if hb["step"] >= step:
                return int(hb["pid"])
        except (OSError, ValueError):
            pass
        time.sleep(0.05)


def test_sigstop_hang_names_the_stopped_process(tmp_path):
    env = clean_env()
    env["FAKE_STEP_S"] = "0.1"
    run = _fake(tmp_path, "train", 40, "--hang-timeout", "1.5", env=env)
    try:
        os.kill(_wait_for_heartbeat(run, 1, 3), signal.SIGSTOP)
        assert run.wait(120) == 0, run.output()
    finally:
        run.close()
    (f,) = run.events("failure")
    assert (f["cause"], f["process"]) == ("hang", 1), f
    assert "hang of process 1" in run.output()
    assert run.summary()["status"] == "completed"


def test_disk_full_supervisor_stops_with_one_line(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], check=True)
    try:
        run_dir = mnt / "run"
        run_dir.mkdir()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the disk to the last byte
            while os.write(fd, b"\0" * 512):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        cmd = fake_cmd(tmp_path, "train", 5)
        run = Launch(run_dir, ["--nproc", "2", "--backoff", "0.1"], cmd, log_dir=tmp_path)
        try:
            rc = run.wait(120)
        finally:
            run.close()
        text = run.output()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    # the run directory's lock cannot be written: one line naming the error and the directory
    assert rc == 2, text
    assert "Traceback" not in text, text
    assert text.count("No space left on device") == 1 and str(run_dir) in text, text


def test_disk_full_worker_gives_up_and_the_uncommitted_save_is_removed(tmp_path):
    """Process 1 sees ENOSPC first (exit 46) while process 0, which would have removed the
    failed save's folder, waits at the barrier and is stopped: the supervisor gives up with 46
    and removes the uncommitted folder itself once every worker has stopped; committed
    checkpoints stay."""
    committed = tmp_path / "run" / "checkpoints" / "1"
    committed.mkdir(parents=True)
    (committed / "data").write_bytes(b"x" * 100)
    run = _fake(tmp_path, "nospace", 10, "--max-restarts", "5", "--no-spares")
    try:
        rc = run.wait(60)
    finally:
        run.close()
    assert rc == 46, run.output()
    assert [(f["process"], f["code"]) for f in run.events("failure")] == [(1, 46)]
    (g,) = run.events("gave_up")
    assert "ran out of disk space" in g["reason"], g
    assert g["discarded"] == [f"2{TMP_SUFFIX}"], g
    assert run.events("restart") == []
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]
    assert (committed / "data").read_bytes() == b"x" * 100


def test_second_launch_on_the_same_run_dir_refuses_naming_the_holder(tmp_path):
    env = clean_env()
    env["FAKE_STEP_S"] = "0.1"
    first = _fake(tmp_path, "train", 60, env=env)
    second = None
    try:
        _wait_for_heartbeat(first, 1, 1)
        second = Launch(first.run_dir, ["--nproc", "1"], fake_cmd(tmp_path, "train", 2),
                        name="second")  # fmt: skip
        assert second.wait(60) == 2
        out = second.output().strip()
        assert len(out.splitlines()) == 1 and "in use by jaxpar launch" in out, out
        assert f"pid {first.proc.pid}" in out
        assert first.wait(120) == 0, first.output()
    finally:
        first.close()
        if second is not None:
            second.close()
    assert first.summary()["status"] == "completed"
