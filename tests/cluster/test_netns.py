"""`jaxpar launch` agents on two "hosts": Linux network namespaces h0 and h1 on a bridge.

    python -m pytest tests/cluster -m netns

Each host runs one agent (`--nnodes 2 --node-rank R --coordinator <h0's address>:29400`) and one
worker with 4 CPU devices (process 0 on h0, process 1 on h1: what crosses hosts is the point;
several workers under each of two agents are tests/supervisor/test_multinode.py's, on loopback);
jax.distributed, gloo and the agents' control channel go over the bridge (there is no shared
loopback between namespaces). Scenarios: the worker on host 1 killed (the whole job restarts);
host 1 lost, its agent and worker killed together (the job shrinks to host 0 and finishes); host
0 lost, with the leader and jax's coordinator (host 1's agent fails clearly, and the run
directory resumes where the checkpoints left it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support.helpers import REPO, SMALL, cpu_env, events, losses

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(1200)]

# 10 steps of 2 processes x 4 devices: the programs of tests/supervisor/test_supervisor.py's jobs,
# which the session's shared compiled-program tier then holds once for both modules
STEPS, EVERY = 10, 4
TIMEOUT = 900  # generous: a loaded 2-core machine
# Not jax's persistent compilation cache: it serves process 0 only, which then waits in gloo's
# first rendezvous (30 s) for peers still compiling on a loaded machine, and fails. jaxpar's
# shared compiled-program tier serves every process alike: what the first job of a layout
# compiled (one entry per process index, written by each of its processes as it compiled), the
# later jobs of the same layout load, here or in tests/supervisor/test_supervisor.py.


def agent_env() -> dict[str, str]:
    """The tests' XLA flags and jaxpar's shared compiled-program tier, without jax's cache."""
    env = cpu_env(devices=None)
    for name in [k for k in env if k.startswith("JAX_PERSISTENT_CACHE_")]:
        del env[name]
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


class Agents:
    """One `jaxpar launch` agent per host, output in RUN_DIR.<host>.log."""

    def __init__(self, hosts, run_dir, *train_args: str, launch_args=(), tag="a"):
        self.hosts, self.run_dir = hosts, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        coordinator = f"{hosts.addr(0)}:29400"
        self.logs = [run_dir.parent / f"{run_dir.name}.{tag}{i}.log" for i in range(hosts.n)]
        train = [sys.executable, "-m", "train", "--recipe", "gpt_tiny", "--no-progress",
                 "--steps", str(STEPS), "--set", f"ckpt.every={EVERY}", *SMALL, *train_args]  # fmt: skip
        self.procs = []
        for i in range(hosts.n):
            cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nnodes", str(hosts.n),
                   "--node-rank", str(i), "--coordinator", coordinator, "--nproc", "1",
                   "--devices-per-proc", "4", "--run-dir", str(run_dir), *launch_args, "--",
                   *train]  # fmt: skip
            with open(self.logs[i], "wb") as log:
                self.procs.append(hosts.popen(i, cmd, cwd=REPO, env=agent_env(),
                                              stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL))  # fmt: skip

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")[-5000:]

    def wait(self, i: int, timeout: float = TIMEOUT) -> int:
        try:
            return self.procs[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {i} still running after {timeout}s:\n"
                                 f"{self.output(0)}\n{self.output(1)}") from None  # fmt: skip

    def wait_for_step(self, step: int, timeout: float = TIMEOUT) -> None:
        deadline = time.time() + timeout
        while max(losses(self.run_dir), default=0) < step:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"agent {i} ended before step {step}:\n{self.output(i)}"
            assert time.time() < deadline, f"no step {step} in {timeout}s:\n{self.output(0)}"
            time.sleep(0.1)


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_worker_killed_on_host1_restarts_whole_job(hosts2, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.time()
    agents = Agents(hosts2, run_dir, "--fault", "kill@6:process=1")  # host 1's worker
    assert agents.wait(0) == 0, agents.output(0)
    assert agents.wait(1, 60) == 0, agents.output(1)
    print(f"netns: worker killed on host 1: {time.time() - t0:.0f}s")
    (f,) = events(run_dir, "failure")
    assert (f["cause"], f["process"], f["code"], f["step"]) == ("signal", 1, -9, 6)
    assert [s["nproc"] for s in events(run_dir, "start")] == [2, 2]
    assert events(run_dir, "restore")[0]["step"] == 4
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert summary(run_dir)["status"] == "completed"
    # the follower joined over the bridge, from its own host
    assert f"joined the leader at {hosts2.addr(0)}:29400" in agents.output(1)
    assert events(run_dir, "group_started")[0]["coordinator"].startswith(hosts2.addr(0) + ":")


def test_lost_host1_shrinks_to_host0_and_finishes(hosts2, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.time()
    agents = Agents(hosts2, run_dir)
    agents.wait_for_step(EVERY + 1)
    killed = hosts2.kill_host(1)  # the agent and its worker at once
    assert len(killed) >= 2, killed
    assert agents.wait(0) == 0, agents.output(0)
    print(f"netns: host 1 lost, shrink to host 0: {time.time() - t0:.0f}s")
    f = events(run_dir, "failure")[0]
    assert f["lost"] == [1] and "agent of node 1 lost" in f["detail"]
    (shrink,) = events(run_dir, "shrink")
    assert (shrink["from_nproc"], shrink["to_nproc"], shrink["lost"]) == (2, 1, [1])
    assert [s["nproc"] for s in events(run_dir, "start")][-1] == 1
    restore = events(run_dir, "restore")[-1]
    assert restore["step"] >= EVERY and restore["from_mesh"] != restore["to_mesh"]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert summary(run_dir)["status"] == "completed"
    assert hosts2.pids(1) == []


def test_lost_coordinator_host_fails_clearly_and_resumes(hosts2, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.time()
    agents = Agents(hosts2, run_dir)
    agents.wait_for_step(EVERY + 1)
    hosts2.kill_host(0)  # the leader and jax's coordinator (process 0, host 0's worker)
    assert agents.wait(1, 120) == 1, agents.output(1)
    assert "leader gone; stopping local workers" in agents.output(1)
    deadline = time.time() + 60
    while hosts2.pids(1) and time.time() < deadline:  # host 1's worker goes with its agent
        time.sleep(0.2)
    assert hosts2.pids(1) == []
    print(f"netns: host 0 lost, host 1 stops: {time.time() - t0:.0f}s")
    done = max(losses(run_dir))
    assert done < STEPS
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] >= EVERY
    # Host 0 is back: the same command lines resume from the newest checkpoint.
    again = Agents(hosts2, run_dir, tag="b")
    assert again.wait(0) == 0, again.output(0)
    assert again.wait(1, 60) == 0, again.output(1)
    print(f"netns: host 0 lost, resumed to the end: {time.time() - t0:.0f}s")
    restore = events(run_dir, "restore")[-1]
    # The newest persistent checkpoint, or a newer complete snapshot of host 1's local tier
    # (host 0's RAM survived here: only its processes were killed).
    if restore["tier"] == "persistent":
        assert restore["step"] == saved[-1]
    else:
        assert restore["tier"] == "local" and saved[-1] <= restore["step"] <= done
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert summary(run_dir)["status"] == "completed"
