"""`python -m train` as a user's process meets it: Ctrl-C, a full disk, a damaged log, an
injected fault. Real subprocesses on one CPU device with a one-layer GPT (small and fast)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import sys
import time

import pytest

from jaxpar.rundir.runlog import read_jsonl, read_jsonl_counted
from jaxpar.worker.bootstrap import EXIT_NAN, EXIT_NO_SPACE
from tests.support import forkserver
from tests.support.helpers import REPO, SMALL, cpu_env, events, ok, run, start, train_cmd

pytestmark = pytest.mark.slow


# Up to 21 steps the learning rate decays over max(steps, warmup + 1) = 21: every run here is one
# program (compiled once, then loaded from the session's cache)
STEPS = 21


def cmd(run_dir, *args, steps, faults=()):
    return train_cmd(run_dir, *SMALL, *args, steps=steps, faults=faults)


def wait_for(predicate, proc, timeout=600.0, what=""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def start_train(argv, out_path):
    """`argv` (a `python -m train`) forked from the tests' preloaded pool, stdout and stderr in
    `out_path` (a forked worker handles signals as a cold process: tests/supervisor/
    test_spare_pool.py); started cold where the pool cannot run it."""
    proc = forkserver.start(argv, cpu_env(devices=1), str(out_path), REPO)
    if proc is None:
        with open(out_path, "w") as out:
            proc = start(argv, cpu_env(devices=1), stdout=out, stderr=out)
    return proc


def committed(run_dir) -> list[int]:
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def test_ctrl_c_saves_prints_resume_and_a_second_ctrl_c_stops_at_once(tmp_path):
    run_dir = tmp_path / "run"
    # each step from 2 sleeps 4 s, also in the resumed run. Each incarnation records the fault
    # (`fault_injected`) once, just before its first sleep, after its last check for a stop
    # request: a Ctrl-C sent once the record is there lands inside that step, not between a
    # step's metrics line and the check that follows it.
    slow = "slow@2:seconds=4:repeat"
    argv = cmd(run_dir, "--set", "ckpt.every=100", steps=STEPS, faults=[slow])
    err_path = tmp_path / "out0.txt"
    proc = start_train(argv, err_path)
    try:
        wait_for(lambda: events(run_dir, "fault_injected", 0), proc, what="the slow step")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err_path.read_text()
    assert code == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    (line,) = [x for x in text.splitlines() if "resume with:" in x]
    assert "interrupted at step 2" in line and f"--run-dir {run_dir}" in line, line
    (pre,) = events(run_dir, "preempted")
    assert pre["step"] == 2 and committed(run_dir) == [2]
    # resume, then two Ctrl-Cs: the second stops at once without waiting for the save
    err_path = tmp_path / "out1.txt"
    proc = start_train(argv, err_path)
    try:
        wait_for(lambda: events(run_dir, "fault_injected", 1), proc, what="the slow step")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "interrupted: saving" in err_path.read_text(), proc, what="notice")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err_path.read_text()
    assert code == 130 and "interrupted again: stopping now without saving" in text, text[-3000:]
    assert "Traceback" not in text
    assert committed(run_dir) == [2]


def test_a_ctrl_c_after_the_interrupt_save_exits_quietly(tmp_path):
    """The run saved on Ctrl-C and is exiting (130) when a second Ctrl-C comes: the process
    stops at once with 130, not with a KeyboardInterrupt traceback from the shutdown."""
    script = (
        "import os, signal, sys, time\n"
        "from jaxpar.api import run_worker\n"
        "from jaxpar.recovery.checkpoint import Preempted\n"
        "def main():\n"
        "    raise Preempted('interrupted at step 3; checkpoint saved', 3, interrupted=True,\n"
        f"                    run_dir={str(tmp_path)!r})\n"
        "code = run_worker(main)\n"
        "os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, on the way out\n"
        "time.sleep(30)\n"
        "sys.exit(code)\n"
    )
    (tmp_path / "main.py").write_text(script)
    env = cpu_env(devices=1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = run([sys.executable, str(tmp_path / "main.py")], env, timeout=120)
    assert proc.returncode == 130, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert "interrupted at step 3; checkpoint saved; resume with:" in lines[-2], lines
    assert lines[-1] == "jaxpar: interrupted again: stopping now", lines
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr


def test_disk_full_stops_with_one_line_and_keeps_committed_checkpoints(small_fs, tmp_path):
    run_dir = small_fs / "run"
    argv = cmd(run_dir, "--set", "ckpt.every=1", "--set", "ckpt.keep=100", steps=STEPS)
    proc = ok(run(argv, cpu_env(devices=1)), EXIT_NO_SPACE)
    lines = [x for x in proc.stderr.splitlines() if "ENOSPC" in x or "No space" in x]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "no space left on device (ENOSPC)" in lines[0] and str(small_fs) in lines[0]
    # the line ends the output; orbax's own tracebacks of the failed save are not printed, nor
    # the late completions of its other writes on a closed event loop
    assert proc.stderr.strip().splitlines()[-1] == lines[0], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "ERROR:absl" not in proc.stderr, proc.stderr[-4000:]
    steps = committed(run_dir)
    assert steps, "nothing committed before the disk filled"
    leftovers = [
        p for p in glob.glob(f"{run_dir}/**/*", recursive=True)
        if ("tmp" in os.path.basename(p)) and (os.path.isdir(p) or os.path.getsize(p) == 0)
    ]  # fmt: skip
    assert not leftovers, leftovers
    assert read_jsonl_counted(str(run_dir / "events.jsonl"))[1] <= 1  # at most the torn one
    # the committed checkpoints restore: continue one step on a disk with room
    roomy = tmp_path / "roomy"
    shutil.copytree(run_dir, roomy)
    ok(run(cmd(roomy, "--set", "ckpt.every=0", steps=steps[-1] + 1), cpu_env(devices=1)))
    assert events(roomy, "restore")[-1]["step"] == steps[-1]


def test_damaged_logs_and_an_injected_fault_are_named_on_the_console(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "events.jsonl", "wb") as f:  # a good start, binary garbage, a torn line
        f.write(b'{"event": "start", "time": 1.0, "incarnation": 0, "nproc": 1}\n')
        f.write(b"\x00\xff\xfe garbage \x89PNG\n" + b'{"event": "save_be')
    with open(run_dir / "metrics.jsonl", "wb") as f:
        f.write(b'{"step": 1, "loss": 9.0, "incarnation": 0, "time": 1.5}\n{"step": 2, "lo')
    proc = run(cmd(run_dir, "--set", "ckpt.every=0", steps=4, faults=["nan@3"]), cpu_env(1))
    ok(proc, EXIT_NAN)
    err = proc.stderr
    assert "mesh data=1,fsdp=1,tensor=1,pipeline=1 on 1 cpu device(s)" in err, err[-3000:]
    assert f"{run_dir}/events.jsonl: skipped 2 unreadable line(s)" in err, err[-3000:]
    assert f"{run_dir}/metrics.jsonl: skipped 1 unreadable line(s)" in err, err[-3000:]
    (nan_line,) = [x for x in err.splitlines() if "non-finite loss" in x]
    assert "(injected fault nan@3)" in nan_line
    assert "Traceback" not in err
    starts = [e for e in read_jsonl(str(run_dir / "events.jsonl")) if e["event"] == "start"]
    assert [e["incarnation"] for e in starts] == [0, 1]  # garbage did not stop the count
    new = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if m.get("incarnation") == 1]
    assert [m["step"] for m in new] == [1, 2]  # the first new record was not swallowed
