"""`jaxpar launch --groups`: replica groups of real `python -m train` workers (gpt_tiny, small)
on 127.0.0.1. One job asserts several things: before the failure its losses equal plain data
parallelism on the same global batch (one jax.distributed world, in one process here) within
1e-5; a SIGKILL of group 1's process leaves group 0's process running (started once), no step
rewound, the quorum recorded in every metrics line, group 1 rejoining from group 0's state; the
leader's supervisor killed takes every worker with it and the same command resumes the run from
the newest checkpoint.

    python -m pytest tests/supervisor/test_replicas.py -m slow
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import numpy as np
import pytest

from tests.support import gloo_peer
from tests.support.launch_util import (
    Launch,
    losses,
    nonfinite_checkpoints,
    run_processes,
    train_cmd,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# The runs of two groups of 2 devices: one program (the steps are in it: the learning rate's
# decay, max(steps, warmup + 1) = 21 steps for any run of up to 21), so the later tests' groups
# load what the first's compiled
STEPS, KILL_AT = 16, 5
WAIT = 600
HUNG_STEPS = STEPS


def _lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def _wait_for(run: Launch, ok, what: str) -> list[dict]:
    deadline = time.time() + WAIT
    while time.time() < deadline:
        lines = _lines(run.run_dir) if (run.run_dir / "metrics.jsonl").exists() else []
        if ok(lines):
            return lines
        assert run.proc.poll() is None, f"launch ended before {what}:\n{run.output()}"
        time.sleep(0.2)
    raise AssertionError(f"no {what} in {WAIT}s:\n{run.output()}")


def test_groups_equal_data_parallel_survive_a_killed_group_and_the_leaders_loss(
    tmp_path, ckpt_reference
):
    # The plain data-parallel run: the session's uninterrupted reference (tests/conftest.py; run
    # once for the checkpoint tests): one world, 8 devices on `data`, gpt_tiny made small on the
    # same global batch. Its steps before KILL_AT are warmup steps, whose learning rate does not
    # depend on the run's length (its 30 steps, these groups' 16).
    ref_dir = ckpt_reference
    nproc = ["--nproc", "2", "--devices-per-proc", "2", "--groups", "2", "--min-groups", "1"]
    faults = ["--fault", f"kill@{KILL_AT}:process=1",
              # group 0 slowed after the kill: group 1 rejoins long before the last step (the
              # 10 steps left take 35 s)
              "--fault", f"slow@{KILL_AT + 1}:process=0:seconds=3.5"]  # fmt: skip
    env, p2p = gloo_peer.launch_env()  # the average peer to peer (jaxpar[gloo]) where it installs
    run = Launch(tmp_path / "run", [*nproc, *faults], train_cmd(STEPS, 4), env=env)
    try:
        # group 1 killed, restarted, back in the quorum: then the leader's supervisor is killed
        lines = _wait_for(
            run, lambda ls: any(m["step"] > KILL_AT and m["quorum"] == [0, 1] for m in ls),
            "step with group 1 back",
        )  # fmt: skip
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=60)
        deadline = time.time() + 30  # every worker dies with its supervisor
        while run_processes(run.run_dir) and time.time() < deadline:
            time.sleep(0.2)
        assert run_processes(run.run_dir) == []
    finally:
        run.close()
    # without failures: plain data parallelism within 1e-5
    want = {s: loss for s, loss in losses(ref_dir).items() if s < KILL_AT}
    got = {m["step"]: m["loss"] for m in lines}
    assert sorted(want) == list(range(1, KILL_AT))
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-5, (step, got[step], loss)
    # the survivors: group 0 started once (its process ran throughout), group 1 twice
    started = run.events("group_started")
    assert [e["group"] for e in started] == [0, 1, 1], started
    assert [e["group"] for e in run.events("group_restart")] == [1]
    # each group's spare pool logs to a file of its own (named by its first global process id)
    spares = sorted(p.name for p in (run.run_dir / "logs").glob("spare*.log"))
    assert spares == ["spare-pool-proc0.log", "spare-pool-proc1.log"], spares
    # no step rewound: one metrics line per step, in order, each naming its quorum
    assert [m["step"] for m in lines] == list(range(1, len(lines) + 1))
    quorum = {m["step"]: m["quorum"] for m in lines}
    assert all(quorum[s] == [0, 1] for s in range(1, KILL_AT))
    assert quorum[KILL_AT] == [0]  # group 1 died while group 0 waited in step KILL_AT
    (joined,) = [e for e in run.events("group_joined") if e["transfer"]]
    assert joined["group"] == 1 and joined["donor"] == 0
    assert joined.get("p2p", False) == p2p, joined  # the state from group 0's processes
    # the leader's loss ended the job; the same command resumes it from the newest checkpoint
    again = Launch(tmp_path / "run", nproc, train_cmd(STEPS, 4), name="again", env=env)
    try:
        assert again.wait(WAIT) == 0, again.output()
    finally:
        again.close()
    restored = [e for e in again.events("restore") if e["time"] > lines[-1]["time"]]
    assert restored and restored[0]["step"] >= 4, (again.events("restore"), again.output()[-3000:])
    final = _lines(again.run_dir)[-1]
    assert final["step"] == STEPS and final["quorum"] == [0, 1]
    summary = again.summary()["groups"]
    assert summary["group_steps_lost"] == 0 and summary["group_restarts"] == 0
    # peer to peer: no gradient byte through the leader's hub, every step
    if p2p:
        assert summary["hub_gradient_bytes"] == 0, summary
        assert summary["steps_peer_to_peer"] == summary["steps_released"] > 0, summary
        assert "average peer to peer (Gloo, jaxpar[gloo])" in again.log.read_text()


def test_a_group_hung_at_its_start_or_with_nan_gradients_is_restarted_alone(tmp_path):
    """Group 1's process stopped (SIGSTOP) while it starts: no step's average waits for it yet,
    so only the start-up timeout finds it, and group 1 is restarted; it rejoins from group 0.
    Then the gradients of its first step turn NaN while its loss stays finite (nangrad): the hub
    drops group 1 from that step before its gradients enter the average and names it and the
    cause; group 0 trains on, group 1 rejoins from group 0's state again, the job finishes, and
    no metrics line or checkpoint holds a non-finite value."""
    steps = HUNG_STEPS  # group 0 paced at 2 s a step from step 5: group 1 rejoins twice before
    # the end
    nproc = ["--nproc", "2", "--devices-per-proc", "2", "--groups", "2", "--min-groups", "1",
             "--no-spares", "--startup-timeout", "60"]  # fmt: skip
    # 60 s: a cold start (jax, torch, the programs) under the suite's load has taken over 20 s
    faults = ["--fault", "nangrad@2:process=1", "--fault", "slow@5:process=0:seconds=2"]
    run = Launch(tmp_path / "run", [*nproc, *faults], train_cmd(steps, 2))
    try:
        deadline, pid = time.time() + WAIT, None
        while pid is None and time.time() < deadline:
            for e in run.events("group_started"):
                if e["group"] == 1:
                    pid = e["pids"][0]
            assert run.proc.poll() is None, run.output()
            time.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)  # still importing jax: never ready
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    hung, nan = [e for e in run.events("group_failure") if e["source"] == "supervisor"]
    assert hung["group"] == 1 and "not ready within the start-up timeout 60s" in hung["why"], hung
    assert nan["group"] == 1 and nan["why"].startswith("non-finite gradients in step "), nan
    dropped = [e for e in run.events("group_failure") if e["source"] == "hub"]
    assert [e["why"] for e in dropped][-1] == nan["why"], dropped
    assert f"group 1 failed ({nan['why']})" in run.output()
    assert [e["group"] for e in run.events("group_started")] == [0, 1, 1, 1]
    joined = [e for e in run.events("group_joined") if e["transfer"]]
    assert [(e["group"], e["donor"]) for e in joined] == [(1, 0), (1, 0)], joined
    lines = _lines(run.run_dir)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert all(np.isfinite([m["loss"], m["grad_norm"]]).all() for m in lines), lines
    quorum = {m["step"]: m["quorum"] for m in lines}
    at = int(nan["why"].split()[4])  # "non-finite gradients in step S (..."
    assert joined[0]["step"] < at and quorum[at] == [0] and quorum[steps] == [0, 1], quorum
    saved = nonfinite_checkpoints(run.run_dir)
    assert saved and set(saved.values()) == {0}, saved


def test_every_group_hung_is_restarted_from_the_newest_checkpoint(tmp_path):
    """Both groups stopped (SIGSTOP) in the same step, with no gradients sent: no group waits for
    another, so only the rule for a quorum hung as a whole finds them, after the hang timeout
    since the last step released; both restart and, with no live group to give its state,
    resume from the newest checkpoint; the run finishes."""
    stop_at = 6  # both groups sleep before step 7: the test stops them there, once step 4's
    # checkpoint has committed
    nproc = ["--nproc", "2", "--devices-per-proc", "2", "--groups", "2", "--min-groups", "1",
             "--hang-timeout", "10", "--max-restarts", "4"]  # fmt: skip
    faults = [f"slow@{stop_at}:process={p}:seconds=8" for p in (0, 1)]
    run = Launch(tmp_path / "run", [*nproc, *[x for f in faults for x in ("--fault", f)]],
                 train_cmd(HUNG_STEPS, 4))  # fmt: skip
    stopped: list[int] = []
    try:
        ckpts = run.run_dir / "checkpoints"
        _wait_for(run, lambda ls: any(m["step"] >= stop_at for m in ls) and (ckpts / "4").is_dir(),
                  f"step {stop_at} and checkpoint 4")  # fmt: skip
        stopped = [e["pids"][0] for e in run.events("group_started")]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        newest = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
        assert run.wait(WAIT) == 0, run.output()
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        run.close()
    hung = [e for e in run.events("group_failure") if e["source"] == "hub"]
    assert sorted(e["group"] for e in hung) == [0, 1], hung
    assert all(e["why"].startswith("hung: no step released") for e in hung), hung
    assert sorted(e["group"] for e in run.events("group_restart")) == [0, 1]
    assert "no replica group is training" in run.output()
    resumed = [e for e in run.events("group_joined") if e.get("all_lost")]
    assert sorted((e["group"], e["step"], e["transfer"]) for e in resumed) == [
        (0, newest, False), (1, newest, False),
    ]  # fmt: skip
    restored = [e for e in run.events("restore") if e["time"] > hung[0]["time"]]
    assert restored and {e["step"] for e in restored} == {newest}, restored
    final = _lines(run.run_dir)[-1]
    assert final["step"] == HUNG_STEPS and final["quorum"] == [0, 1]


def test_a_donor_killed_during_the_state_transfer_voids_it_and_both_rejoin_from_a_third(tmp_path):
    """Three groups of one process: group 2 is killed inside step 3's average (killavg: peer to
    peer, inside the exchange, where jaxpar[gloo] installs); the others finish step 3 without
    it, none waiting for a hang timeout. As group 2 rejoins, its donor (group 0, the quorum's
    lowest) is killed when asked for its state (killgive), before sending any. The transfer is
    void: group 2 is restarted again, group 0 too; group 0 rejoins from group 1, which trains
    throughout (started once, no step rewound), and group 2 from the quorum's lowest group
    then."""
    steps = 24  # group 1 paced at 1 s a step from step 4: both rejoin long before the end
    nproc = ["--nproc", "3", "--devices-per-proc", "1", "--groups", "3", "--min-groups", "1",
             "--max-restarts", "6"]  # fmt: skip
    faults = ["killavg@3:process=2", "killgive@3:process=0", "slow@4:process=1:seconds=1"]
    env, p2p = gloo_peer.launch_env()
    run = Launch(tmp_path / "run", [*nproc, *[x for f in faults for x in ("--fault", f)]],
                 train_cmd(steps, 4, "--set", "data.global_batch=24"), env=env)  # fmt: skip
    try:
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    failures = run.events("group_failure")
    void = [e for e in failures if "lost during the state transfer" in e["why"]]
    if void:  # the hub saw the donor go first and voided the transfer
        assert [e["group"] for e in void] == [2], failures
    else:  # the joiner's own transfer error came first: it exited naming it, and was restarted
        logs = [p.read_text(errors="replace") for p in (run.run_dir / "logs").glob("inc*.log")]
        assert any("the state transfer from group 0 failed" in t for t in logs), failures
    assert sorted(e["group"] for e in run.events("group_restart")) == [0, 2, 2], failures
    started = [e["group"] for e in run.events("group_started")]
    assert started.count(1) == 1 and started.count(0) == 2 and started.count(2) == 3, started
    joined = [e for e in run.events("group_joined") if e["transfer"]]
    # group 0 from group 1; group 2 from the quorum's lowest then: 1, or 0 once it is back
    assert sorted(e["group"] for e in joined) == [0, 2], joined
    assert [e["donor"] for e in joined if e["group"] == 0] == [1], joined
    lines = _lines(run.run_dir)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))  # no step rewound
    assert lines[-1]["quorum"] == [0, 1, 2] and any(m["quorum"] == [1] for m in lines), lines
    # nobody was taken for hung
    assert not [e for e in failures if e["why"].startswith("hung")], failures
    summary = run.summary()["groups"]
    if p2p:  # gradients and states peer to peer throughout: no tensor byte through the hub
        assert lines[2]["quorum"] == [0, 1], lines[:4]  # released over those that finished it
        assert summary["hub_gradient_bytes"] == summary["hub_state_bytes"] == 0, summary
        assert summary["steps_peer_to_peer"] == steps, summary
        assert all(e.get("p2p") for e in joined), joined
