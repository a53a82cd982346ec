"""Replica groups across two network-namespace hosts (`jaxpar launch --nnodes 2 --groups 2`):
group 0 on host h0 with the leader, group 1 on h1, each a jax.distributed world of its own; the
group hub's traffic and the state transfer go over the bridge.

One job, in turn: group 1's process killed inside a step's average, its gradients held by the hub
(the step is released over group 0 alone; only group 1 restarts, on h1, and rejoins from group
0's state); h1 cut off the network (group 1 is dropped by the hang rule while group 0
trains on) and healed (group 1 is restarted by the leader's queued command and rejoins); h1
lost for good, its agent and workers killed (group 0 finishes alone, --min-groups 1). Group 0's
process runs throughout, and no step is trained twice. Where jaxpar[gloo] installs, the gradients
and the rejoining states go peer to peer between the hosts (no tensor byte through the hub), and
the bytes the leader's host sends and receives per step are counted.

Another job loses h0, the leader's host with the group hub: h1's agent stops its group and
exits 1 with nothing left running, and the same command lines resume the run from the newest
checkpoint to the end.

    python -m pytest tests/cluster -m netns
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from jaxpar.rundir.runlog import read_jsonl
from tests.support import gloo_peer
from tests.support.helpers import REPO, SMALL, cpu_env, events, losses

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS, KILL_AT = 90, 4
TIMEOUT = 900  # generous: a loaded 2-core machine


FAULTS = ["--fault", f"killavg@{KILL_AT}:process=1",  # group 1's process, on h1
          # group 0 paced throughout: group 1's shards of a step come first (the kill is
          # inside the average, which waits for group 0), and the partition and the rejoins
          # fit in the run
          "--fault", "slow@1:process=0:seconds=0.7"]  # fmt: skip


def _start(hosts, run_dir, tag: str, steps: int = STEPS, every: int = 20,
           faults: list[str] = FAULTS, site: str | None = None,
           ) -> tuple[list[subprocess.Popen], list]:  # fmt: skip
    """Both agents; with `site` (jaxpar[gloo]'s folder) on their workers' PYTHONPATH."""
    coordinator = f"{hosts.addr(0)}:29400"
    env = cpu_env(devices=None, cache=False)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), site])
    train = [sys.executable, "-m", "train", "--recipe", "gpt_tiny", "--no-progress", "--steps",
             str(steps), "--set", f"ckpt.every={every}", *SMALL]  # fmt: skip
    procs, logs = [], []
    for i in range(2):
        cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nnodes", "2", "--node-rank",
               str(i), "--coordinator", coordinator, "--nproc", "1", "--devices-per-proc", "2",
               "--groups", "2", "--min-groups", "1", "--hang-timeout", "10",
               "--run-dir", str(run_dir), *(faults if i == 0 else []), "--", *train]  # fmt: skip
        logs.append(run_dir.parent / f"{run_dir.name}.{tag}{i}.log")
        with open(logs[-1], "wb") as log:
            procs.append(hosts.popen(i, cmd, cwd=REPO, env=env, stdout=log,
                                     stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL))  # fmt: skip
    return procs, logs


def test_groups_across_hosts_survive_a_kill_a_partition_and_a_lost_host(hosts2, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t0 = time.time()
    site = gloo_peer.site_or_none()
    procs, logs = _start(hosts2, run_dir, "a", site=site)

    def out(i: int) -> str:
        return logs[i].read_text(errors="replace")[-5000:]

    def until(ok, what: str, agents=(0, 1)) -> None:
        deadline = time.time() + TIMEOUT
        while not ok():
            for i in agents:
                assert procs[i].poll() is None, f"{what}: agent {i} ended\n{out(0)}\n{out(1)}"
            assert time.time() < deadline, f"no {what} in {TIMEOUT}s:\n{out(0)}\n{out(1)}"
            time.sleep(0.2)

    def rejoined() -> list[dict]:
        return [e for e in events(run_dir, "group_joined") if e["transfer"]]

    def both_since(step: int) -> bool:  # a step after `step` that group 1 took part in
        lines = read_jsonl(str(run_dir / "metrics.jsonl"))
        return any(m.get("quorum") == [0, 1] and m["step"] > step for m in lines)

    try:
        until(lambda: len(rejoined()) == 1 and both_since(KILL_AT), "group 1 back after the kill")
        print(f"netns groups: killed and rejoined at {time.time() - t0:.0f}s")
        # the bytes the leader's host sends and receives per step, both groups training
        first, sent = max(losses(run_dir)), hosts2.traffic(0)
        until(lambda: max(losses(run_dir)) >= first + 5, "5 steps of both groups")
        last, now = max(losses(run_dir)), hosts2.traffic(0)
        per_step = [(b - a) / (last - first) for a, b in zip(sent, now, strict=True)]
        print(
            f"netns groups: the leader's host sent {per_step[0]:.0f} and received "
            f"{per_step[1]:.0f} bytes per step ({'peer to peer' if site else 'hub'})"
        )
        hosts2.cut(1)
        cut_at = max(losses(run_dir))
        until(lambda: any("hung" in e["why"] for e in events(run_dir, "group_failure")),
              "group 1 dropped while cut off")  # fmt: skip
        until(lambda: max(losses(run_dir)) >= cut_at + 5, "group 0 training alone")
        hosts2.heal(1)
        until(lambda: len(rejoined()) == 2, "group 1 rejoined after the partition")
        healed_at = rejoined()[-1]["step"]
        until(lambda: both_since(healed_at), "a step with group 1 back after the partition")
        print(f"netns groups: partitioned, healed and rejoined at {time.time() - t0:.0f}s")
        assert max(losses(run_dir)) < STEPS - 5, "the run finished before host 1 could be lost"
        killed = hosts2.kill_host(1)  # its agent and its workers at once
        assert len(killed) >= 2, killed
        procs[0].wait(timeout=TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"netns groups: host 1 lost, group 0 finished at {time.time() - t0:.0f}s")
    assert procs[0].returncode == 0, out(0)
    assert f"joined the leader at {hosts2.addr(0)}:29400" in out(1)
    started = events(run_dir, "group_started")
    # group 0 started once (its process ran throughout); group 1 three times, all on host 1
    assert [(e["group"], e.get("node", 0)) for e in started] == [(0, 0)] + [(1, 1)] * 3
    assert [e["group"] for e in events(run_dir, "group_restart")] == [1, 1]
    assert all(e["donor"] == 0 and e["group"] == 1 for e in rejoined())
    gone = [e for e in events(run_dir, "group_failure") if e.get("permanent")]
    assert [e["group"] for e in gone] == [1] and "node 1" in gone[0]["why"], gone
    lines = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if "quorum" in m]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))  # no step trained twice
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    quorum = {m["step"]: m["quorum"] for m in lines}
    # killed inside step KILL_AT's average: that step went on over group 0 alone
    assert "killavg" in [e["kind"] for e in events(run_dir, "fault_injected")]
    assert quorum[KILL_AT] == [0] and quorum[STEPS] == [0]
    # a group_joined event's step counts the steps done when the state was taken: the group
    # trains from the next one on
    assert quorum[healed_at + 1] == [0, 1], (healed_at, quorum)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["groups"]["group_restarts"] == 2
    if site is not None:  # across the hosts peer to peer, through the kill and the partition
        hub = summary["groups"]
        assert hub["hub_gradient_bytes"] == hub["hub_state_bytes"] == 0, hub
        assert hub["steps_peer_to_peer"] == STEPS and all(e["p2p"] for e in rejoined())
        assert 0 < min(per_step), per_step


def test_groups_leader_host_lost_fails_clearly_and_resumes(hosts2, tmp_path):
    """h0 lost with the leader and the group hub: the job cannot go on (the hub decides every
    step), h1's agent stops its group and exits 1, and the same command lines resume the run
    from the newest checkpoint."""
    steps, every = 30, 10
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    slow = ["--fault", "slow@1:process=0:seconds=0.3"]  # paced: the loss comes mid-run
    procs, logs = _start(hosts2, run_dir, "a", steps, every, slow)
    try:
        deadline = time.time() + TIMEOUT
        while (
            not (run_dir / "checkpoints" / str(every)).is_dir()
            or max(losses(run_dir) or [0]) < every + 2
        ):
            assert all(p.poll() is None for p in procs), logs[0].read_text(errors="replace")
            assert time.time() < deadline, logs[0].read_text(errors="replace")
            time.sleep(0.2)
        hosts2.kill_host(0)  # the leader (its hub) and group 0's worker at once
        assert procs[1].wait(timeout=120) == 1, logs[1].read_text(errors="replace")
        deadline = time.time() + 60
        while hosts2.pids(1) and time.time() < deadline:  # group 1's worker goes with its agent
            time.sleep(0.2)
        assert hosts2.pids(1) == []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "leader gone" in logs[1].read_text(errors="replace")
    done = max(losses(run_dir))
    assert done < steps
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    # h0 back: the same command lines resume from the newest checkpoint
    again, logs = _start(hosts2, run_dir, "b", steps, every, [])
    try:
        for p in again:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in again:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in again] == [0, 0], logs[0].read_text(errors="replace")
    restore = events(run_dir, "restore")[-1]
    # the newest persistent checkpoint, or the snapshot h1's group took as its agent stopped it
    if restore["tier"] == "persistent":
        assert restore["step"] == saved[-1], (restore, saved)
    else:
        assert restore["tier"] == "local" and saved[-1] <= restore["step"] <= done, restore
    resumed = [e for e in events(run_dir, "group_joined")][-2:]
    assert sorted((e["group"], e["step"], e["transfer"]) for e in resumed) == [
        (0, restore["step"], False), (1, restore["step"], False),
    ]  # fmt: skip
    assert sorted(losses(run_dir)) == list(range(1, steps + 1))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
