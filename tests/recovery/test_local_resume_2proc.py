"""The local snapshot tier under `jaxpar launch`, 2 processes x 2 CPU devices (smaller gpt_tiny):
a worker SIGKILLed mid-run is restarted from the newest snapshot every process holds, and two
"nodes" (two agents on this machine, each with its own local tier directory) survive the loss of
one whole node — agent, workers and RAM — from the peer copy on the other node, and leave nothing
in either node's RAM once the job completes. Losses must equal an uninterrupted run of the same
layout exactly.

    python -m pytest tests/recovery/test_local_resume_2proc.py -m slow
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from jaxpar.recovery import local_tier  # noqa: E402
from tests.support.helpers import assert_exact  # noqa: E402
from tests.support.launch_util import Launch, clean_env, losses, run_processes, train_cmd  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# persistent saves only at the end: restores must come from RAM; every fault (at 7 or 8) has
# steps after it (more would only repeat them)
STEPS, EVERY = 10, 100
WAIT = 600


def _cmd():
    return train_cmd(STEPS, EVERY, local_every=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = Launch(tmp_path_factory.mktemp("local2") / "ref", ["--nproc", "2", "--devices-per-proc",
                 "2"], _cmd())  # fmt: skip
    try:
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    ref = losses(run.run_dir)
    assert sorted(ref) == list(range(1, STEPS + 1))
    return ref


def test_worker_killed_restores_from_local_tier(reference, tmp_path):
    run = Launch(tmp_path / "run", ["--nproc", "2", "--devices-per-proc", "2",
                                    "--fault", "kill@7:process=1"], _cmd())  # fmt: skip
    try:
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    (restore,) = run.events("restore")
    # from RAM (no persistent save before step 100), a step before the kill: which one depends
    # on how far the snapshot writer had got on a loaded machine (5 or 6 when idle, 4 seen)
    assert restore["tier"] == "local" and 1 <= restore["step"] < 7, restore
    assert restore["incarnation"] == 1
    # the restarted group came up from the spares, its programs loaded from the compile cache
    restarted = [e for e in run.events() if e.get("incarnation", 0) > 0]
    assert [e.get("warm") for e in restarted if e["event"] == "start"] == [True], restarted
    assert sum(e.get("hits", 0) for e in restarted if e["event"] == "compiled") >= 2, restarted
    assert_exact(run.run_dir, reference)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(run_dir: Path, roots: list[Path], faults: list[str]) -> list[Launch]:
    # no spares: neither job restarts a group (the first dies with its host, the second finishes)
    common = ["--nproc", "1", "--devices-per-proc", "2", "--nnodes", "2", "--no-spares",
              "--coordinator", f"127.0.0.1:{_port()}"]  # fmt: skip
    agents = []
    for rank, root in enumerate(roots):
        env = clean_env()
        env["JAXPAR_LOCAL_DIR"] = str(root)  # this "host"'s RAM
        args = [*common, "--node-rank", str(rank), *(faults if rank == 0 else [])]
        agents.append(Launch(run_dir, args, _cmd(), env=env, name=f"node{rank}-{len(faults)}"))
    return agents


def test_lost_host_restores_from_peer_copy(reference, tmp_path):
    run_dir = tmp_path / "run"
    roots = [tmp_path / "ram0", tmp_path / "ram1"]
    node0 = local_tier.node_dir(str(roots[0]), str(run_dir))
    # node 0 (the leader's host) is lost at step 7: the job dies with it; it is then started
    # again on a replacement host with empty RAM, as a scheduler requeueing the job would
    agents = _two_nodes(run_dir, roots, ["--fault", "losthost@7:node=0"])
    try:
        codes = [a.proc.wait(timeout=WAIT) for a in agents]
    finally:
        for a in agents:
            a.close()
    assert codes[0] == -9 and codes[1] != 0, [a.output() for a in agents]
    assert not os.path.exists(os.path.join(node0, "proc0")), "the lost host's RAM survived"
    (fired,) = agents[0].events("fault_injected")
    assert (fired["kind"], fired["node"], fired["step"]) == ("losthost", 0, 7)
    assert not run_processes(run_dir), "processes of the lost job are still running"
    agents = _two_nodes(run_dir, roots, [])
    try:
        codes = [a.wait(WAIT) for a in agents]
    finally:
        for a in agents:
            a.close()
    assert codes == [0, 0], [a.output() for a in agents]
    later = [e for e in agents[0].events() if e["incarnation"] >= 1]
    fallback = [e for e in later if e["event"] == "local_fallback"]
    rejected = [e for e in later if e["event"] == "snapshot_rejected" and "processes" in e]
    assert not fallback, (fallback, rejected)  # never a silent (or announced) step back
    (restore,) = agents[0].events("restore")
    assert restore["tier"] == "peer" and restore["fetched"] == [0], (restore, rejected)
    assert restore["incarnation"] == 1, restore
    assert restore["local_skipped"] == [e["step"] for e in rejected], (restore, rejected)
    # the newest complete snapshot before the kill at 7; a peer copy still in flight when the
    # host died is rejected (with an event) and the one before it is used
    assert 1 <= restore["step"] <= 6
    assert_exact(run_dir, reference)
    # the completed job leaves nothing in either node's RAM: snapshots, peer copies, folders
    left = [os.path.join(d, f) for root in roots for d, _, files in os.walk(root) for f in files]
    assert left == [], left


def test_worker_killed_standby_group_takes_over(reference, tmp_path):
    """Under --standby the next incarnation is built while the group trains (slowed down at
    step 2 for 20 s so that it is ready even on a busy machine); the kill switches to it: it
    restores the newest snapshot and trains on to the same losses."""
    run = Launch(tmp_path / "run", ["--nproc", "2", "--devices-per-proc", "2", "--standby",
                                    "--fault", "slow@2:process=0:seconds=20",
                                    "--fault", "kill@8:process=1"], _cmd())  # fmt: skip
    try:
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    first, second = run.events("group_started")
    assert first["path"] == "spares" and second["path"] == "standby", second  # spares: the pool
    starts = {e["incarnation"]: e for e in run.events("start")}
    assert starts[1]["path"] == "standby" and starts[1]["warm"] is True, starts
    compiled = [e for e in run.events("compiled") if e["incarnation"] == 1]
    assert compiled and compiled[0]["ahead"] is True and compiled[0]["misses"] == 0, compiled
    # the standby ran its throwaway warm-up step (on zeros) before it was needed
    logs = "".join(p.read_text(errors="replace") for p in (run.run_dir / "logs").glob("inc1-*"))
    assert logs.count("standby warm-up step ran") == 2, logs[-3000:]  # each of the 2 processes
    (restore,) = run.events("restore")
    assert restore["tier"] == "local" and restore["incarnation"] == 1, restore
    assert_exact(run.run_dir, reference)
    assert not run_processes(run.run_dir), "standby or worker processes outlived the job"
