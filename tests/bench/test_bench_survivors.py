"""`jaxpar bench survivors`: what it measures from a run's trace (healthy restarts, steps rewound,
throughput kept, rejoin time), the fault schedule, how its torchft peer is installed or refused,
and the quick run end to end (jaxpar only: the test installs no torch). Timings are never
asserted, only the shape and the accounting."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from jaxpar.bench import survivors, survivors_peer
from jaxpar.bench import survivors_measure as m
from tests.support.helpers import cpu_env, ok, run


def steps_all(times_steps, groups=(0, 1, 2), examples=48.0, life=None):
    """Steps of one world where every group trains every step (today's launch)."""
    return [m.Step(t, s, groups, examples, {g: life(t) if life else 0 for g in groups})
            for t, s in times_steps]  # fmt: skip


def test_restart_all_counts_healthy_restarts_and_rewound_steps():
    # one world of 3 groups x 2 processes: a kill in group 1 at t=10 restarts all six; the job
    # restores step 8 after having trained step 10, and steps again at t=14 (incarnation 1)
    kill = m.Kill(10.0, group=1, slot=3, pid=103)
    steps = steps_all([(t, t) for t in range(1, 11)]
                      + [(14.0 + i, 9 + i) for i in range(5)],
                      life=lambda t: 0 if t <= 10 else 1)  # fmt: skip
    samples = [(5.0, {i: 100 + i for i in range(6)}), (13.0, {i: 200 + i for i in range(6)})]
    fig = m.summarize(steps, [kill], samples, per_group=2, start=1.0, seconds=18.0)
    assert fig["healthy_restarts"] == 4  # groups 0 and 2: four processes no kill hit
    assert fig["steps_rewound"] == 2  # steps 9 and 10 trained twice
    assert fig["rejoin_s"] == pytest.approx(4.0) and fig["kills"] == 1
    assert fig["throughput"] == pytest.approx(15 * 48.0 / 18.0)


def test_survivors_keep_training_and_the_group_rejoins_by_quorum():
    # groups: group 2 killed at t=5.5 sits out steps 6..8 and is back in the quorum at step 9
    steps = [m.Step(float(t), t, (0, 1, 2) if t <= 5 or t >= 9 else (0, 1), 16.0 * (3 if t <= 5 or
             t >= 9 else 2)) for t in range(1, 13)]  # fmt: skip
    kill = m.Kill(5.5, group=2, slot=4, pid=104)
    samples = [(1.0, {i: 100 + i for i in range(6)}),
               (8.0, {**{i: 100 + i for i in range(4)}, 4: 204, 5: 205})]  # fmt: skip
    fig = m.summarize(steps, [kill], samples, per_group=2, start=1.0, seconds=12.0)
    assert fig["healthy_restarts"] == 0  # only group 2's own processes have new PIDs
    assert fig["steps_rewound"] == 0
    assert fig["rejoin_s"] == pytest.approx(3.5)
    assert fig["throughput"] == pytest.approx((9 * 48 + 3 * 32) / 12.0)


def test_torchft_traces_rejoin_by_new_pid_and_a_late_kill_never_rejoins():
    # per-group streams with the group's PID as its life; group 1 healed at step 7 with PID 9
    steps = [m.Step(float(t), t, (0,), 16.0, {0: 1}) for t in range(1, 10)]
    steps += [m.Step(float(t), t, (1,), 16.0, {1: 2}) for t in range(1, 4)]
    steps += [m.Step(6.0, 7, (1,), 0.0, {1: 9}), m.Step(7.0, 8, (1,), 16.0, {1: 9})]
    kills = [m.Kill(3.5, 1, 2, 2), m.Kill(9.5, 0, 0, 1)]
    assert m.rejoin_times(steps, kills) == [pytest.approx(2.5), None]
    assert m.steps_rewound(steps, kills) == 0
    assert m.median([None, 2.0, 4.0]) == 3.0 and m.median([None]) is None
    # the recovering step trained nothing: examples are counted where the group took part
    assert m.throughput(steps, 1.0, 9.0) == pytest.approx((9 + 3 + 1) * 16.0 / 9.0)
    assert m.rate_series(steps, 1.0, 9.0, 3.0)[0] == pytest.approx(6 * 16.0 / 3.0)


def test_ready_to_step_against_the_step_time(tmp_path):
    # group 1 killed at t=5.5, ready again at 8.0 (its state then took 0.5 s), steps at t=9
    steps = [m.Step(float(t), t, (0, 1, 2) if t <= 5 or t >= 9 else (0, 2), 48.0)
             for t in range(1, 13)]  # fmt: skip
    kills = [m.Kill(5.5, 1, 2, 102)]
    readies = [m.Ready(2.0, 1), m.Ready(8.0, 1), m.Ready(8.5, 2)]  # one before the kill: not it
    assert m.ready_to_step(steps, kills, readies) == [pytest.approx(1.0)]
    assert m.ready_to_step(steps, kills, []) == [None]
    assert m.step_time(steps) == pytest.approx(1.0)
    fig = m.summarize(steps, kills, [], 1, 1.0, 12.0, readies)
    assert fig["ready_to_step_s"] == pytest.approx(1.0) and fig["step_s"] == pytest.approx(1.0)
    # from the run's events: a transfer's group_joined less its seconds; the rest is ignored
    events = [{"event": "group_joined", "group": 1, "transfer": True, "seconds": 0.5,
               "time": 8.5}, {"event": "group_joined", "group": 0, "transfer": False,
               "time": 1.0}, {"event": "group_joined", "group": "x", "transfer": True,
               "time": 3.0}]  # fmt: skip
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    run = survivors.JaxparRun.__new__(survivors.JaxparRun)
    run.run_dir = str(tmp_path)
    assert run.readies() == [m.Ready(8.0, 1)]


def test_a_group_back_within_the_step_it_was_killed_in_rejoins_in_its_new_life(tmp_path):
    # group 1 killed at t=5.5 while step index 5 waits; it is back, with the peer's state, for
    # that same step: no metrics line lacks it, yet its rejoin is the line of step index 5
    events = [{"event": "group_joined", "group": g, "step": 0, "transfer": False, "time": 0.5}
              for g in (0, 1)]  # fmt: skip
    events.append({"event": "group_joined", "group": 1, "step": 5, "transfer": True,
                   "seconds": 0.1, "time": 5.9})  # fmt: skip
    lines = [{"step": n, "loss": 1.0, "quorum": [0, 1], "time": float(n)} for n in range(1, 9)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    run = survivors.JaxparRun.__new__(survivors.JaxparRun)
    run.run_dir, run.groups, run.batch = str(tmp_path), True, 32
    run.p = {"groups": 2}
    steps = run.steps()
    assert [s.lives for s in steps[4:7]] == [{0: 1, 1: 1}, {0: 1, 1: 2}, {0: 1, 1: 2}]
    kills = [m.Kill(5.5, 1, 1, 101)]
    assert m.rejoin_times(steps, kills) == [pytest.approx(0.5)]
    assert m.ready_to_step(steps, kills, run.readies()) == [pytest.approx(0.2)]


def test_a_restart_after_no_kill_is_healthy_and_a_missing_slot_keeps_its_pid():
    samples = [(1.0, {0: 10, 1: 11}), (2.0, {0: 10}), (3.0, {0: 10, 1: 11}), (4.0, {0: 20, 1: 11})]
    found = m.restarts(samples, per_group=1)
    assert found == [m.Restart(4.0, 0, 0)]
    assert m.healthy_restarts(found, []) == 1
    assert m.healthy_restarts(found, [m.Kill(3.5, 0, 0, 10)]) == 0
    assert m.healthy_restarts(found, [m.Kill(3.5, 1, 1, 11)]) == 1


def test_schedule_kills_every_period_inside_the_window():
    assert m.schedule(100.0, 60.0, 120.0) == [160.0]
    assert m.schedule(100.0, 30.0, 120.0) == [130.0, 160.0, 190.0]
    assert m.schedule(100.0, None, 120.0) == []


def test_kill_random_kills_a_live_child_and_waits_out_a_stale_pid():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        calls = []

        def pids():  # a stale PID for the first three looks, then the live one
            calls.append(1)
            return {0: 999_999_999 if len(calls) <= 3 else child.pid}

        k = m.kill_random(random.Random(0), 1, 1, pids, lambda: [os.getpid()])
        assert len(calls) > 3
        assert k.pid == child.pid and k.slot == 0 and k.group == 0
        assert child.wait(timeout=30) == -9
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_quick_split_halves_one_job_into_baseline_and_fault_run():
    trace = {"steps": [], "kills": [m.Kill(12.0, 0, 0, 1)], "start": 0.0,
             "samples": [(1.0, {0: 1}), (13.0, {0: 2})]}  # fmt: skip
    base, fault, half = survivors.quick_split(trace, 24.0)
    assert half == 12.0 and base["kills"] == [] and base["samples"] == [(1.0, {0: 1})]
    assert fault["start"] == 12.0 and fault["kills"] == trace["kills"]


def test_peer_takes_a_cpu_wheel_when_the_index_torch_brings_gpu_packages(tmp_path, monkeypatch):
    report = {"install": [{"metadata": {"name": n}} for n in ("torch", "nvidia-cublas", "sympy",
                                                              "cuda-bindings")]}  # fmt: skip
    assert survivors_peer.gpu_packages(report) == ["cuda-bindings", "nvidia-cublas"]
    assert survivors_peer.gpu_packages({"install": [{"metadata": {"name": "torch"}}]}) == []
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = os.uname().machine
    for v in ("2.1.0", "2.3.0"):
        (tmp_path / f"torch-{v}+cpu-{tag}-{tag}-manylinux_2_28_{machine}.whl").write_bytes(b"")
    (tmp_path / f"torch-2.9.0-{tag}-{tag}-manylinux_2_28_{machine}.whl").write_bytes(b"")  # GPU
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    config = f"global.find-links='{tmp_path}'\n:env:.find-links='file:///nowhere'\n"
    assert survivors_peer.find_links(config) == [str(tmp_path), "/nowhere"]
    wheel = survivors_peer.cpu_wheel(survivors_peer.find_links(config))
    assert wheel is not None and os.path.basename(wheel).startswith("torch-2.3.0+cpu-")
    assert survivors_peer.cpu_wheel([str(tmp_path / "empty")]) is None


def test_peer_unavailable_says_why_and_the_jaxpar_side_stands(tmp_path, monkeypatch):
    def no_env():
        raise survivors_peer.PeerUnavailable("the package index's torch brings 3 GPU packages")

    monkeypatch.setattr(survivors_peer, "ensure", no_env)
    p = {**survivors.FULL, "peer": True}
    tf, traces = survivors.torchft_side(p, str(tmp_path))
    assert tf == {"status": "unavailable",
                  "reason": "the package index's torch brings 3 GPU packages"}  # fmt: skip
    assert traces == {}
    base = {"path": "none", "period_s": None, "kills": 0, "throughput": 10.0,
            "healthy_restarts": 0, "steps_rewound": 0, "rejoin_s": None}  # fmt: skip
    text = survivors._table(base, [], tf)
    assert "| jaxpar | none | no faults | 0 | 10.0 | 100 % | 0 | 0 | - | - / - |" in text
    assert text.endswith("torchft: unavailable: the package index's torch brings 3 GPU packages")
    assert survivors.torchft_side({**p, "peer": False}, str(tmp_path))[0]["status"] == "skipped"


def test_peer_reuses_an_installed_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_BENCH_PEERS", str(tmp_path))
    venv = tmp_path / f"torchft-{survivors_peer.TORCHFT}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "torchft_lighthouse").write_text("")
    (venv / "ready.json").write_text(json.dumps({"torch": "2.0+cpu", "torchft": "0.2.0"}))
    assert survivors_peer.ensure() == (str(venv), {"torch": "2.0+cpu", "torchft": "0.2.0",
                                                   "installed_s": 0.0})  # fmt: skip


def test_torchft_step_lines_are_read_untrusted(tmp_path):
    out = tmp_path
    (out / "steps-g0.jsonl").write_text(
        json.dumps({"t": 1.0, "step": 1, "committed": True, "participating": True, "pid": 5})
        + "\nnot json\n[1]\n"
        + json.dumps({"t": 2.0, "step": 2, "committed": False, "participating": True, "pid": 5})
        + "\n"
    )
    (out / "pid-g0-r0").write_text("5")
    (out / "pid-g0-r1").write_text("garbage")
    job = survivors_peer.Job.__new__(survivors_peer.Job)
    job.out, job.groups, job.per_group, job.batch = str(out), 1, 2, 16
    assert job.pids() == {0: 5}
    assert [(s.step, s.examples, s.lives) for s in job.steps()] == [(1, 16, {0: 5}),
                                                                   (2, 0.0, {0: 5})]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_survivors_quick(tmp_path):
    # one job of 3 groups x 1 process, a worker SIGKILLed halfway; jaxpar only (no torch here)
    args = [sys.executable, "-m", "jaxpar.cli", "bench", "survivors", "--quick", "--out",
            str(tmp_path)]  # fmt: skip
    t0 = time.time()
    text = ok(run(args, env=cpu_env(devices=None), timeout=800, merge=True, cwd=tmp_path)).stdout
    assert "| framework | restart path |" in text and "torchft: skipped" in text
    with open(tmp_path / "survivors.json") as f:
        r = json.load(f)
    assert r["suite"] == "survivors" and r["groups"] == 3 and r["nproc"] == 3
    assert r["torchft"]["status"] == "skipped"
    base, (fault,) = r["baseline"], r["runs"]
    assert base["kills"] == 0 and base["throughput"] > 0 and base["healthy_restarts"] == 0
    assert fault["kills"] == 1 and fault["period_s"] == 12.0 and fault["path"] == "standby"
    assert fault["throughput_kept"] == pytest.approx(fault["throughput"] / base["throughput"])
    for key in ("healthy_restarts", "steps_rewound", "rejoin_s", "rejoins_s", "restarted_by"):
        assert key in fault
    assert (tmp_path / "survivors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the run's records outlive it (its folder is deleted): what happened can be read after
    assert r["records"] == str(tmp_path / "survivors-runs")
    events = (tmp_path / "survivors-runs" / "quick" / "events.jsonl").read_text()
    assert '"event": "group_joined"' in events
    assert not list((tmp_path / "survivors-runs").rglob("checkpoints"))
    assert time.time() - t0 < 800


def test_the_runs_records_are_kept_without_their_checkpoints(tmp_path):
    root = tmp_path / "runs"
    for name in ("baseline", "standby-60s"):
        run = root / name
        (run / "checkpoints" / "7").mkdir(parents=True)
        (run / "checkpoints" / "7" / "state").write_bytes(b"x" * 1000)
        (run / "logs").mkdir()
        (run / "logs" / "group1-proc0.log").write_text("Traceback ...\n")
        (run / "events.jsonl").write_text('{"event": "start"}\n')
        (run / "launch.log").write_text("jaxpar launch ...\n")
        (run / "heartbeats").mkdir()
    (root / "compiled").mkdir()  # the runs' shared program cache: not a run
    (root / "compiled" / "train_step-p0.bin").write_bytes(b"\0" * 100)
    with open(root / "baseline" / "huge.log", "wb") as f:
        f.truncate(survivors.KEPT_FILE_MAX + 1)  # sparse: no bytes written
    dest = tmp_path / "out" / "survivors-runs"
    assert survivors.keep_records(str(root), str(dest)) == str(dest)
    assert sorted(p.name for p in dest.iterdir()) == ["baseline", "standby-60s"]
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == [f"{n}/{f}" for n in ("baseline", "standby-60s")
                    for f in ("events.jsonl", "launch.log", "logs/group1-proc0.log")]  # fmt: skip
    assert survivors.keep_records(str(tmp_path / "none"), str(dest)) is None
