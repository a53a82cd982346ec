"""`jaxpar launch --groups`: replica groups of real `python -m train` workers (gpt_tiny, small)
on 127.0.0.1. One job asserts several things: before the failure its losses equal plain data
parallelism on the same global batch (one jax.distributed world, in one process here) within
1e-5; a SIGKILL of group 1's process leaves group 0's process running (same PID), no step
rewound, the quorum recorded in every metrics line, group 1 rejoining from group 0's state.

    python -m pytest tests/supervisor/test_replicas.py -m slow
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.helpers import cpu_env
from tests.support.launch_util import REPO, Launch, losses, train_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, KILL_AT = 20, 5
WAIT = 600


def _lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def test_groups_equal_data_parallel_and_survive_a_killed_group(tmp_path):
    ref_dir = tmp_path / "ref"  # one world: 4 devices on `data`, the same global batch
    ref = subprocess.run(
        [*train_cmd(KILL_AT - 1, 0), "--mesh", "data=4", "--run-dir", str(ref_dir)],
        cwd=REPO, env={**cpu_env(devices=4), "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=WAIT,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    args = ["--nproc", "2", "--devices-per-proc", "2", "--groups", "2", "--min-groups", "1",
            "--fault", f"kill@{KILL_AT}:process=1",
            # group 0 slowed after the kill: group 1 rejoins before the last step
            "--fault", f"slow@{KILL_AT + 1}:process=0:seconds=1.5"]  # fmt: skip
    run = Launch(tmp_path / "run", args, train_cmd(STEPS, 4))
    try:
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    # without failures: plain data parallelism within 1e-5
    want, got = losses(ref_dir), losses(run.run_dir)
    assert sorted(want) == list(range(1, KILL_AT))
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-5, (step, got[step], loss)
    # the survivors: group 0 started once (same PID to the end), group 1 twice
    started = run.events("group_started")
    assert [e["group"] for e in started] == [0, 1, 1], started
    assert [e["group"] for e in run.events("group_restart")] == [1]
    # no step rewound: one metrics line per step, in order, each naming its quorum
    lines = _lines(run.run_dir)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    quorum = {m["step"]: m["quorum"] for m in lines}
    assert all(quorum[s] == [0, 1] for s in range(1, KILL_AT))
    assert quorum[KILL_AT] == [0]  # group 1 died while group 0 waited in step KILL_AT
    assert quorum[STEPS] == [0, 1]  # rejoined from group 0's state
    (joined,) = [e for e in run.events("group_joined") if e["transfer"]]
    assert joined["group"] == 1 and joined["donor"] == 0
    lost = sum(2 - len(q) for q in quorum.values())
    summary = run.summary()["groups"]
    assert summary["group_steps_lost"] == lost > 0 and summary["group_restarts"] == 1


def test_groups_bad_input_one_line(tmp_path):
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", "3", "--groups", "2",
           "--run-dir", str(tmp_path / "r"), "--", sys.executable, "-c", "pass"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .endswith("is not divisible by --groups 2; give a multiple")
    )
