"""Helpers for tests that run `jaxpar launch` with real worker processes on 127.0.0.1.

Every launch runs in its own session, bounded by a timeout; `close()` kills the supervisor and
every worker whose environment names the run directory (by PID), whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from jaxpar.rundir.runlog import read_jsonl
from jaxpar.worker.standby import dir_prefix
from tests.support import forkserver
from tests.support.helpers import SMALL, cpu_env, losses

REPO = Path(__file__).resolve().parents[2]


def train_cmd(steps: int, every: int, *extra: str, local_every: int = 0) -> list[str]:
    """gpt_tiny (SMALL); the local snapshot tier off unless `local_every` (the supervisor's
    tests count on restores from the persistent checkpoints)."""
    return [
        sys.executable, "-m", "train", "--recipe", "gpt_tiny", "--steps", str(steps),
        "--no-progress", "--set", f"ckpt.every={every}", "--set", f"ckpt.local_every={local_every}",
        *SMALL, *extra,
    ]  # fmt: skip


# A worker without jax that follows the worker contract: heartbeats via jaxpar.worker.bootstrap, metrics
# and events through jaxpar.rundir.writer.RunDir with the incarnation it is given, SIGUSR1 dumps its
# stack. Argv: MODE STEPS; modes: train, crash (process 1 exits 3 at step 2, once its peers wait
# there), hang (process 1 stops at step 3 in incarnation 0), usage (exit 2), nospace (process 1
# leaves an uncommitted save folder of step 2 and exits 46 there, like a save that hit ENOSPC).
FAKE_WORKER = """
import os, signal, sys, time
from jaxpar.worker import bootstrap
from jaxpar.rundir import runlog
from jaxpar.rundir.writer import RunDir

mode, steps = sys.argv[1], int(sys.argv[2])
run_dir = os.environ["JAXPAR_RUN_DIR"]
p, inc = int(os.environ["JAXPAR_PROCESS_ID"]), int(os.environ["JAXPAR_INCARNATION"])
run = RunDir(run_dir, p, inc)
bootstrap.install_stack_dump()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(bootstrap.EXIT_PREEMPTED))
if mode == "usage":
    sys.exit(2)
run.event("start", nproc=int(os.environ["JAXPAR_NUM_PROCESSES"]))

def stuck_here():
    while True:
        time.sleep(3600)

def collective(step, others=False):  # like an all-reduce: nobody passes step until all arrived
    n = int(os.environ["JAXPAR_NUM_PROCESSES"])
    peers = [q for q in range(n) if not (others and q == p)]
    while True:
        hbs = [bootstrap.read_heartbeat(f"{run_dir}/heartbeats/proc{q}.json") for q in peers]
        if all(h and h["incarnation"] == inc and h["step"] >= step for h in hbs):
            return
        time.sleep(0.01)

for step in range(steps):
    if mode == "crash" and p == 1 and step == 2:
        collective(step, others=True)  # dies where its peers wait for it: the same step each time
        sys.exit(3)
    if mode == "nospace" and p == 1 and step == 2:
        collective(step, others=True)
        tmp = f"{run_dir}/{runlog.CHECKPOINTS}/2{runlog.TMP_SUFFIX}"
        os.makedirs(f"{tmp}/state", exist_ok=True)
        with open(f"{tmp}/state/shard", "wb") as f:
            f.write(b"x" * 4096)
        sys.exit(bootstrap.EXIT_NO_SPACE)
    if mode == "hang" and p == 1 and step == 3 and inc == 0:
        stuck_here()
    bootstrap.heartbeat(run_dir, step)
    collective(step)
    time.sleep(float(os.environ.get("FAKE_STEP_S", "0.05")))
    run.metrics({"step": step + 1, "loss": 1.0 / (step + 1), "step_time_s": 0.05,
                 "tokens_per_s": 100.0, "time": time.time()})
