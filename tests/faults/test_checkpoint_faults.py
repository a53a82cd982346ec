"""Checkpoint faults end to end: real `python -m train` processes on 8 CPU devices, real signals.

Every run is gpt_tiny for 30 steps with a save every 10 (the same compiled program, so one
persistent compilation cache serves them all), compared with one uninterrupted reference run:
losses must be identical (==) for every step, last metrics line per step.

    python -m pytest tests/faults/test_checkpoint_faults.py -m slow
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar.checkpoint import CORRUPT_SUFFIX, EXIT_PREEMPTED, TMP_SUFFIX
from jaxpar.faults import EXIT_NAN
from jaxpar.metrics import last_per_step, read_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
EXIT_REPLICA = 45  # train/__main__.py
THREADS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def start(run_dir, *args, devices=8, cache=None, faults=(), **popen) -> subprocess.Popen:
    """Start `python -m train` gpt_tiny, 30 steps, saves every 10, in its own process group."""
    cmd = [sys.executable, "-m", "train", "--steps", str(STEPS), "--run-dir", str(run_dir)]
    cmd += ["--no-progress", "--set", "ckpt.every=10", *args]
    for f in faults:
        cmd += ["--fault", f]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAR_")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {THREADS}"
    if cache:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)
    return subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, **popen)


def train(run_dir, *args, timeout=600, **kw) -> subprocess.CompletedProcess:
    """Run `start(...)` to its end; returns the CompletedProcess (stdout, stderr as text)."""
    proc = start(run_dir, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    cmd = proc.args
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} timed out after {timeout}s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def losses(run_dir) -> dict[int, float]:
    return {s: m["loss"] for s, m in last_per_step(read_jsonl(f"{run_dir}/metrics.jsonl")).items()}


def events(run_dir, name=None, incarnation=None) -> list[dict]:
    evs = read_jsonl(f"{run_dir}/events.jsonl")
    return [
        e
        for e in evs
        if (name is None or e["event"] == name)
        and (incarnation is None or e["incarnation"] == incarnation)
    ]


def committed(run_dir) -> list[int]:
    return sorted(int(d) for d in os.listdir(f"{run_dir}/checkpoints") if d.isdigit())


def ok(proc, code=0):
    assert proc.returncode == code, f"rc {proc.returncode} != {code}\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "jax-cache-8dev"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """One uninterrupted 30-step run (shared with tests/sharding/test_reshard.py by path)."""
    run_dir = tmp_path_factory.getbasetemp() / "ckpt-reference-30"
    if not (run_dir / "summary.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        ok(train(run_dir, cache=cache))
    ref = losses(run_dir)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert committed(run_dir) == [10, 20, 30]
    return run_dir, ref


def assert_exact(run_dir, ref):
    got = losses(run_dir)
    assert sorted(got) == sorted(ref)
    diff = {s: (got[s], ref[s]) for s in ref if got[s] != ref[s]}
    assert not diff, f"losses differ from the uninterrupted run at steps {sorted(diff)}: {diff}"


def test_reference_saves_report_blocking_time(reference):
    run_dir, _ = reference
    ends = events(run_dir, "save_end")
    assert [e["step"] for e in ends] == [10, 20, 30]
    assert all(e["blocking_s"] >= 0 for e in ends)
    assert {e["step"] for e in events(run_dir, "save_begin")} == {10, 20, 30}
    for step in (10, 20, 30):
        assert os.path.exists(f"{run_dir}/checkpoints/{step}/checksums.json")


def test_kill_between_saves_resumes_exactly(reference, tmp_path, cache):
    _, ref = reference
    run_dir = tmp_path / "run"
    ok(train(run_dir, cache=cache, faults=["kill@15"]), -signal.SIGKILL)
    assert max(losses(run_dir)) == 14
    (fired,) = events(run_dir, "fault_injected")
    assert (fired["kind"], fired["step"], fired["process"]) == ("kill", 15, 0)
    assert committed(run_dir) == [10]
    ok(train(run_dir, cache=cache, faults=["kill@15"]))  # fired once: not again
    (restore,) = events(run_dir, "restore")
    assert (restore["step"], restore["incarnation"]) == (10, 1)
    assert len(events(run_dir, "fault_injected")) == 1
    assert_exact(run_dir, ref)


def test_hang_then_external_sigkill_resumes_exactly(reference, tmp_path, cache):
    _, ref = reference
    run_dir = tmp_path / "run"
    proc = start(run_dir, cache=cache, faults=["hang@15"])
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
    ok(train(run_dir, cache=cache, faults=["hang@15"]))  # fired once: no hang this time
    assert len(events(run_dir, "fault_injected")) == 1
    assert events(run_dir, "restore")[0]["step"] == 10
    assert_exact(run_dir, ref)


def test_kill_during_save_restores_previous_committed_step(reference, tmp_path, cache):
    _, ref = reference
    run_dir = tmp_path / "run"
    keep1 = ("--set", "ckpt.keep=1")  # step 10 may go only once a newer step has committed
    ok(train(run_dir, *keep1, cache=cache, faults=["killsave@20"]), -signal.SIGKILL)
    (fired,) = events(run_dir, "fault_injected")
    assert (fired["kind"], fired["step"]) == ("killsave", 20)
    # arrays of step 20 written, never committed: only the tmp folder is left, 10 is kept
    assert committed(run_dir) == [10]
    left = os.listdir(run_dir / "checkpoints")
    tmp = [d for d in left if TMP_SUFFIX in d]
    assert tmp and all(d.startswith("20") for d in tmp), left
    assert glob.glob(f"{run_dir}/checkpoints/{tmp[0]}/state/ocdbt.process_0/d/*")  # data written
    ok(train(run_dir, *keep1, cache=cache, faults=["killsave@20"]))
    assert len(events(run_dir, "fault_injected")) == 1  # once per run directory
    (ignored,) = events(run_dir, "uncommitted_ignored")
    assert ignored["dirs"] == tmp
    assert events(run_dir, "restore")[0]["step"] == 10
    assert committed(run_dir) == [30]
    assert not [d for d in os.listdir(run_dir / "checkpoints") if TMP_SUFFIX in d]
    assert_exact(run_dir, ref)


def test_corrupt_newest_checkpoint_falls_back_to_previous(reference, tmp_path, cache):
    _, ref = reference
    run_dir = tmp_path / "run"
    faults = ["corrupt@25", "kill@26"]
    ok(train(run_dir, cache=cache, faults=faults), -signal.SIGKILL)
    assert [e["kind"] for e in events(run_dir, "fault_injected")] == ["corrupt", "kill"]
    ok(train(run_dir, cache=cache, faults=faults))
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


def test_sigterm_saves_exits_preempted_and_resumes_exactly(reference, tmp_path, cache):
    _, ref = reference
    run_dir = tmp_path / "run"
    ok(train(run_dir, cache=cache, faults=["sigterm@13"]), EXIT_PREEMPTED)
    (pre,) = events(run_dir, "preempted")
    assert pre["step"] == 13  # the notice came before step 13; it finished, then saved
    assert committed(run_dir) == [10, 13]
    ok(train(run_dir, cache=cache, faults=["sigterm@13"]))
    assert len(events(run_dir, "fault_injected")) == 1
    assert events(run_dir, "restore")[0]["step"] == 13
    assert_exact(run_dir, ref)


def test_nan_exits_44_saves_nothing_after_and_fires_once(reference, tmp_path, cache):
    _, ref = reference
    run_dir = tmp_path / "run"
    ok(train(run_dir, "--set", "ckpt.every=3", cache=cache, faults=["nan@5"]), EXIT_NAN)
    (bad,) = events(run_dir, "nonfinite")
    assert bad["step"] == 5
    assert committed(run_dir) == [3]
    assert max(losses(run_dir)) == 4
    ok(train(run_dir, "--set", "ckpt.every=3", cache=cache, faults=["nan@5"]))
    assert len(events(run_dir, "fault_injected")) == 1
    assert events(run_dir, "restore")[0]["step"] == 3
    assert_exact(run_dir, ref)


def test_diverged_replica_is_reported_and_repeat_fires_every_incarnation(tmp_path, cache):
    run_dir = tmp_path / "run"
    for incarnation in (0, 1):
        ok(train(run_dir, cache=cache, faults=["diverge@5:repeat"]), EXIT_REPLICA)
        (bad,) = events(run_dir, "replica_mismatch", incarnation)
        assert (bad["when"], bad["step"]) == ("save", 10)
        assert any("params" in p for p in bad["params"])
    assert [e["incarnation"] for e in events(run_dir, "fault_injected")] == [0, 1]
    assert not os.path.isdir(run_dir / "checkpoints") or committed(run_dir) == []


def test_restore_step_and_none(reference, tmp_path, cache):
    ref_dir, ref = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    ok(train(run_dir, "--set", "ckpt.restore=20", cache=cache))
    (restore,) = events(run_dir, "restore")
    assert restore["step"] == 20
    assert [e["step"] for e in events(run_dir, "checkpoint_replaced")] == [30]
    assert_exact(run_dir, ref)
    bad = train(run_dir, "--set", "ckpt.restore=7", cache=cache)
    ok(bad, 2)
    assert "ckpt.restore=7" in bad.stderr and "[10, 20, 30]" in bad.stderr
    ok(train(run_dir, "--set", "ckpt.restore=none", cache=cache, faults=["kill@4"]), -9)
    assert [e["incarnation"] for e in events(run_dir, "restore")] == [1]  # none in the last
    lines = [m for m in read_jsonl(f"{run_dir}/metrics.jsonl") if m.get("incarnation") == 3]
    assert [(m["step"], m["loss"]) for m in lines] == [(s, ref[s]) for s in (1, 2, 3)]


def test_other_model_config_is_refused_unless_forced(reference, tmp_path, cache):
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    other = ("--set", "optim.weight_decay=0.02")
    refused = train(run_dir, *other, cache=cache)
    ok(refused, 2)
    assert "ckpt.force=true" in refused.stderr and "config" in refused.stderr
    assert not events(run_dir, "restore")
    ok(train(run_dir, *other, "--set", "ckpt.force=true", cache=cache))
    (forced,) = events(run_dir, "restore_forced")
    assert forced["step"] == 30 and forced["from_config"] != forced["to_config"]
    assert events(run_dir, "restore")[0]["step"] == 30


def test_wall_time_limit_saves_and_exits_cleanly(reference, tmp_path, cache):
    _, ref = reference
    run_dir = tmp_path / "run"
    # 2 s per step from step 2: 30 steps would take > 60 s, so the limit strikes mid-run
    slow = ["slow@2:seconds=2"]
    ok(train(run_dir, "--set", "run.max_wall_s=60", cache=cache, faults=slow))
    (limit,) = events(run_dir, "wall_time_limit")
    assert 0 < limit["step"] < STEPS, "startup took the whole limit: no step to check"
    assert limit["step"] in committed(run_dir) and events(run_dir, "done")
    ok(train(run_dir, cache=cache, faults=slow))
    assert len(events(run_dir, "fault_injected")) == 1
    assert events(run_dir, "restore")[0]["step"] == limit["step"]
    assert_exact(run_dir, ref)
