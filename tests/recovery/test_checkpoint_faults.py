"""Checkpoint faults end to end: real `python -m train` processes on 8 CPU devices, real signals.

Every run is gpt_tiny made small (helpers.SMALL) for 30 steps with a save every 10 (the same compiled program, so one
persistent compilation cache serves them all), compared with one uninterrupted reference run:
losses must be identical (==) for every step, last metrics line per step. The faults a run is
resumed from are chained through one run directory (the `chain` fixture): each resume is checked
where it trained, every line every incarnation logged equal to the reference's.

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


# ---- the faults that end a run and are resumed from, chained through one run directory ---------
#
# Each fault fires once per run directory, so one directory takes them one after another: every
# run (an incarnation) of `python -m train` gets the faults of all stages, stops at the first one
# that has not fired yet, and the next run restores from the newest good checkpoint and goes on
# to the next. The order lets each stage find what its fault needs (a committed step before it,
# a save in flight, ...); the tests below each check one stage, and every line every incarnation
# logged is checked against the uninterrupted run (so each resume is exact where it trained).
#
#   inc 0  sigterm@13  steps 1-13, saves 10; the notice: saves 13 and exits EXIT_PREEMPTED
#   inc 1  nan@15      restores 13, step 14, a NaN loss at 15: exits EXIT_NAN, saves nothing
#   inc 2  kill@16     restores 13, steps 14-15, SIGKILL: nothing committed after 13
#   inc 3  hang@17     restores 13, steps 14-16, hangs; killed with SIGKILL from outside
#   inc 4  killsave@20 restores 13, steps 14-20, killed inside the commit of 20 (ckpt.keep=1)
#   inc 5  corrupt@25 + kill@26: restores 13 (20 was never committed), saves 20, a byte of 20
#          flipped at 25, SIGKILL at 26 (saves synchronous: 20 committed before 25)
#   inc 6  20 fails its check: moved aside, restores 13; 5 s per step from 14 (the 17 steps
#          left take > 85 s however fast the machine) under run.max_wall_s=60: the limit strikes
#          mid-run, it saves that step and exits cleanly (20 is saved again on the way, or in 7)
#   inc 7  restores the step the limit saved, trains to 30
CHAIN = ["sigterm@13", "nan@15", "kill@16", "hang@17", "killsave@20", "corrupt@25", "kill@26"]
SLOW = "slow@14:seconds=5"  # inc 6 and 7 only (fires once: not in 7)
RESUMED_AT = 13  # the step incarnations 1-6 restore


def logged(run_dir, incarnation: int) -> dict[int, float]:
    """step -> loss of the metrics lines one incarnation logged."""
    lines = read_jsonl(f"{run_dir}/metrics.jsonl")
    return {m["step"]: m["loss"] for m in lines if "loss" in m and m["incarnation"] == incarnation}


@pytest.fixture(scope="module")
def chain(reference, tmp_path_factory):
    """The chained run directory and, per incarnation, its exit code and what its end left in
    checkpoints/ (later incarnations change it)."""
    run_dir = tmp_path_factory.mktemp("chain") / "run"
    ends: list[dict] = []

    def ended(code) -> None:
        left = sorted(os.listdir(run_dir / "checkpoints"))
        data = {d: bool(glob.glob(f"{run_dir}/checkpoints/{d}/state/ocdbt.process_0/d/*"))
                for d in left if TMP_SUFFIX in d}  # fmt: skip
        ends.append({"code": code, "committed": committed(run_dir), "left": left, "data": data})

    for _ in range(3):  # sigterm, nan, kill
        ended(train(run_dir, faults=CHAIN).returncode)
    proc = start(cmd(run_dir, faults=CHAIN))
    try:
        deadline = time.time() + 600
        while not events(run_dir, "fault_injected", 3) and proc.poll() is None:
            assert time.time() < deadline, "hang@17 never fired"
            time.sleep(0.2)
        time.sleep(2)
        hung = {"alive": proc.poll() is None, "last": max(logged(run_dir, 3))}
        os.kill(proc.pid, signal.SIGKILL)  # a real kill -9 from outside
        ended(proc.wait(timeout=60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ends[3].update(hung)
    # step 13 may go only once a newer step has committed
    ended(train(run_dir, "--set", "ckpt.keep=1", faults=CHAIN).returncode)
    # saved synchronously: a small model's step takes milliseconds, and an asynchronous save of
    # 20 may still be in flight when step 25 starts (the same losses: saving changes no number)
    ended(train(run_dir, "--set", "ckpt.use_async=false", faults=CHAIN).returncode)
    ended(train(run_dir, "--set", "run.max_wall_s=60", faults=[*CHAIN, SLOW]).returncode)
    ended(train(run_dir, faults=[*CHAIN, SLOW]).returncode)
    return run_dir, ends


def fired(run_dir, incarnation: int) -> list[tuple]:
    return [(e["kind"], e["step"], e["process"])
            for e in events(run_dir, "fault_injected", incarnation)]  # fmt: skip


def restored(run_dir, incarnation: int) -> dict:
    (restore,) = events(run_dir, "restore", incarnation)
    return restore


def test_every_incarnation_logs_the_uninterrupted_losses_and_each_fault_fires_once(
    reference, chain
):
    _, ref = reference
    run_dir, ends = chain
    killed = -signal.SIGKILL
    assert [e["code"] for e in ends] == [EXIT_PREEMPTED, EXIT_NAN, *[killed] * 4, 0, 0]
    specs = [e["spec"] for e in events(run_dir, "fault_injected")]
    assert sorted(specs) == sorted([*CHAIN, SLOW])  # each once, in whichever run reached it
    (limit,) = events(run_dir, "wall_time_limit")
    for inc in range(1, len(ends)):  # each restore trains on from the step after it
        got = logged(run_dir, inc)
        want = RESUMED_AT if inc < 7 else limit["step"]
        assert restored(run_dir, inc)["step"] == want == min(got) - 1, inc
        assert got == {s: ref[s] for s in got}, f"incarnation {inc} differs: {got}"
    assert logged(run_dir, 0) == {s: ref[s] for s in range(1, RESUMED_AT + 1)}
    assert_exact(run_dir, ref)


def test_sigterm_saves_exits_preempted_and_resumes_exactly(chain):
    run_dir, ends = chain
    assert ends[0]["code"] == EXIT_PREEMPTED
    (pre,) = events(run_dir, "preempted")
    assert (pre["step"], pre["incarnation"]) == (13, 0)  # the notice came before 13; it
    assert ends[0]["committed"] == [10, 13]  # finished, then saved
    assert fired(run_dir, 0) == [("sigterm", 13, 0)]
    assert restored(run_dir, 1)["step"] == 13  # (the losses: the first test)


def test_nan_exits_44_saves_nothing_after_and_fires_once(chain):
    run_dir, ends = chain
    assert ends[1]["code"] == EXIT_NAN
    (bad,) = events(run_dir, "nonfinite")
    assert (bad["step"], bad["incarnation"]) == (15, 1)
    assert ends[1]["committed"] == [10, 13]  # the NaN state (or the one before it) not saved
    assert max(logged(run_dir, 1)) == 14
    assert fired(run_dir, 1) == [("nan", 15, 0)]  # not again in incarnations 2-6
    assert restored(run_dir, 2)["step"] == 13


def test_kill_between_saves_resumes_exactly(chain):
    run_dir, ends = chain
    assert ends[2]["code"] == -signal.SIGKILL
    assert max(logged(run_dir, 2)) == 15
    assert fired(run_dir, 2) == [("kill", 16, 0)]
    assert ends[2]["committed"] == [10, 13]
    assert (restored(run_dir, 3)["step"], restored(run_dir, 3)["incarnation"]) == (13, 3)


def test_hang_then_external_sigkill_resumes_exactly(chain):
    run_dir, ends = chain
    assert fired(run_dir, 3) == [("hang", 17, 0)]
    assert ends[3]["alive"] and ends[3]["last"] == 16  # alive 2 s after, no progress
    assert ends[3]["code"] == -signal.SIGKILL
    assert restored(run_dir, 4)["step"] == 13  # and no hang in incarnation 4


def test_kill_during_save_restores_previous_committed_step(chain):
    run_dir, ends = chain
    assert ends[4]["code"] == -signal.SIGKILL
    assert fired(run_dir, 4) == [("killsave", 20, 0)]
    # arrays of step 20 written, never committed: only the tmp folder is left; 13 is kept, and
    # so is 10 (under keep=1 a step goes only once a newer one has committed)
    assert ends[4]["committed"] == [10, 13]
    tmp = [d for d in ends[4]["left"] if TMP_SUFFIX in d]
    assert tmp and all(d.startswith("20") for d in tmp), ends[4]
    assert ends[4]["data"][tmp[0]]  # data written
    (ignored,) = events(run_dir, "uncommitted_ignored")
    assert (ignored["dirs"], ignored["incarnation"]) == (tmp, 5)
    assert restored(run_dir, 5)["step"] == 13
    assert not [d for d in os.listdir(run_dir / "checkpoints") if TMP_SUFFIX in d]


def test_corrupt_newest_checkpoint_falls_back_to_previous(chain):
    run_dir, ends = chain
    assert ends[5]["code"] == -signal.SIGKILL
    assert fired(run_dir, 5) == [("corrupt", 25, 0), ("kill", 26, 0)]
    assert ends[5]["committed"] == [10, 13, 20]  # 20 committed before 25
    (bad,) = events(run_dir, "checkpoint_corrupt")
    # orbax zstd-compresses chunks: a flipped byte either decodes to wrong bits (the checksums
    # see it) or breaks the frame (a read error); both must fall back
    assert bad["step"] == 20 and bad["reason"].startswith(("checksum mismatch", "read")), bad
    restore = restored(run_dir, 6)
    assert (restore["step"], restore["skipped_corrupt"]) == (13, [20])
    assert glob.glob(f"{run_dir}/checkpoints/20{CORRUPT_SUFFIX}-*")  # moved aside, not deleted
    again = [e["step"] for e in events(run_dir, "save_end") if e["incarnation"] >= 6]
    assert 20 in again and 20 in ends[7]["committed"]  # 20 saved again


def test_wall_time_limit_saves_and_exits_cleanly(chain):
    run_dir, ends = chain
    assert ends[6]["code"] == 0 and events(run_dir, "done", 6)
    assert fired(run_dir, 6) == [("slow", 14, 0)]
    (limit,) = events(run_dir, "wall_time_limit")
    assert limit["incarnation"] == 6
    assert RESUMED_AT < limit["step"] < STEPS, "startup took the whole limit: no step to check"
    assert limit["step"] in ends[6]["committed"]
    assert max(logged(run_dir, 6)) == limit["step"]
    assert fired(run_dir, 7) == []  # fired once: no slow steps in incarnation 7
    assert restored(run_dir, 7)["step"] == limit["step"]
    assert ends[7]["committed"][-1] == STEPS


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
