"""deploy/slurm/jaxpar.sbatch on a real two-node SLURM cluster (tests/support/slurm_cluster.py).

    python -m pytest tests/cluster -m slurm

gpt_tiny (made smaller, as in the multiprocess tests) on 2 nodes x 2 workers x 2 CPU devices:
an uninterrupted `sbatch` run is the reference; a worker SIGKILLed mid-run is restarted inside the
allocation; `scancel --signal=TERM` makes the job save at a step every process agrees on, exit 42,
requeue itself and finish; all of them end with the reference's losses, step by step. Without the
supervisor, `srun -n 4 python -m train` finds its peers through jax's SLURM detection.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support.helpers import REPO, SMALL, cpu_env, events, losses

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1500)]

SCRIPT = str(REPO / "deploy" / "slurm" / "jaxpar.sbatch")
STEPS, EVERY = 12, 4
TRAIN = ["--recipe", "gpt_tiny", "--steps", str(STEPS), "--set", f"ckpt.every={EVERY}", *SMALL]
JOB_TIMEOUT = 900  # a loaded 2-core machine compiles slowly; the jobs themselves take ~1-2 min
# No persistent compilation cache (cache=False): it serves process 0 only, which then waits in
# gloo's first rendezvous (30 s) for peers still compiling on a loaded machine, and fails.


def job_env(run_dir, launch_args: str = "") -> dict[str, str]:
    """The submitting shell's environment: the script's CPU parameters, nothing edited."""
    env = cpu_env(devices=None, cache=False)
    env.update({
        "SBATCH_GPUS_PER_NODE": "0", "NPROC_PER_NODE": "2", "DEVICES_PER_PROC": "2",
        "RUN_DIR": str(run_dir), "PYTHON": sys.executable, "JAXPAR_LAUNCH_ARGS": launch_args,
    })  # fmt: skip
    return env


def submit(slurm, run_dir, *train_args: str, launch_args: str = "") -> int:
    """`launch_args`: the script's JAXPAR_LAUNCH_ARGS, e.g. --no-spares for a job whose group is
    never restarted inside the allocation (its spares would only cost CPU)."""
    out = f"{run_dir}.out"
    return slurm.sbatch(["--output", out, SCRIPT, *TRAIN, *train_args],
                        env=job_env(run_dir, launch_args), cwd=REPO)  # fmt: skip


def finished(slurm, job: int, run_dir, timeout: float = JOB_TIMEOUT) -> dict[str, str]:
    """Wait for the job's end; assert it completed (else show its output and the daemons' logs)."""
    try:
        info = slurm.wait(job, timeout=timeout)
    finally:
        if slurm.job(job).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"):
            slurm.run(["scancel", "--signal=KILL", str(job)])
    output = _read(f"{run_dir}.out")
    assert info["JobState"] == "COMPLETED", f"{info}\n{output[-4000:]}\n{slurm.logs()}"
    return info


def _read(path) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    """An uninterrupted `sbatch` run: (run dir, job info, seconds)."""
    run_dir = tmp_path_factory.mktemp("sbatch") / "reference"
    t0 = time.time()
    job = submit(slurm, run_dir, launch_args="--no-spares")
    info = finished(slurm, job, run_dir)
    return run_dir, info, time.time() - t0


def test_sbatch_trains_gpt_tiny_on_two_nodes(reference):
    run_dir, info, seconds = reference
    print(f"sbatch 2x2 to the end: {seconds:.0f}s")
    assert info["NodeList"] == "h[0-1]" and info["Restarts"] == "0"
    (launch,) = events(run_dir, "launch")
    assert (launch["nnodes"], launch["nproc"], launch["devices_per_proc"]) == (2, 4, 2)
    (start,) = events(run_dir, "start")
    assert start["nproc"] == 4 and start["mesh"].startswith("data=8")
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"] == 0
    assert "joined the leader at h0:29400" in _read(f"{run_dir}.out")


def test_sbatch_worker_killed_restarts_inside_allocation(slurm, reference, tmp_path):
    run_dir = tmp_path / "killed"
    t0 = time.time()
    job = submit(slurm, run_dir, "--fault", "kill@6:process=3")  # node 1's second worker
    info = finished(slurm, job, run_dir)
    print(f"sbatch, worker SIGKILLed at step 6: {time.time() - t0:.0f}s")
    assert info["Restarts"] == "0"  # the allocation survived: jaxpar restarted the group in it
    (f,) = events(run_dir, "failure")
    assert (f["cause"], f["process"], f["signal"], f["step"]) == ("signal", 3, "SIGKILL", 6)
    assert len(events(run_dir, "restart")) == 1
    (restore,) = events(run_dir, "restore")
    assert restore["step"] == 4
    assert losses(run_dir) == losses(reference[0])


def test_sbatch_scancel_term_saves_requeues_and_finishes(slurm, reference, tmp_path):
    run_dir = tmp_path / "preempted"
    t0 = time.time()
    # process 0 sleeps 0.5 s per step so that the notice lands mid-run on any machine
    # (no spares: the notice ends the job, and the requeued job starts its group cold)
    job = submit(
        slurm, run_dir, "--fault", "slow@2:process=0:seconds=0.5", launch_args="--no-spares"
    )
    deadline = time.time() + JOB_TIMEOUT
    while max(losses(run_dir), default=0) < 2:
        assert time.time() < deadline, f"no step 2 in {JOB_TIMEOUT}s\n{_read(f'{run_dir}.out')}"
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), _read(
            f"{run_dir}.out"
        )
        time.sleep(0.2)
    proc = slurm.run(["scancel", "--signal=TERM", str(job)])
    assert proc.returncode == 0, proc.stderr
    info = finished(slurm, job, run_dir)
    print(f"sbatch, scancel --signal=TERM, requeue, finish: {time.time() - t0:.0f}s")
    assert info["Restarts"] == "1"  # requeued once by the script
    output = _read(f"{run_dir}.out")
    assert "requeueing job" in output and "restart 1)" in output
    preempted = events(run_dir, "preempted")
    (step,) = {e["step"] for e in preempted}  # every process saved at the same step
    assert sorted(e["process"] for e in preempted) == [0, 1, 2, 3]
    assert step < STEPS
    saved = [e["step"] for e in events(run_dir, "save_end", incarnation=0)]
    assert saved[-1] == step  # the preemption save, after the periodic ones
    (restore,) = events(run_dir, "restore")
    assert restore["step"] == step and restore["incarnation"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert losses(run_dir) == losses(reference[0])


def test_srun_without_supervisor_uses_jax_slurm_detection(slurm, reference, tmp_path):
    run_dir = tmp_path / "srun"
    env = cpu_env(devices=2, cache=False)  # 2 CPU devices per task, 8 in all
    # jax.distributed's timeouts (and the after-compile barrier): a loaded 2-core machine has
    # taken over 5 minutes to compile one process's programs
    env["JAXPAR_COLLECTIVE_TIMEOUT_S"] = str(JOB_TIMEOUT)
    t0 = time.time()
    cmd = ["srun", "-N", "2", "-n", "4", "--kill-on-bad-exit=1", sys.executable, "-m", "train",
           "--run-dir", str(run_dir), "--no-progress", *TRAIN]  # fmt: skip
    try:
        proc = slurm.run(cmd, env=env, timeout=JOB_TIMEOUT, cwd=REPO)
    except subprocess.TimeoutExpired:
        slurm.run(["scancel", "--name", "python", "--signal=KILL"])
        raise
    print(f"srun -n 4 python -m train: {time.time() - t0:.0f}s")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (start,) = events(run_dir, "start")
    assert start["nproc"] == 4 and start["mesh"].startswith("data=8")
    assert losses(run_dir) == losses(reference[0])  # the same 8 devices, the same steps
    # no jaxpar launch: process 0 writes the summary, and nothing was supervised
    assert events(run_dir, "launch") == []
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
