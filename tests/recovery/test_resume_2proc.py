"""Two processes x 2 CPU devices under jax.distributed (gloo): exact resume after a real SIGKILL
of one worker, a coordinated preemption save after SIGTERM to one worker, and the replica check
catching one process's diverged parameters. The model is helpers.SMALL (gpt_tiny made smaller: the
point is the processes, not the model); a `slow` fault on process 0 paces both workers at one step
every STRAGGLE_S seconds from the step where a signal is sent, so that it lands between two saves.
Runs are STEPS = 10 steps with a save every 5: a signal after the first save, a restore, a save
after it and steps on both sides of each (more steps would only repeat them). Two devices per
process: the point is the processes (2 x 4 devices cost about 1.5x the CPU). The SIGKILL and the
SIGTERM are sent in two runs of one run directory, the second resumed from the first's
checkpoint, the third from the second's.

Workers are forked from the tests' preloaded pool (tests/support/forkserver.py) with the
environment `jaxpar launch` gives them (JAXPAR_COORDINATOR,
JAXPAR_NUM_PROCESSES, JAXPAR_PROCESS_ID, JAXPAR_DEVICES_PER_PROC; XLA_FLAGS sets no device
count), each in its own process group, and are always killed by group at the end.

    python -m pytest tests/recovery/test_resume_2proc.py -m slow
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.rundir.runlog import read_jsonl
from jaxpar.worker.bootstrap import EXIT_PREEMPTED
from tests.support import forkserver
from tests.support.helpers import SMALL, assert_exact, cpu_env, events, losses

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXIT_REPLICA = 45  # train/__main__.py
STRAGGLE_S = 2.0  # process 0 sleeps this long before every step from the `slow` fault's step
STEPS, EVERY = 10, 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """Two `python -m train` workers of one 2-process job (SMALL gpt_tiny, STEPS steps, saves
    every EVERY)."""

    def __init__(self, run_dir: Path, *args: str, faults=()):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cmd = [sys.executable, "-m", "train", "--steps", str(STEPS), "--run-dir", str(run_dir)]
        cmd += ["--no-progress", "--set", f"ckpt.every={EVERY}", "--set", "ckpt.local_every=0"]
        cmd += [*SMALL, *args]
        for f in faults:
            cmd += ["--fault", f]
        self.procs, self.logs = [], []
        for i in range(2):
            env = cpu_env(devices=None)  # the tests' flags and the session's compile caches
            env.update(
                JAXPAR_COORDINATOR=f"127.0.0.1:{port}",
                JAXPAR_NUM_PROCESSES="2", JAXPAR_PROCESS_ID=str(i), JAXPAR_DEVICES_PER_PROC="2",
                JAXPAR_HEARTBEAT_TIMEOUT_S="10",
            )  # fmt: skip
            log = open(run_dir.parent / f"{run_dir.name}.p{i}.{time.time():.0f}.log", "w")
            self.logs.append(log)
            # forked from the tests' preloaded pool, as `jaxpar launch` forks its workers
            proc = forkserver.start(cmd, env, log.name, REPO)
            out = {"stdout": log, "stderr": subprocess.STDOUT}
            proc = proc or subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, **out)
            self.procs.append(proc)

    def wait(self, timeout: float = 600) -> list[int]:
        deadline = time.time() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.time())) for p in self.procs]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"2-process run timed out:\n{self.tail()}") from None
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in self.logs:
            log.close()

    def tail(self) -> str:
        out = []
        for log in self.logs:
            log.flush()
            with open(log.name) as f:
                out.append(f"--- {log.name}\n" + f.read()[-3000:])
        return "\n".join(out)

    def wait_for(self, cond, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while not cond():
            if time.time() > deadline or any(p.poll() is not None for p in self.procs):
                self.kill()
                raise AssertionError(f"condition not reached:\n{self.tail()}")
            time.sleep(0.2)


def committed(run_dir) -> list[int]:
    path = f"{run_dir}/checkpoints"
    return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def run_pair(run_dir, *args, faults=(), expect=(0, 0)) -> None:
    pair = Pair(run_dir, *args, faults=faults)
    codes = pair.wait()
    assert tuple(codes) == tuple(expect), f"exit codes {codes}:\n{pair.tail()}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref2") / "run"
    run_pair(run_dir)
    ref = losses(run_dir)
    assert sorted(ref) == list(range(1, STEPS + 1)) and committed(run_dir) == [EVERY, STEPS]
    (start,) = events(run_dir, "start")
    assert start["nproc"] == 2
    return ref


def logged(run_dir, incarnation: int) -> dict[int, float]:
    """step -> loss of the metrics lines one incarnation logged."""
    lines = read_jsonl(f"{run_dir}/metrics.jsonl")
    return {m["step"]: m["loss"] for m in lines if "loss" in m and m["incarnation"] == incarnation}


def test_sigkill_then_sigterm_to_one_worker_resume_exactly(reference, tmp_path):
    """One run directory, three runs of the job: a real SIGKILL of worker 1 between saves (the
    survivor fails; the rerun restores the last save), then a SIGTERM to worker 1 only (both
    save the same step and exit preempted; the rerun restores that step). Every line each
    incarnation logged equals the uninterrupted run's."""
    run_dir = tmp_path / "run"
    # paced from step EVERY + 2 in both faulted runs (`repeat`: in every incarnation)
    slow = [f"slow@{EVERY + 2}:process=0:seconds={STRAGGLE_S}:repeat"]
    pair = Pair(run_dir, faults=slow)
    pair.wait_for(lambda: committed(run_dir) == [EVERY] and max(losses(run_dir) or [0]) > EVERY)
    os.kill(pair.procs[1].pid, signal.SIGKILL)  # a real kill -9 of worker 1, between saves
    try:
        pair.procs[0].wait(timeout=90)  # fate sharing: the coordination service aborts it
    except subprocess.TimeoutExpired:
        pass
    survivor = pair.procs[0].poll()
    pair.kill()
    assert survivor not in (None, 0), f"the survivor should have failed:\n{pair.tail()}"
    killed_at = max(losses(run_dir))
    assert EVERY < killed_at < STEPS and committed(run_dir) == [EVERY]

    pair = Pair(run_dir, faults=slow)
    pair.wait_for(lambda: max(logged(run_dir, 1) or [0]) > EVERY)
    (restore,) = events(run_dir, "restore", 1)
    assert (restore["step"], restore["from_nproc"], restore["to_nproc"]) == (EVERY, 2, 2)
    os.kill(pair.procs[1].pid, signal.SIGTERM)  # the preemption notice, to worker 1 only
    codes = pair.wait()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], f"{codes}:\n{pair.tail()}"
    pre = events(run_dir, "preempted")
    assert sorted(e["process"] for e in pre) == [0, 1]
    (step,) = {e["step"] for e in pre}
    assert EVERY < step < STEPS and step in committed(run_dir)

    run_pair(run_dir)
    assert events(run_dir, "restore", 2)[0]["step"] == step
    for inc in (1, 2):  # each restore trained on exactly
        got = logged(run_dir, inc)
        assert min(got) == (EVERY, step)[inc - 1] + 1
        assert got == {s: reference[s] for s in got}, f"incarnation {inc}: {got}"
    assert_exact(run_dir, reference)


def test_diverged_replica_on_one_process_is_reported(tmp_path):
    run_dir = tmp_path / "run"
    diverge = f"diverge@{EVERY - 1}:process=1"  # caught by the save after it
    run_pair(run_dir, faults=[diverge], expect=(EXIT_REPLICA, EXIT_REPLICA))
    (fired,) = events(run_dir, "fault_injected")
    assert (fired["kind"], fired["process"], fired["step"]) == ("diverge", 1, EVERY - 1)
    (bad,) = events(run_dir, "replica_mismatch")
    assert (bad["when"], bad["step"]) == ("save", EVERY)
    assert EVERY not in committed(run_dir)
