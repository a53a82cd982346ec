"""Replica groups on several hosts without jax (jaxpar/supervisor/group_hosts.py): which layouts
`--nnodes N --groups R` accepts, the group key each agent derives (never sent), what an agent
refuses from a start message, and how the leader reads an agent's reports of its groups."""

from __future__ import annotations

import queue
import socket
import subprocess
import sys

import pytest

from jaxpar.supervisor.group_hosts import (
    FollowerGroups,
    RemoteGroup,
    RemoteHost,
    check_group_spec,
    group_key,
)
from jaxpar.supervisor.options import Options
from jaxpar.supervisor.replicas import check_groups
from tests.support.launch_util import clean_env

NONCE = "ab" * 16


def _opts(tmp_path, **kw) -> Options:
    base = {"command": [sys.executable, "-c", "pass"], "nproc": 2,
            "run_dir": str(tmp_path / "run")}  # fmt: skip
    return Options(**{**base, **kw})


def _spec(**kw) -> dict:
    spec = {"incarnation": 0, "coordinator": "", "bind": "", "nproc": 2, "process_ids": [2, 3],
            "attempt": 0, "collective_timeout": 60.0, "group": 1, "groups": 2,
            "hub": "10.0.0.1:4000", "group_nonce": NONCE, "tidy": False}  # fmt: skip
    return {**spec, **kw}


def test_groups_on_several_hosts_must_be_whole_groups_per_host(tmp_path):
    check_groups(_opts(tmp_path, nnodes=2, groups=2, min_groups=2))
    check_groups(_opts(tmp_path, nnodes=2, groups=4, min_groups=3))  # 2 groups of 1 per host
    with pytest.raises(ValueError, match=r"--groups 3 is not a multiple of --nnodes 2"):
        check_groups(_opts(tmp_path, nnodes=2, groups=3, min_groups=2))
    with pytest.raises(ValueError, match=r"--nproc 3 is not divisible .* 2 groups per host"):
        check_groups(_opts(tmp_path, nproc=3, nnodes=2, groups=4, min_groups=3))


def test_the_group_key_is_derived_from_the_token_and_the_nonce():
    key = group_key(b"t" * 32, NONCE)
    assert key == group_key(b"t" * 32, NONCE) and len(key) == 32
    assert key != group_key(b"u" * 32, NONCE)  # another job's agents
    assert key != group_key(b"t" * 32, "cd" * 16)  # another start of the job
    assert b"t" * 32 not in key


def test_an_agent_refuses_start_messages_not_for_its_own_groups(tmp_path):
    assert check_group_spec(_spec(), nnodes=2, node_rank=1) == 1
    bad = {
        "this host's groups": _spec(group=0),  # node 0's group
        "multiple of 2": _spec(groups=3),
        "32 hex digits": _spec(group_nonce="../../etc"),
        "'hub'": _spec(hub=""),
        "'tidy'": _spec(tidy="yes"),
        "'nproc' processes": _spec(process_ids=[2]),
    }
    for why, spec in bad.items():
        with pytest.raises(ValueError, match=why):
            check_group_spec(spec, nnodes=2, node_rank=1)
    agent = FollowerGroups(_opts(tmp_path, nnodes=2, node_rank=1, devices_per_proc=2), None,
                           b"t" * 32)  # fmt: skip
    with pytest.raises(ValueError, match="not this host's"):
        agent.start(_spec(process_ids=[0, 1]))  # node 0's processes
    with pytest.raises(ValueError, match="no group"):
        agent.stop(1, 0.0)  # never started here
    with pytest.raises(ValueError, match="no group"):
        agent.stepping(1, 0)
    assert agent.groups == {}


class _Chan:
    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.sent: list[dict] = []
        self.error = ""

    def messages(self):
        out = []
        while not self.inbox.empty():
            out.append(self.inbox.get())
        return out

    def send(self, msg):
        self.sent.append(msg)


class _Node:
    def __init__(self):
        self.chan, self.rank = _Chan(), 1


