"""Resuming from the local snapshot tier, one process on 8 CPU devices, real SIGKILLs: a run
killed at a random step and rerun restores from RAM and reproduces the uninterrupted losses
exactly; a snapshot torn by a kill mid-write is skipped for the previous one.

The reference is conftest's uninterrupted 30-step run (persistent saves every 10).

    python -m pytest tests/recovery/test_local_resume.py -m slow
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from jaxpar.recovery import local_tier
from tests.support.helpers import LOCAL_ENV, SMALL, assert_exact, events, losses, ok, run, train_cmd

pytestmark = pytest.mark.slow

STEPS = 30


def train(run_dir, faults=()):
    return run(train_cmd(run_dir, "--set", "ckpt.every=10", *SMALL, steps=STEPS, faults=faults))


def test_kill_at_random_step_resumes_from_local_tier_exactly(ckpt_reference, tmp_path):
    ref = losses(ckpt_reference)
    at = random.Random().randint(13, 19)  # between the persistent saves of steps 10 and 20
    run_dir = tmp_path / "run"
    ok(train(run_dir, faults=[f"kill@{at}"]), -signal.SIGKILL)
    assert max(losses(run_dir)) == at - 1
    ok(train(run_dir))
    (restore,) = events(run_dir, "restore")
    # the snapshot of step at-1 may still have been in flight when the kill came
    assert restore["tier"] == "local" and restore["step"] in (at - 2, at - 1), (at, restore)
    assert_exact(run_dir, ref)
    (stats,) = events(run_dir, "local_tier_stats")
    assert stats["snapshots"] == STEPS - restore["step"] and stats["max_held"] <= 2
    # the run completed: its final state is persistent, its snapshots are gone from RAM
    assert not os.path.exists(local_tier.node_dir(os.environ[LOCAL_ENV], str(run_dir)))


def test_torn_snapshot_falls_back_to_previous(ckpt_reference, tmp_path):
    ref = losses(ckpt_reference)
    run_dir = tmp_path / "run"
    ok(train(run_dir, faults=["killsnap@16"]), -signal.SIGKILL)
    ok(train(run_dir))
    (fired,) = events(run_dir, "fault_injected")
    assert (fired["kind"], fired["step"]) == ("killsnap", 16)
    assert events(run_dir, "snapshot_torn", incarnation=1)
    (restore,) = events(run_dir, "restore")
    assert (restore["tier"], restore["step"]) == ("local", 15)
    assert_exact(run_dir, ref)
