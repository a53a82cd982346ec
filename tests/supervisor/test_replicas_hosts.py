"""Replica groups on two `jaxpar launch` agents of this machine (`--nnodes 2 --groups 2`): each
host runs one group, the leader's supervisor decides for both, and the groups' layouts differ
(node 0's mesh is data=2, node 1's tensor=2: with jaxpar[gloo] installed, the steps both groups
take part in are averaged through the hub, resharded, the others peer to peer). Group 1's process (on node 1) killed: only group 1
restarts, on node 1, through that agent, and rejoins from group 0's state, resharded; node 1's
agent (--standby) builds a standby group for it, and a second kill restarts group 1 from there;
then node 1 is lost (its agent and workers killed at once): group 0 trains on alone
(--min-groups 1) to the last step, group 0's process started once throughout.

    python -m pytest tests/supervisor/test_replicas_hosts.py -m slow
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

import pytest

from jaxpar.rundir.runlog import read_jsonl
from tests.support import gloo_peer
from tests.support.launch_util import Launch, losses, train_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# up to 21 steps: the learning rate decays over max(steps, warmup + 1) = 21; group 0 (one process
# x 2 devices, data=2) has the layout and schedule of tests/supervisor/test_replicas.py's groups,
# whose programs the session's cache may hold
STEPS, KILL_AT = 21, 4
WAIT = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [m for m in read_jsonl(str(path)) if "quorum" in m] if path.exists() else []


def _until(ok, what: str, *runs: Launch) -> None:
    deadline = time.time() + WAIT
    while not ok():
        for run in runs:
            assert run.proc.poll() is None, f"{what}: an agent ended\n{run.output()}"
        assert time.time() < deadline, f"no {what} in {WAIT}s:\n{runs[0].output()}"
        time.sleep(0.2)


def test_groups_on_two_hosts_restart_alone_and_survive_a_lost_host(tmp_path):
    common = ["--nproc", "1", "--devices-per-proc", "2", "--nnodes", "2", "--groups", "2",
              "--coordinator", f"127.0.0.1:{_free_port()}"]  # fmt: skip
    faults = ["--fault", f"kill@{KILL_AT}:process=1",  # group 1, on node 1
              # group 0 slowed after the kill: group 1 rejoins long before the last step (the
              # 16 steps left take 40 s)
              "--fault", f"slow@{KILL_AT + 1}:process=0:seconds=2.5"]  # fmt: skip
    cmd = train_cmd(STEPS, 4)
    run_dir = tmp_path / "run"
    env, p2p = gloo_peer.launch_env()
    leader = Launch(run_dir, [*common, "--node-rank", "0", "--min-groups", "1", *faults], cmd,
                    name="node0", env=env)  # fmt: skip
    follower = Launch(
        run_dir,
        [*common, "--node-rank", "1", "--min-groups", "1", "--standby"],
        train_cmd(STEPS, 4, "--mesh", "tensor=2"),
        name="node1",
        env=env,
    )  # another layout
    try:
        # group 1 killed on node 1, restarted there, back in the quorum
        _until(lambda: any(m.get("quorum") == [0, 1] for m in _lines(run_dir)[KILL_AT:]),
               "a step with group 1 back", leader, follower)  # fmt: skip
        started = leader.events("group_started")
        assert [(e["group"], e.get("node", 0)) for e in started] == [(0, 0), (1, 1), (1, 1)]
        # node 1's agent builds group 1's standby group once the hub has admitted it; a kill
        # then restarts group 1 from it
        _until(lambda: any(e["group"] == 1 and e["node"] == 1
                           for e in leader.events("group_standby_ready")),
               "group 1's standby group on node 1", leader, follower)  # fmt: skip
        os.kill(started[-1]["pids"][0], signal.SIGKILL)
        _until(lambda: len([e for e in leader.events("group_joined") if e["transfer"]]) == 2,
               "group 1 back from its standby group", leader, follower)  # fmt: skip
        started = leader.events("group_started")
        assert [(e["group"], e.get("node", 0), e["path"]) for e in started][3:] == [
            (1, 1, "standby")
        ]  # fmt: skip
        assert max(losses(run_dir)) < STEPS - 3, "the run finished before node 1 could be lost"
        node1 = started[-1]["pids"]
        # node 1 lost: its agent and its workers at once
        os.killpg(follower.proc.pid, signal.SIGKILL)
        for pid in node1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert leader.wait(WAIT) == 0, leader.output()
    finally:
        leader.close()
        follower.close()
    assert "joined the leader" in follower.output()
    assert [e["group"] for e in leader.events("group_restart")] == [1, 1]
    joined = [e for e in leader.events("group_joined") if e["transfer"]]
    assert [(e["group"], e["donor"], e["resharded"]) for e in joined] == [(1, 0, True)] * 2
    gone = [e for e in leader.events("group_failure") if e.get("permanent")]
    assert [e["group"] for e in gone] == [1] and "node 1" in gone[0]["why"], gone
    # group 0 was started once and trained every step; group 1 never again after its host
    assert [e["group"] for e in leader.events("group_started")] == [0, 1, 1, 1]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    lines = _lines(run_dir)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))  # no step rewound
    assert lines[KILL_AT - 1]["quorum"] == [0] and lines[-1]["quorum"] == [0]
    assert any(m["quorum"] == [0, 1] for m in lines[KILL_AT:]), lines
    assert leader.summary()["status"] == "completed"
    if p2p:  # different layouts: the hub path for the steps of both groups, and said so
        assert "through the group hub: the groups' layouts differ" in leader.log.read_text()
        groups = leader.summary()["groups"]
        assert groups["hub_gradient_bytes"] > 0 and groups["hub_state_bytes"] > 0, groups
        assert 0 < groups["steps_peer_to_peer"] < STEPS, groups  # group 0 alone: peer to peer
