"""`jaxpar launch --standby` leaves no standby process behind on any exit path: a normal finish,
a crash-loop stop, and the supervisor stopped by SIGTERM. One process x 2 CPU devices, small
gpt_tiny (the standby group's processes are started, and released, one by one however many
there are: tests/recovery/test_local_resume_2proc.py's standby group of 2 takes over a job);
every test waits until the standby group is running, then ends the job its way and checks that
every process the supervisor ever started is gone.

    python -m pytest tests/supervisor/test_standby_teardown.py -m slow
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.support.launch_util import Launch, run_processes, train_cmd  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WAIT = 600
# Up to 21 steps the learning rate decays over max(steps, warmup + 1) = 21: every job here runs
# one program, compiled by the first and loaded by the others
STEPS = 21
NPROC = 1
ARGS = ["--nproc", str(NPROC), "--devices-per-proc", "2", "--standby"]


def _descendants(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _wait_for_standby(run: Launch, timeout: float = WAIT) -> set[int]:
    """Every process of the job once its standby group (NPROC processes) runs."""
    deadline = time.time() + timeout
    seen: set[int] = set()
    while time.time() < deadline:
        seen |= _descendants(run.proc.pid)
        standby = [p.pid for p in run_processes(run.run_dir, standby=True)]
        if len(standby) == NPROC:
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
        # forked from the host's spare pool, as the group's workers are (imports paid once)
        standby = run_processes(run.run_dir, standby=True)
        assert {p.parent().cmdline()[-1] for p in standby} == {"--pool"}, standby
        assert run.wait(WAIT) == 0, run.output()
        assert not _gone(pids), f"still running after the job finished: {_gone(pids)}"
    finally:
        run.close()


def test_crash_loop_stop_releases_the_standby_group(tmp_path):
    # --crash-loop 1: the first failure stops the job (the same path as a crash loop)
    # paced at 2 s a step from step 2: running for 38 s, long after its standby group is ready
    run = _run(tmp_path, ["--crash-loop", "1"], STEPS, ["slow@2:process=0:seconds=2"])
    try:
        pids = _wait_for_standby(run)
        run.wait_for_step(1, WAIT)  # its heartbeat names the worker's pid
        os.kill(run.worker_pid(0), signal.SIGKILL)
        assert run.wait(WAIT) == 1, run.output()
        (gave_up,) = run.events("gave_up")
        assert "crash loop" in gave_up["reason"], gave_up
        assert not _gone(pids), f"still running after the crash-loop stop: {_gone(pids)}"
    finally:
        run.close()


def test_supervisor_sigterm_releases_the_standby_group(tmp_path):
    run = _run(tmp_path, [], STEPS, ["slow@2:process=0:seconds=2"])  # as above
    try:
        pids = _wait_for_standby(run)
        run.proc.send_signal(signal.SIGTERM)  # preemption: the workers save, the job stops
        assert run.wait(WAIT) == 42, run.output()
        assert not _gone(pids), f"still running after SIGTERM: {_gone(pids)}"
    finally:
        run.close()


def test_a_standby_workers_output_leaves_no_file_behind(tmp_path, monkeypatch):
    """Its channels and its output before "go" are in a temporary directory of its own, emptied
    and removed once it is ready (it holds them open): the output is copied into the worker's
    log on "go" and into logs/ when kept, and nothing is left even if the supervisor is then
    killed (no cleanup runs)."""
    import sys
    import tempfile

    from jaxpar.supervisor.standby_group import Standby

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    s = Standby({"incarnation": 3}, str(tmp_path / "run"))
    code = ("from jaxpar.worker import standby; print('warming up', flush=True); "
            "standby.wait_for_go(); print('went', flush=True)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAR_")}
    s.spawn(5, [sys.executable, "-c", code], env)
    (made,) = os.listdir(tmp)
    assert made.startswith("jaxpar-standby-")
    deadline = time.time() + 60
    while not s.ready():
        assert time.time() < deadline and not s.failed(), s.output(5)
        time.sleep(0.05)
    assert os.listdir(tmp) == []
    assert s.output(5) == b"warming up\n"
    logs = tmp_path / "logs"
    logs.mkdir()
    assert s.keep_logs(str(logs)) == [str(logs / "standby-inc3-proc5.log")]
    assert (logs / "standby-inc3-proc5.log").read_bytes() == b"warming up\n"
    s.go(5, str(tmp_path / "worker.log"), lambda p: open(p, "ab"))
    assert s.procs[5].wait(timeout=60) == 0
    assert (tmp_path / "worker.log").read_bytes() == b"warming up\nwent\n"
    s.release()
    assert os.listdir(tmp) == [] and s.tmp_logs == {}
