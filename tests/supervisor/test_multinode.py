"""Two `jaxpar launch` agents on this machine (`--nnodes 2`), 2 workers x 1 CPU device each (two
workers per agent: the second node's processes are 2 and 3, its second slot process 3): a worker
killed on the second "host" restarts the whole job, which completes.

    python -m pytest tests/supervisor/test_multinode.py -m slow
"""

from __future__ import annotations

import socket

import pytest

from tests.support.launch_util import Launch, losses, train_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, EVERY = 8, 4  # the kill at 6 after the save at 4: steps 5 and 6 run twice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_kill_on_second_node_restarts_whole_job(tmp_path):
    coordinator = f"127.0.0.1:{_free_port()}"
    common = ["--nproc", "2", "--devices-per-proc", "1", "--nnodes", "2"]
    common += ["--coordinator", coordinator]
    cmd = train_cmd(STEPS, EVERY)
    run_dir = tmp_path / "run"
    # process 3 is the second worker of node 1: the leader passes the fault to that agent
    leader = Launch(run_dir, [*common, "--node-rank", "0", "--fault", "kill@6:process=3"], cmd,
                    name="node0")  # fmt: skip
    follower = Launch(run_dir, [*common, "--node-rank", "1"], cmd, name="node1")
    try:
        assert leader.wait(600) == 0, leader.output()
        assert follower.wait(60) == 0, follower.output()
    finally:
        leader.close()
        follower.close()
    (f,) = leader.events("failure")
    assert (f["cause"], f["process"], f["code"], f["step"]) == ("signal", 3, -9, 6)
    assert len(leader.events("restart")) == 1
    assert [s["nproc"] for s in leader.events("start")] == [4, 4]
    assert len(leader.events("group_started")) == 2
    # both hosts' workers ran again in the new incarnation
    for p in range(4):
        assert (run_dir / "logs" / f"inc1-group1-proc{p}.log").exists(), p
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert leader.summary()["status"] == "completed"
    assert "joined the leader" in follower.output()