run.event("done", step=steps)
"""


def fake_cmd(tmp_path: Path, mode: str, steps: int) -> list[str]:
    script = Path(tmp_path) / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return [sys.executable, str(script), mode, str(steps)]


def clean_env() -> dict[str, str]:
    """helpers.cpu_env without a device count (the supervisor gives each worker its devices): the
    tests' XLA flags, the session's local snapshot root and compiled-program caches (a job's
    first incarnation loads what another test's job compiled), and the checkout on PYTHONPATH."""
    env = cpu_env(devices=None)
    env["PYTHONPATH"] = str(REPO)
    return env


class Launch:
    """`jaxpar launch ARGS -- COMMAND` in the background."""

    def __init__(
        self, run_dir: Path, args: list[str], command: list[str], env=None, name="launch",
        log_dir: Path | None = None,
    ):  # fmt: skip
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = Path(log_dir or self.run_dir.parent) / f"{self.run_dir.name}.{name}.log"
        cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--run-dir", str(run_dir), *args]
        # forked from the tests' pool (tests/support/forkserver.py) where it can be: a
        # supervisor that holds jax's imports forks its own spare pool too
        env = env or clean_env()
        self.log.write_bytes(b"")
        self.proc = forkserver.start([*cmd, "--", *command], env, str(self.log), REPO)
        if self.proc is None:
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    [*cmd, "--", *command], cwd=REPO, env=env, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            msg = f"jaxpar launch timed out after {timeout}s:\n{self.output()}"
            raise AssertionError(msg) from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        kill_workers(self.run_dir)

    def events(self, name: str | None = None) -> list[dict]:
        evs = read_jsonl(str(self.run_dir / "events.jsonl"))
        return [e for e in evs if name is None or e["event"] == name]

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def wait_for_step(self, step: int, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if max(losses(self.run_dir), default=0) >= step:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"launch ended before step {step}:\n{self.output()}")
            time.sleep(0.1)
        raise AssertionError(f"step {step} not reached in {timeout}s:\n{self.output()}")

    def worker_pid(self, process: int) -> int:
        hb = json.loads((self.run_dir / "heartbeats" / f"proc{process}.json").read_text())
        return int(hb["pid"])


def nonfinite_checkpoints(run_dir: Path) -> dict[int, int]:
    """Committed checkpoint step -> how many arrays of its saved state (parameters, optimizer
    state, ...) hold a NaN or an infinity (read as numpy arrays: no devices, no target)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    out = {}
    for step in sorted(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir()
                       if p.name.isdigit()):  # fmt: skip
        path = Path(run_dir) / "checkpoints" / str(step) / "state"
        reader = ocp.PyTreeCheckpointer()
        tree = reader.metadata(path).item_metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        leaves = jax.tree.leaves(reader.restore(path, restore_args=args))
        out[step] = sum(1 for x in leaves if x.dtype.kind not in "biu" and not np.isfinite(x).all())
    return out


def run_processes(run_dir: Path, standby: bool = False) -> list[psutil.Process]:
    """The live processes of a job (its workers, spares, standbys, pools): those started with
    JAXPAR_RUN_DIR=run_dir in their environment, or whose stdout or stderr is a file under
    run_dir or a standby's output (a process forked from a pool keeps the pool's start-up
    environment in /proc but writes to its own log). `standby`: its waiting standby workers
    only (their output still in the standby directory)."""
    target, out = os.path.abspath(run_dir), []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            writes = _writes(p.pid)
            waiting = any(os.sep + dir_prefix(target) in link for link in writes)
            if standby:
                if waiting:
                    out.append(p)
            elif (
                waiting
                or p.environ().get("JAXPAR_RUN_DIR") == target
                or any(link.startswith(target + os.sep) for link in writes)
            ):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _writes(pid: int) -> list[str]:
    """What `pid`'s stdout and stderr are (the paths of their files)."""
    links = []
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return links


def kill_workers(run_dir: Path) -> list[int]:
    """SIGKILL every process of the job in `run_dir` (run_processes); returns their PIDs."""
    killed = []
    for p in run_processes(run_dir):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
            killed.append(p.pid)
    return killed
