"""`jaxpar bench recovery --quick --paths standby,standby-hang`: real 2-process supervised jobs
restarted from a standby group (`--standby`) after a SIGKILL and after a hang, and a goodput run
of the standby path under timed kills. Asserts the shape of recovery.json and how the restarts
came up, never their timings. (The cold and spares paths are the same measurement of other
launch options; their restarts are the supervisor tests'.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.bench import recovery
from tests.support.helpers import XLA_TEST_FLAGS, cpu_env, ok, run
from tests.support.launch_util import run_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_bench_recovery_quick(tmp_path):
    args = [
        sys.executable,
        "-m",
        "jaxpar.cli",
        "bench",
        "recovery",
        "--quick",
        # the standby group after a kill and after a hang: the cold and spares paths
        # (persistent and local tiers) are the supervisor tests' and the local tier's
        "--paths",
        "standby,standby-hang",
        "--out",
        str(tmp_path),
    ]
    # from outside the checkout, as an installed user runs it (its jobs must not need `train`);
    # the tests' XLA flags reach the jobs' workers (fast compiles), their device count does not
    text = ok(run(args, env=cpu_env(devices=None), timeout=1700, merge=True, cwd=tmp_path)).stdout
    assert "| restart path |" in text and "| failure every |" in text
    with open(os.path.join(tmp_path, "recovery.json")) as f:
        r = json.load(f)
    assert r["suite"] == "recovery" and r["nproc"] == 2 and r["devices_per_proc"] == 2  # quick: 2
    assert r["xla_flags"] == XLA_TEST_FLAGS
    standby, hang = r["recovery"]
    modes = ("standby", "standby-hang")
    assert tuple(m["mode"] for m in r["recovery"]) == modes and r["paths"] == list(modes)
    assert r["torchrun"] is None and r["local_over_torchrun"] is None  # quick: jaxpar only
    for mode in r["recovery"]:
        assert mode["exit_code"] == 0 and mode["incidents"] == 1 and mode["steady_step_s"] > 0
        assert mode["recovery_s"] > 0 and mode["recovery_s"] >= mode["init_s"] > 0
    # the standby paths came up with their programs loaded
    for mode in (standby, hang):
        assert mode["warm_starts"] == 1 and mode["cache_hits"] >= 2
    assert standby["paths"] == ["standby"]
    assert standby["restore_tiers"] == ["local"] and standby["lost_steps_each"][0] <= 1
    assert r["standby_s"] == standby["recovery_s"]
    # the waiting standby group's memory was sampled (2 processes with jax loaded: > 100 MB)
    assert r["standby_peak_rss_mb"] == standby["standby_peak_rss_mb"] > 100
    assert standby["group_peak_rss_mb"] > 100 and "memory: a waiting standby group" in text
    # a hung worker: found by its heartbeats after the hang timeout, then the standby goes
    assert hang["paths"] == ["standby"] and hang["restore_tiers"] == ["local"]
    assert hang["causes"] == ["hang"] and standby["causes"] == ["signal"]
    assert (
        hang["detect_s"] >= recovery.HANG_TIMEOUT_S
        and r["standby_hang_s"] == hang["recovery_s"] >= hang["detect_s"]
    )
    assert r["cold_over_local"] is None  # neither the cold nor the local-tier path ran
    (g,) = r["goodput"]  # quick: the standby path only
    assert g["mode"] == "standby" and g["kills"] == 1 and g["restarts"] >= 1
    assert 0 < g["goodput"] <= g["goodput_steady"] <= 1
    assert g["time_lost_s"]["startup"] > 0 and g["time_lost_s"]["signal"] > 0
    assert g["paths"] and set(g["paths"]) <= {"standby", "spares"}


def test_torchrun_peer_figures_from_its_records(tmp_path):
    """The peer's recovery per kill: its restarted group's first step minus the SIGKILL, split at
    the records of the restarted start; steps lost back to the checkpoint it restored."""
    from jaxpar.bench import recovery_peer

    def lines(name, recs):
        (tmp_path / name).write_text("".join(json.dumps(x) + "\n" for x in recs))

    lines("kills.jsonl", [{"time": 100.0, "step": 8, "restart": 0, "rank": 1}])
    lines("starts.jsonl", [
        {"restart": 0, "begin": 0.0, "imported": 1.0, "pg": 1.5, "built": 2.0, "restored": 2.0,
         "step": 0},
        {"restart": 1, "begin": 101.0, "imported": 104.0, "pg": 104.5, "built": 105.0,
         "restored": 106.0, "step": 5},
    ])  # fmt: skip
    steps = [{"time": 10.0 + s, "step": s, "restart": 0} for s in range(1, 9)]
    steps += [{"time": 107.0 + s, "step": 6 + s, "restart": 1} for s in range(3)]
    lines("steps.jsonl", steps)
    f = recovery_peer.figures(str(tmp_path), 0, every=5)
    assert f["kills"] == 1 and len(f["recoveries"]) == 1
    assert (f["recovery_s"], f["to_start_s"], f["init_s"]) == (7.0, 1.0, 4.0)
    assert (f["restore_s"], f["first_step_s"], f["lost_steps"]) == (1.0, 1.0, 3)
    assert f["steady_step_s"] == 1.0


def test_a_sigterm_stops_the_jobs_the_bench_started(tmp_path):
    """`jaxpar bench recovery` stopped with SIGTERM while its job trains: the bench exits
    (128 + 15) and takes the `jaxpar launch` job it started, which runs in a session of its own,
    with it (supervisor, pool and workers), instead of leaving it running."""
    env = {**cpu_env(devices=None), "TMPDIR": str(tmp_path)}  # the bench's jobs under tmp_path
    cmd = [sys.executable, "-m", "jaxpar.cli", "bench", "recovery", "--quick", "--paths",
           "local", "--out", str(tmp_path / "out")]  # fmt: skip
    with open(tmp_path / "bench.log", "wb") as log:
        bench = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    run_dir, job = None, []
    try:
        deadline = time.time() + 600
        while not job and time.time() < deadline and bench.poll() is None:
            time.sleep(0.2)
            found = list(tmp_path.glob("jaxpar-bench-recovery-*/recovery-local"))
            events = found[0] / "events.jsonl" if found else None
            if events is not None and events.exists() and '"event": "start"' in events.read_text():
                run_dir = found[0]  # its workers have started
                job = run_processes(run_dir)
        assert job, (tmp_path / "bench.log").read_text()[-3000:]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=120) == 128 + signal.SIGTERM
        deadline = time.time() + 60
        while run_processes(run_dir) and time.time() < deadline:
            time.sleep(0.2)
        assert run_processes(run_dir) == [], "the bench's job outlived it"
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        for p in run_processes(run_dir) if run_dir else []:
            p.kill()
