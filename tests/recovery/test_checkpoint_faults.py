"""Checkpoint faults end to end: real `python -m train` processes on 8 CPU devices, real signals.

Every run is gpt_tiny made small (helpers.SMALL) for 30 steps with a save every 10 (the same compiled program, so one
persistent compilation cache serves them all), compared with one uninterrupted reference run:
losses must be identical (==) for every step, last metrics line per step.

    python -m pytest tests/recovery/test_checkpoint_faults.py -m slow
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time

import pytest

from jaxpar.recovery.checkpoint import CORRUPT_SUFFIX, TMP_SUFFIX
from jaxpar.rundir.runlog import read_jsonl
from jaxpar.worker.bootstrap import EXIT_NAN, EXIT_PREEMPTED, EXIT_REPLICA
from tests.support.helpers import SMALL, assert_exact, events, losses, ok, run, start, train_cmd

pytestmark = pytest.mark.slow

STEPS = 30


def cmd(run_dir, *args, faults=()) -> list[str]:
    """`python -m train` gpt_tiny, 30 steps, saves every 10 (the reference's program); the local
    snapshot tier is off: these tests are about the persistent checkpoints."""
    args = ("--set", "ckpt.every=10", "--set", "ckpt.local_every=0", *SMALL, *args)
    return train_cmd(run_dir, *args, steps=STEPS, faults=faults)


def train(run_dir, *args, faults=()) -> subprocess.CompletedProcess:
    return run(cmd(run_dir, *args, faults=faults))


def committed(run_dir) -> list[int]:
    return sorted(int(d) for d in os.listdir(f"{run_dir}/checkpoints") if d.isdigit())


@pytest.fixture(scope="module")
def reference(ckpt_reference):
    """One uninterrupted 30-step run (conftest's, shared with tests/recovery/test_reshard.py)."""
    ref = losses(ckpt_reference)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert committed(ckpt_reference) == [10, 20, 30]
    return ckpt_reference, ref


def test_reference_saves_report_blocking_time(reference):
    run_dir, _ = reference
    ends = events(run_dir, "save_end")
    assert [e["step"] for e in ends] == [10, 20, 30]
    assert all(e["blocking_s"] >= 0 for e in ends)
    assert {e["step"] for e in events(run_dir, "save_begin")} == {10, 20, 30}
    for step in (10, 20, 30):
        assert os.path.exists(f"{run_dir}/checkpoints/{step}/checksums.json")


# A small model's step takes milliseconds: an asynchronous save of step 10 may still be in flight
# when step 15 starts. Tests that need that save committed before the fault save synchronously
# (the same losses: saving never changes the numbers).
SYNC = ("--set", "ckpt.use_async=false")


def test_kill_between_saves_resumes_exactly(reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    ok(train(run_dir, *SYNC, faults=["kill@15"]), -signal.SIGKILL)
    assert max(losses(run_dir)) == 14
    (fired,) = events(run_dir, "fault_injected")
    assert (fired["kind"], fired["step"], fired["process"]) == ("kill", 15, 0)
    assert committed(run_dir) == [10]
    ok(train(run_dir, faults=["kill@15"]))  # fired once: not again
    (restore,) = events(run_dir, "restore")
    assert (restore["step"], restore["incarnation"]) == (10, 1)
    assert len(events(run_dir, "fault_injected")) == 1
    assert_exact(run_dir, ref)


def test_hang_then_external_sigkill_resumes_exactly(reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    proc = start(cmd(run_dir, faults=["hang@15"]))
    try:
        deadline = time.time() + 600
        while not events(run_dir, "fault_injected") and proc.poll() is None:
            assert time.time() < deadline, "hang@15 never fired"
            time.sleep(0.2)
        time.sleep(2)
        assert proc.poll() is None and max(losses(run_dir)) == 14  # alive, no progress
        os.kill(proc.pid, signal.SIGKILL)  # a real kill -9 from outside
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ok(train(run_dir, faults=["hang@15"]))  # fired once: no hang this time
    assert len(events(run_dir, "fault_injected")) == 1
    assert events(run_dir, "restore")[0]["step"] == 10
    assert_exact(run_dir, ref)


def test_kill_during_save_restores_previous_committed_step(reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    keep1 = ("--set", "ckpt.keep=1")  # step 10 may go only once a newer step has committed
    ok(train(run_dir, *keep1, faults=["killsave@20"]), -signal.SIGKILL)
    (fired,) = events(run_dir, "fault_injected")
    assert (fired["kind"], fired["step"]) == ("killsave", 20)
    # arrays of step 20 written, never committed: only the tmp folder is left, 10 is kept
    assert committed(run_dir) == [10]
    left = os.listdir(run_dir / "checkpoints")
    tmp = [d for d in left if TMP_SUFFIX in d]
    assert tmp and all(d.startswith("20") for d in tmp), left
    assert glob.glob(f"{run_dir}/checkpoints/{tmp[0]}/state/ocdbt.process_0/d/*")  # data written
    ok(train(run_dir, *keep1, faults=["killsave@20"]))
    assert len(events(run_dir, "fault_injected")) == 1  # once per run directory
    (ignored,) = events(run_dir, "uncommitted_ignored")
    assert ignored["dirs"] == tmp
    assert events(run_dir, "restore")[0]["step"] == 10
    assert committed(run_dir) == [30]
    assert not [d for d in os.listdir(run_dir / "checkpoints") if TMP_SUFFIX in d]
    assert_exact(run_dir, ref)


def test_corrupt_newest_checkpoint_falls_back_to_previous(reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    faults = ["corrupt@25", "kill@26"]
    ok(train(run_dir, *SYNC, faults=faults), -signal.SIGKILL)  # 20 committed before step 25
    assert [e["kind"] for e in events(run_dir, "fault_injected")] == ["corrupt", "kill"]
    ok(train(run_dir, faults=faults))
    assert len(events(run_dir, "fault_injected")) == 2
    (bad,) = events(run_dir, "checkpoint_corrupt")
    # orbax zstd-compresses chunks: a flipped byte either decodes to wrong bits (the checksums
    # see it) or breaks the frame (a read error); both must fall back
    assert bad["step"] == 20 and bad["reason"].startswith(("checksum mismatch", "read")), bad
    (restore,) = events(run_dir, "restore")
    assert (restore["step"], restore["skipped_corrupt"]) == (10, [20])
    assert glob.glob(f"{run_dir}/checkpoints/20{CORRUPT_SUFFIX}-*")  # moved aside, not deleted
    assert committed(run_dir) == [10, 20, 30]  # 20 saved again
    assert_exact(run_dir, ref)


def test_sigterm_saves_exits_preempted_and_resumes_exactly(reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    ok(train(run_dir, faults=["sigterm@13"]), EXIT_PREEMPTED)
    (pre,) = events(run_dir, "preempted")
    assert pre["step"] == 13  # the notice came before step 13; it finished, then saved
    assert committed(run_dir) == [10, 13]
    ok(train(run_dir, faults=["sigterm@13"]))
    assert len(events(run_dir, "fault_injected")) == 1
    assert events(run_dir, "restore")[0]["step"] == 13
    assert_exact(run_dir, ref)


def test_nan_exits_44_saves_nothing_after_and_fires_once(reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    ok(train(run_dir, "--set", "ckpt.every=3", faults=["nan@5"]), EXIT_NAN)
    (bad,) = events(run_dir, "nonfinite")
    assert bad["step"] == 5
    assert committed(run_dir) == [3]
    assert max(losses(run_dir)) == 4
    ok(train(run_dir, "--set", "ckpt.every=3", faults=["nan@5"]))
    assert len(events(run_dir, "fault_injected")) == 1
    assert events(run_dir, "restore")[0]["step"] == 3
    assert_exact(run_dir, ref)


def test_diverged_replica_is_reported_and_repeat_fires_every_incarnation(tmp_path):
    run_dir = tmp_path / "run"
    for incarnation in (0, 1):
        ok(train(run_dir, faults=["diverge@5:repeat"]), EXIT_REPLICA)
        (bad,) = events(run_dir, "replica_mismatch", incarnation)
        assert (bad["when"], bad["step"]) == ("save", 10)
        assert any("params" in p for p in bad["params"])
    assert [e["incarnation"] for e in events(run_dir, "fault_injected")] == [0, 1]
    assert not os.path.isdir(run_dir / "checkpoints") or committed(run_dir) == []


def test_restore_step_and_none(reference, tmp_path):
    ref_dir, ref = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    ok(train(run_dir, "--set", "ckpt.restore=20"))
    (restore,) = events(run_dir, "restore")
    assert restore["step"] == 20
    assert [e["step"] for e in events(run_dir, "checkpoint_replaced")] == [30]
    assert_exact(run_dir, ref)
    bad = train(run_dir, "--set", "ckpt.restore=7")
    ok(bad, 2)
    assert "ckpt.restore=7" in bad.stderr and "[10, 20, 30]" in bad.stderr
    ok(train(run_dir, "--set", "ckpt.restore=none", faults=["kill@4"]), -9)
    assert [e["incarnation"] for e in events(run_dir, "restore")] == [1]  # none in the last
    # incarnation 2: the refused ckpt.restore=7 run left the run directory unchanged
    lines = [m for m in read_jsonl(f"{run_dir}/metrics.jsonl") if m.get("incarnation") == 2]
    assert [(m["step"], m["loss"]) for m in lines] == [(s, ref[s]) for s in (1, 2, 3)]


def test_other_model_config_is_refused_unless_forced(reference, tmp_path):
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    other = ("--set", "optim.weight_decay=0.02")
    refused = train(run_dir, *other)
    ok(refused, 2)
    assert (
        "ckpt.force=true" in refused.stderr and "optim.weight_decay: 0.01 → 0.02" in refused.stderr
    )
    assert not events(run_dir, "restore")
    # step 30 is already the last step (nothing to do): force the load of 20 and train on
    ok(train(run_dir, *other, "--set", "ckpt.force=true", "--set", "ckpt.restore=20"))
    (forced,) = events(run_dir, "restore_forced")
    assert forced["step"] == 20 and forced["from_config"] != forced["to_config"]
    assert events(run_dir, "restore")[0]["step"] == 20


def test_wall_time_limit_saves_and_exits_cleanly(reference, tmp_path):
    _, ref = reference
    run_dir = tmp_path / "run"
    # 3 s per step from step 2: 30 steps take > 87 s however fast the machine, so the limit
    # strikes mid-run (2 s per step came within a second of the limit: 58 s of sleeps)
    slow = ["slow@2:seconds=3"]
    ok(train(run_dir, "--set", "run.max_wall_s=60", faults=slow))
    (limit,) = events(run_dir, "wall_time_limit")
    assert 0 < limit["step"] < STEPS, "startup took the whole limit: no step to check"
    assert limit["step"] in committed(run_dir) and events(run_dir, "done")
    ok(train(run_dir, faults=slow))
    assert len(events(run_dir, "fault_injected")) == 1
    assert events(run_dir, "restore")[0]["step"] == limit["step"]
    assert_exact(run_dir, ref)
