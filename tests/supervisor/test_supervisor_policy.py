"""The supervisor's decisions without processes: causes, backoff, crash loops, shrink arithmetic,
command rewriting, stragglers, heartbeats, worker environment, cluster detection and the ledger."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from jaxpar import supervisor
from jaxpar.rundir import goodput
from jaxpar.worker import bootstrap


def test_exit_causes_and_root():
    assert supervisor.classify_exit(-9) == "signal"
    assert supervisor.classify_exit(bootstrap.EXIT_COLLECTIVE) == "collective"
    assert supervisor.classify_exit(bootstrap.EXIT_NAN) == "nan"
    assert supervisor.classify_exit(1) == "exit"
    # the killed process is the root, not the survivors that saw the collective error
    assert supervisor.root_exit([(2, 43), (0, -9), (3, 43)]) == (0, -9)
    assert supervisor.root_exit([(1, -signal.SIGABRT), (2, 1)]) == (2, 1)
    assert supervisor.root_exit([(3, 43), (1, 43)]) == (3, 43)  # first seen among equals
    assert supervisor.root_exit([(0, 0), (1, 42)]) == (1, 42)


def test_backoff_immediate_first_then_exponential_capped():
    delays = [supervisor.backoff_s(k, 1.0, 10.0) for k in range(1, 8)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_crash_loop_same_failure_same_step():
    c = supervisor.CrashLoop(3)
    assert not c.record("signal", 8)
    assert not c.record("signal", 8)
    assert c.record("signal", 8)
    c = supervisor.CrashLoop(3)
    assert not c.record("signal", 8)
    assert not c.record("signal", 9)  # progress moved: not a loop
    assert not c.record("signal", 9)
    assert not c.record("exit", 9)
    nan = supervisor.CrashLoop(3)
    assert not nan.record("nan", 6)
    assert nan.record("nan", 6)  # the same NaN at the same step twice stops the run


def test_shrink_gpt_tiny_4x2_loses_one():
    # batch 32 on 4 x 2 devices; 3 x 2 = 6 does not divide 32, 2 x 2 = 4 does
    plan = supervisor.shrink_plan(
        3, 2, 32, {"data": 8, "fsdp": 1, "tensor": 1, "pipeline": 1}, 1, 1
    )
    assert plan == {
        "nproc": 2,
        "mesh": {"data": 4, "fsdp": 1, "tensor": 1, "pipeline": 1},
        "microbatches": 2,  # each device keeps 4 rows per microbatch
    }
    assert supervisor.mesh_text(plan["mesh"]) == "data=4,fsdp=1,tensor=1,pipeline=1"


def test_shrink_respects_min_nproc_and_other_axes():
    assert supervisor.shrink_plan(3, 2, 32, {"data": 8}, 1, min_nproc=3) is None
    plan = supervisor.shrink_plan(
        3, 2, 32, {"data": 4, "fsdp": 1, "tensor": 2, "pipeline": 1}, 1, 1
    )
    assert plan["nproc"] == 2
    assert plan["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2, "pipeline": 1}
    assert plan["microbatches"] == 2
    plan = supervisor.shrink_plan(5, 1, 48, {"data": 6}, 1, 1)
    assert plan["nproc"] == 4 and plan["mesh"]["data"] == 4 and 48 % (4 * plan["microbatches"]) == 0
    plan = supervisor.shrink_plan(3, 2, 32, {"data": 2, "fsdp": 4}, 1, 1)
    assert plan["mesh"]["data"] * plan["mesh"]["fsdp"] == 4


def test_shrunk_layout_reaches_workers_through_the_environment():
    env = supervisor.worker_env(
        {bootstrap.ENV_MESH: "data=8"}, coordinator="127.0.0.1:1", bind="127.0.0.1:1", nproc=2,
        process_id=0, local_rank=0, devices_per_proc=2, run_dir="/r", incarnation=2, faults=[],
        heartbeat_timeout=9, collective_timeout=9,
        layout={"mesh": "data=4,fsdp=1,tensor=1,pipeline=1", "microbatches": 2},
    )  # fmt: skip
    assert env[bootstrap.ENV_MESH] == "data=4,fsdp=1,tensor=1,pipeline=1"
    assert env[bootstrap.ENV_MICROBATCHES] == "2"
    plain = supervisor.worker_env(
        {bootstrap.ENV_MESH: "data=8"}, coordinator="127.0.0.1:1", bind="127.0.0.1:1", nproc=2,
        process_id=0, local_rank=0, devices_per_proc=2, run_dir="/r", incarnation=0, faults=[],
        heartbeat_timeout=9, collective_timeout=9,
    )  # fmt: skip
    assert bootstrap.ENV_MESH not in plain  # an inherited layout is never passed on


def test_training_loop_applies_the_supervised_layout(monkeypatch):
    from jaxpar.config import resolve_recipe
    from jaxpar.engine.mesh import MeshSpec
    from jaxpar.engine.rules import Preset
    from jaxpar.worker.training import supervised_layout

    cfg = resolve_recipe("gpt_tiny")
    preset = Preset(MeshSpec.parse("data=8"), description="dp8")
    assert supervised_layout(cfg, preset) == (cfg, preset)
    monkeypatch.setenv(bootstrap.ENV_MESH, "data=2,fsdp=2")
    monkeypatch.setenv(bootstrap.ENV_MICROBATCHES, "3")
    cfg2, preset2 = supervised_layout(cfg, preset)
    assert preset2.mesh == MeshSpec(data=2, fsdp=2) and preset2.params == preset.params
    assert cfg2.train.microbatches == 3 and cfg2.model == cfg.model


def _recent(start_t, period, lag, n=8, first=1):
    return [[first + i, start_t + i * period + lag] for i in range(n)]


def test_stragglers_by_arrival_lag():
    recent = {p: _recent(100.0, 0.8, 0.0) for p in range(4)}
    assert supervisor.find_stragglers(recent, 2.0) == []
    recent[2] = _recent(100.0, 0.8, 0.6)  # own work 0.8 s per step, the others 0.2 s
    found = supervisor.find_stragglers(recent, 2.0)
    assert [s["process"] for s in found] == [2]
    assert found[0]["lag_s"] == pytest.approx(0.6)
    assert found[0]["factor"] == pytest.approx(4.0)
    assert supervisor.find_stragglers({0: _recent(0, 1, 0), 1: _recent(0, 1, 0.3)}, 2.0) == []


def test_heartbeat_file_and_stalest(tmp_path, monkeypatch):
    monkeypatch.setenv(bootstrap.ENV_PROCESS_ID, "1")
    monkeypatch.setenv(bootstrap.ENV_INCARNATION, "3")
    bootstrap._state["hb_dir"] = None
    bootstrap.heartbeat(str(tmp_path), 4)
    bootstrap.heartbeat(str(tmp_path), 5)
    rec = json.loads((tmp_path / "heartbeats" / "proc1.json").read_text())
    assert rec["step"] == 5 and rec["incarnation"] == 3 and rec["pid"] == os.getpid()
    assert [s for s, _ in rec["recent"]] == [4, 5]
    assert os.listdir(tmp_path / "heartbeats") == ["proc1.json"]

    hb = supervisor.Heartbeats(str(tmp_path), 2, 3)
    monkeypatch.setenv(bootstrap.ENV_PROCESS_ID, "0")
    bootstrap._state["hb_dir"] = None
    bootstrap.heartbeat(str(tmp_path), 6)
    hb.update(now=10.0)
    # process 1 arrived at step 5 after step 4 (two arrivals in its own history): it has
    # completed a step, although the supervisor saw none advance
    assert hb.stepping_since == 10.0
    bootstrap.heartbeat(str(tmp_path), 7)
    hb.update(now=12.0)
    assert hb.stalest(now=20.0) == (1, 10.0)  # process 1 stuck at 5 since it was first seen
    assert hb.max_step() == 7
    stale = supervisor.Heartbeats(str(tmp_path), 2, incarnation=4)
    stale.update(now=1.0)
    assert stale.last == {}  # another incarnation's heartbeats are ignored


def test_hang_in_the_first_steps_is_detected(tmp_path, monkeypatch):
    """Workers several steps ahead of the supervisor's first read, then stuck: a hang once the
    hang timeout passes, blaming the process at the lowest step."""
    monkeypatch.setenv(bootstrap.ENV_INCARNATION, "0")
    for p, last in ((0, 3), (1, 2)):
        monkeypatch.setenv(bootstrap.ENV_PROCESS_ID, str(p))
        bootstrap._state["hb_dir"] = None
        for step in range(last + 1):
            bootstrap.heartbeat(str(tmp_path), step)
    mon = supervisor.Monitor(str(tmp_path), 2, 0, [])
    assert os.listdir(tmp_path / "heartbeats") == []  # the monitor clears old heartbeats
    for p, last in ((0, 3), (1, 2)):
        monkeypatch.setenv(bootstrap.ENV_PROCESS_ID, str(p))
        bootstrap._state["hb_dir"] = None
        for step in range(last + 1):
            bootstrap.heartbeat(str(tmp_path), step)
    mon.hb.update(now=100.0)
    assert mon.hang(101.0, 99.0, 1.5, 600.0, auto=False, stopped=[]) is None
    out = mon.hang(102.0, 99.0, 1.5, 600.0, auto=False, stopped=[])
    assert (out.cause, out.process, out.step) == ("hang", 1, 4)
    # a process seen stopped (SIGSTOP) is the one blamed, wherever the heartbeats point
    assert mon.hang(102.0, 99.0, 1.5, 600.0, auto=False, stopped=[0]).process == 0
    # nobody ever completes a step: only the start-up timeout applies
    cold = supervisor.Monitor(str(tmp_path), 2, 5, [])
    assert cold.hang(650.0, 99.0, 1.5, 600.0, auto=False, stopped=[]) is None
    late = cold.hang(700.0, 99.0, 1.5, 600.0, auto=False, stopped=[])
    assert late.cause == "hang" and "start-up timeout" in late.detail


def test_worker_env():
    env = supervisor.worker_env(
        {"XLA_FLAGS": "--xla_dump_to=/tmp/d", bootstrap.ENV_FAULTS: "kill@3"},
        coordinator="127.0.0.1:1234", bind="127.0.0.1:1234", nproc=4, process_id=2,
        local_rank=2, devices_per_proc=2, run_dir="/r", incarnation=1, faults=["hang@5"],
        heartbeat_timeout=90, collective_timeout=90,
    )  # fmt: skip
    assert env[bootstrap.ENV_COORDINATOR] == "127.0.0.1:1234"
    assert env[bootstrap.ENV_PROCESS_ID] == "2" and env[bootstrap.ENV_NUM_PROCESSES] == "4"
    assert env[bootstrap.ENV_INCARNATION] == "1" and env[bootstrap.ENV_SUPERVISED] == "1"
    assert env[bootstrap.ENV_FAULTS] == "kill@3;hang@5"
    assert env["XLA_FLAGS"].startswith("--xla_dump_to=/tmp/d ")
    assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"]
    # XLA silently ignores every flag after a token that is not `--name[=value]`, so one stray
    # word would disable the collective timeout the worker appends later.
    assert all(f.startswith("--xla_") for f in env["XLA_FLAGS"].split()), env["XLA_FLAGS"]
    assert env["JAX_LOCAL_DEVICE_IDS"] == "4,5"
    assert env[bootstrap.ENV_COLLECTIVE_TIMEOUT] == "90"


def test_detect_cluster():
    assert bootstrap.detect_cluster({}) is None
    assert bootstrap.detect_cluster({"JAXPAR_COORDINATOR": "h:1", "JAXPAR_PROCESS_ID": "0"}) == (
        "explicit"
    )
    k8s = {"JAXPAR_COORDINATOR": "h:1", "JAXPAR_NUM_PROCESSES": "2", "JOB_COMPLETION_INDEX": "1"}
    assert bootstrap.detect_cluster(k8s) == "k8s"
    slurm = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert bootstrap.detect_cluster(slurm) == "slurm"
    assert bootstrap.detect_cluster({**slurm, "SLURM_NTASKS": "1"}) is None  # one task: no cluster
    ompi = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://127.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert bootstrap.detect_cluster(ompi) == "ompi"


def test_guard_reraises_outside_a_distributed_job():
    with pytest.raises(RuntimeError):
        with bootstrap.guard():
            raise RuntimeError("boom")
    assert bootstrap.run_worker(lambda: None) == 0


def test_collective_errors_recognised_whatever_their_python_type():
    import jax

    assert bootstrap.is_collective_error(jax.errors.JaxRuntimeError("INTERNAL: anything"))
    # one device per process: jax raises gloo's failure as a ValueError
    gloo = (
        "UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:547] Connection closed by peer"
    )
    assert bootstrap.is_collective_error(ValueError(gloo))
    assert bootstrap.is_collective_error(RuntimeError("UNAVAILABLE: coordination service is gone"))
    # the user's own errors stay errors (exit 1, the root cause)
    assert not bootstrap.is_collective_error(ValueError("batch 6 is not divisible by data=4"))
    assert not bootstrap.is_collective_error(RuntimeError("INTERNAL: loss function failed"))
    assert not bootstrap.is_collective_error(KeyError("Gloo"))


def test_event_tail_skips_torn_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n')
    tail = supervisor.EventTail(str(path))
    with open(path, "a") as f:
        f.write('{"event": "b"}\n{"event": "c"')
    assert [e["event"] for e in tail.read()] == ["b"]
    with open(path, "a") as f:
        f.write("}\n")
    assert [e["event"] for e in tail.read()] == ["c"]


def _ev(t, name, inc, **kw):
    return {"event": name, "time": t, "incarnation": inc, **kw}


def test_ledger_recovery_and_lost_steps():
    events = [
        _ev(0.0, "launch", 0),
        _ev(0.1, "group_started", 0),
        _ev(5.0, "start", 0),
        _ev(8.0, "compiled", 0),
        _ev(13.0, "fault_injected", 0, kind="kill", spec="kill@8:process=1", process=1, step=8),
        _ev(13.2, "failure", 0, cause="signal", process=1, code=-9, step=8),
        _ev(13.4, "survivors_stopped", 0, seconds=0.2),
        _ev(13.5, "restart", 1, attempt=1),
        _ev(13.5, "group_started", 1),
        _ev(16.0, "start", 1),
        _ev(16.5, "restore", 1, step=5),
        _ev(18.0, "compiled", 1),
    ]
    metrics = [{"step": s, "loss": 1.0, "step_time_s": 0.5, "time": 8 + s / 2} for s in range(1, 8)]
    metrics += [
        {"step": s, "loss": 1.0, "step_time_s": 0.5, "time": 15.5 + s / 2} for s in (6, 7, 8)
    ]
    (inc,) = goodput.incidents(events, metrics)
    assert inc["cause"] == "signal" and inc["process"] == 1
    assert inc["detect_s"] == pytest.approx(0.2)
    assert inc["recovery_s"] == pytest.approx(18.5 - 13.0)  # first new step - fault
    assert inc["init_s"] == pytest.approx(2.5) and inc["restore_s"] == pytest.approx(0.5)
    assert inc["compile_s"] == pytest.approx(1.5) and inc["first_step_s"] == pytest.approx(0.5)
    assert inc["lost_steps"] == 2  # steps 6 and 7 were recomputed
    lost = goodput.time_lost(events, metrics, [inc])
    assert lost["signal"] == pytest.approx(5.5 + 2 * 0.5)  # recovery + recomputed steps
    assert lost["startup"] == pytest.approx(8.5)


@pytest.mark.parametrize(
    "args",
    [
        ["--coordinator", "garbage"],
        ["--coordinator", "host:99999"],
        ["--coordinator", "host:abc"],
        ["--coordinator", "[::1:5"],
        ["--hang-timeout", "nan"],
        ["--hang-timeout", "-1"],
        ["--startup-timeout", "-5"],
        ["--startup-timeout", "inf"],
        ["--collective-timeout", "0"],
        ["--backoff", "-1"],
        ["--grace", "-1"],
        ["--straggler-factor", "-1"],
        ["--max-restarts", "-2"],
        ["--min-nproc", "0"],
        ["--nnodes", "2", "--coordinator", "127.0.0.1:0"],
        ["--host", "not a host"],
    ],
)
def test_launch_options_refused_in_one_line(args, capsys, tmp_path):
    from jaxpar import cli

    rc = cli.main(["launch", "--nproc", "1", "--run-dir", str(tmp_path / "r"), *args,
                   "--", sys.executable, "-c", "pass"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    assert not (tmp_path / "r").exists()  # refused before anything is written


def test_launch_command_must_exist(capsys):
    from jaxpar import cli

    assert cli.main(["launch", "--nproc", "1", "--", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err == "error: worker command '/nonexistent' is not an executable file; give the " \
        "program to run after --\n"  # fmt: skip
    assert cli.main(["launch", "--nproc", "1", "--", "no-such-program-here"]) == 2
    assert "not found on PATH" in capsys.readouterr().err


def test_addresses_and_binds():
    assert supervisor.split_address("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert supervisor.split_address("[::1]:80") == ("::1", 80)
    one = supervisor.Options(command=["x"], nproc=1, run_dir="/r")
    assert one.bind == "127.0.0.1"  # one node: loopback
    two = supervisor.Options(
        command=["x"], nproc=1, run_dir="/r", nnodes=2, coordinator="127.0.0.2:7"
    )
    assert two.bind == "127.0.0.2"  # exactly the coordinator's address, never 0.0.0.0
    six = supervisor.Options(command=["x"], nproc=1, run_dir="/r", nnodes=2, coordinator="[::1]:7")
    assert six.bind == "::1"
    assert supervisor.Options(command=["x"], nproc=1, run_dir="/r", nnodes=2, coordinator="h:7",
                      bind_host="0.0.0.0").bind == "0.0.0.0"  # fmt: skip


def test_token_file_must_be_private(tmp_path, monkeypatch):
    from jaxpar.supervisor.channel import token

    opts = supervisor.Options(command=["x"], nproc=1, run_dir=str(tmp_path / "run"), nnodes=2)
    first = token(opts)  # created by the first agent
    assert token(opts) == first and len(first) >= 32
    path = tmp_path / "run" / "launch-token"
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        token(opts)
    with pytest.raises(ValueError, match="cannot read the launch token"):
        token(
            supervisor.Options(
                command=["x"], nproc=1, run_dir="/r", token_file=str(tmp_path / "no")
            )
        )
    monkeypatch.setenv("JAXPAR_LAUNCH_TOKEN", "short")
    with pytest.raises(ValueError, match="shorter than 16"):
        token(opts)
    monkeypatch.setenv("JAXPAR_LAUNCH_TOKEN", "x" * 20)
    assert token(opts) == b"x" * 20  # the environment wins over the run directory's file


def test_child_exit_wakes_the_supervisor_and_stopped_workers_are_seen(tmp_path):
    import subprocess

    from jaxpar.supervisor.group import stopped_pids

    waker = supervisor.Wakeup()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    fd = waker.watch(child.pid)
    assert fd is not None  # Linux >= 5.3
    waker.wait(3600)  # returns when the child exits, not after the timeout
    assert child.wait(timeout=5) == 0
    waker.unwatch(fd)

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        assert stopped_pids({7: sleeper.pid}) == []
        os.kill(sleeper.pid, signal.SIGSTOP)
        for _ in range(100):
            if stopped_pids({7: sleeper.pid}):
                break
            waker.wait(0.05)
        assert stopped_pids({7: sleeper.pid}) == [7]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_channel_lines_drop_malformed_and_bound_size():
    import contextlib
    import socket
    import threading

    from jaxpar.supervisor.channel import MAX_LINE, ChannelError, Lines

    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"not json\n[1, 2]\n" + b"[" * 200_000 + b'\n\xff\xfe\n{"ok": 1}\n')
        lines = Lines(b)
        assert lines.next() == {"ok": 1}  # garbage, a list, deep nesting, bad UTF-8 skipped
        a.sendall(b"\n" * 1000)
        with pytest.raises(ChannelError, match="malformed messages in a row"):
            lines.next()
        lines.buf = b""

        def send_too_much():
            with contextlib.suppress(OSError):  # the reader hangs up first
                a.sendall(b"x" * (MAX_LINE + 70_000))

        sender = threading.Thread(target=send_too_much)
        sender.start()
        with pytest.raises(ChannelError, match="longer than"):
            lines.next()
        b.close()
        sender.join(30)


def test_a_group_runs_its_own_command_whatever_the_spec_says(tmp_path):
    marker, ran = tmp_path / "pwned", tmp_path / "ran"
    own = [sys.executable, "-c", f"open({str(ran)!r}, 'w').write('yes')"]
    opts = supervisor.Options(command=own, nproc=1, run_dir=str(tmp_path / "run"), spares=False)
    group = supervisor.LocalGroup(opts)
    spec = {"incarnation": 0, "coordinator": "127.0.0.1:1", "bind": "127.0.0.1:1", "nproc": 1,
            "process_ids": [0], "attempt": 0, "faults": [], "collective_timeout": 60,
            "command": ["touch", str(marker)]}  # fmt: skip
    group.start(spec)
    exits = []
    while not exits:
        group.waker.wait(60)
        exits += group.poll()
    assert exits == [(0, 0)] and ran.read_text() == "yes" and not marker.exists()


def test_shrink_keeps_the_expert_axis_and_its_batch_share():
    """expert splits the batch but lies inside a process: a shrink keeps its size and counts it
    in the batch split (8 devices data=4 x expert=2 -> 4 devices data=2 x expert=2)."""
    mesh = {"data": 4, "fsdp": 1, "tensor": 1, "pipeline": 1, "context": 1, "expert": 2}
    plan = supervisor.shrink_plan(3, 2, 16, mesh, 1, 1)
    assert plan == {"nproc": 2, "mesh": dict(mesh, data=2), "microbatches": 2}


def test_the_timeouts_warning_is_said_once_per_job(tmp_path, capsys):
    """The replica supervisor asks for its timeouts at every pass of its loop (4 a second): a
    collective timeout at or under the hang timeout is said once, not at every pass."""
    from jaxpar.supervisor.job import JobState

    opts = supervisor.Options(command=["x"], nproc=1, run_dir=str(tmp_path),
                              hang_timeout=30.0, collective_timeout=20.0)  # fmt: skip
    job = JobState(opts)
    assert [job.timeouts()[2] for _ in range(3)] == [20.0] * 3
    assert capsys.readouterr().err.count("collective timeout 20s <= hang timeout 30s") == 1
