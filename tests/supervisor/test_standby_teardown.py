"""`jaxpar launch --standby` leaves no standby process behind on any exit path: a normal finish,
a crash-loop stop, and the supervisor stopped by SIGTERM. 2 processes x 2 CPU devices, small
gpt_tiny; every test waits until the standby group is running, then ends the job its way and
checks that every process the supervisor ever started is gone.

    python -m pytest tests/supervisor/test_standby_teardown.py -m slow
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.support.launch_util import Launch, train_cmd  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WAIT = 600
ARGS = ["--nproc", "2", "--devices-per-proc", "2", "--standby"]


def _standby_pids(run_dir: Path) -> list[int]:
    target, out = os.path.abspath(run_dir), []
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            if env.get("JAXPAR_RUN_DIR") == target and env.get("JAXPAR_STANDBY") == "1":
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _descendants(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _wait_for_standby(run: Launch, timeout: float = WAIT) -> set[int]:
    """Every process of the job once its standby group (2 processes) runs."""
    deadline = time.time() + timeout
    seen: set[int] = set()
    while time.time() < deadline:
        seen |= _descendants(run.proc.pid)
        standby = _standby_pids(run.run_dir)
        if len(standby) == 2:
            return seen | set(standby)
        if run.proc.poll() is not None:
            raise AssertionError(f"launch ended before its standby group ran:\n{run.output()}")
        time.sleep(0.2)
    raise AssertionError(f"no standby group within {timeout}s:\n{run.output()}")


def _gone(pids: set[int]) -> list[int]:
    """Those of `pids` still running (zombies count as gone: nothing runs)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def _run(tmp_path, extra, steps, faults=()):
    cmd = train_cmd(steps, 100, local_every=1)
    args = [*ARGS, *extra, *(a for f in faults for a in ("--fault", f))]
    return Launch(tmp_path / "run", args, cmd)


def test_normal_finish_releases_the_standby_group(tmp_path):
    run = _run(tmp_path, [], 10, ["slow@2:process=0:seconds=2"])
    try:
        pids = _wait_for_standby(run)
        assert run.wait(WAIT) == 0, run.output()
        assert not _gone(pids), f"still running after the job finished: {_gone(pids)}"
    finally:
        run.close()


def test_crash_loop_stop_releases_the_standby_group(tmp_path):
    # --crash-loop 1: the first failure stops the job (the same path as a crash loop)
    run = _run(tmp_path, ["--crash-loop", "1"], 1000, ["slow@2:process=0:seconds=1"])
    try:
        pids = _wait_for_standby(run)
        run.wait_for_step(1, WAIT)  # its heartbeat names the worker's pid
        os.kill(run.worker_pid(1), signal.SIGKILL)
        assert run.wait(WAIT) == 1, run.output()
        (gave_up,) = run.events("gave_up")
        assert "crash loop" in gave_up["reason"], gave_up
        assert not _gone(pids), f"still running after the crash-loop stop: {_gone(pids)}"
    finally:
        run.close()


def test_supervisor_sigterm_releases_the_standby_group(tmp_path):
    run = _run(tmp_path, [], 1000, ["slow@2:process=0:seconds=1"])
    try:
        pids = _wait_for_standby(run)
        run.proc.send_signal(signal.SIGTERM)  # preemption: the workers save, the job stops
        assert run.wait(WAIT) == 42, run.output()
        assert not _gone(pids), f"still running after SIGTERM: {_gone(pids)}"
    finally:
        run.close()


def test_a_standby_workers_output_leaves_no_file_behind(tmp_path, monkeypatch):
    """Its output before "go" is in a file unlinked at once: copied into the worker's log on
    "go" and into logs/ when kept, and nothing is left in the temporary directory even if the
    supervisor is killed (no cleanup runs)."""
    import sys
    import tempfile

    from jaxpar.supervisor.standby_group import Standby

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    s = Standby({"incarnation": 3})
    code = "import sys; print('warming up', flush=True); sys.stdin.read()"
    s.spawn(5, [sys.executable, "-c", code], dict(os.environ))
    assert os.listdir(tmp) == []
    deadline = time.time() + 60
    while b"warming up" not in s.output(5):
        assert time.time() < deadline, s.output(5)
        time.sleep(0.05)
    logs = tmp_path / "logs"
    logs.mkdir()
    assert s.keep_logs(str(logs)) == [str(logs / "standby-inc3-proc5.log")]
    assert (logs / "standby-inc3-proc5.log").read_bytes() == b"warming up\n"
    s.go(5, str(tmp_path / "worker.log"), lambda p: open(p, "ab"))
    assert (tmp_path / "worker.log").read_bytes() == b"warming up\n"
    assert s.procs[5].wait(timeout=60) == 0
    s.release()
    assert os.listdir(tmp) == [] and s.tmp_logs == {}