def test_the_leader_reads_exits_and_starts_of_the_current_attempt_only():
    events: list = []
    host = RemoteHost(_Node(), lambda name, **f: events.append({"event": name, **f}))
    grp = RemoteGroup(host, 1)
    grp.start(_spec(attempt=3))
    assert host.node.chan.sent[-1]["cmd"] == "start" and grp.alive() == [2, 3]
    grp.mark_stepping()  # admitted by the hub: the agent may build its standby, told once
    grp.mark_stepping()
    assert [m for m in host.node.chan.sent if m["cmd"] == "stepping"] == [
        {"cmd": "stepping", "group": 1, "attempt": 3}
    ]  # fmt: skip
    for msg in (
        {
            "group": 1,
            "attempt": 3,
            "started": True,
            "pids": [41, 42],
            "path": "standby",
            "incarnation": 9,
        },
        {"group": 1, "attempt": 3, "standby_ready": True},
        {"group": 1, "attempt": 2, "exit": 2, "code": -9},  # a stopped start's
        {"group": 1, "attempt": 3, "exit": 7, "code": -9},  # not one of its processes
        {"group": 0, "attempt": 3, "exit": 2, "code": -9},  # another group's
        {"group": 1, "attempt": 3, "exit": 2, "code": -9},
    ):
        host.node.chan.inbox.put(msg)
    assert grp.poll() == [(2, -9)] and grp.alive() == [3] and not grp.finished()
    started, standby = events
    assert started["group"] == 1 and started["node"] == 1 and started["pids"] == [41, 42]
    assert started["path"] == "standby" and grp.spec["incarnation"] == 9  # the standby's own
    assert standby == {"event": "group_standby_ready", "group": 1, "node": 1}
    host.node.chan.inbox.put({"group": 1, "attempt": 3, "exit": 3, "code": 0})
    assert grp.poll() == [(3, 0)] and grp.alive() == []
    host.node.chan.inbox.put({"group": 1, "attempt": 3, "refused": "no\x1b[2J layout"})
    grp.poll()
    assert grp.refused == "no\\x1b[2J layout"  # the agent's line, its escapes shown, not run
    grp.stop(0.0)  # stopped on purpose: its later exits are not reported
    assert host.node.chan.sent[-1] == {"cmd": "stop", "grace_s": 0.0, "group": 1}
    host.node.chan.inbox.put(None)  # the agent's channel lost: its host with it
    assert grp.node_lost() and grp.alive() == []


# A group's worker without jax: it tells the hub it holds a state of one leaf whose length
# depends on its group (2 + group), as a host training another model would.
OTHER_MODEL = """
import os, socket, time
import numpy as np
from jaxpar.worker import group_layout, group_wire
env = group_wire.group_env()
host, _, port = env["hub"].rpartition(":")
sock = socket.create_connection((host.strip("[]"), int(port)), timeout=60)
wire = group_wire.client_handshake(sock, env["key"], {"group": env["group"], "rank": 0})
state = [np.zeros(2 + env["group"], np.float32)]
wire.send({"kind": "ready", "step": 0, **group_layout.whole(state, send=False)})
wire.recv()
time.sleep(60)
"""


def test_hosts_of_different_layouts_run_but_another_model_ends_the_job_with_one_line(tmp_path):
    """Agents may differ in --devices-per-proc (groups of different layouts average through the
    hub), but a group holding another state than the others' can never take part: the leader
    ends the job with one line naming the fix (exit 2), and the other agent leaves too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    common = ["launch", "--nproc", "1", "--nnodes", "2", "--groups", "2", "--min-groups", "1",
              "--coordinator", f"127.0.0.1:{port}", "--run-dir", str(run_dir), "--no-spares"]  # fmt: skip
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxpar.cli",
                *common,
                "--node-rank",
                str(i),
                "--devices-per-proc",
                str(i + 1),
                "--",
                sys.executable,
                "-c",
                OTHER_MODEL,
            ],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        out, _ = agents[0].communicate(timeout=120)
        assert agents[0].returncode == 2, out
        assert "holds another state than the job's (leaf 0 is float32[" in out, out
        assert "same model and optimizer" in out and "refused" not in out, out
        assert agents[1].wait(timeout=60) == 2
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
