"""The run directory: nothing lost, nothing rewritten by a refused run; one owner at a time;
append-only logs that survive tearing; clearing that stays inside the run directory."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxpar.rundir import ownership
from jaxpar.rundir.runlog import append_line, read_jsonl, read_jsonl_counted, write_json
from jaxpar.rundir.writer import RunDir
from tests.support.hardening_util import call, snapshot
from tests.support.helpers import SMALL
from train import __main__ as train_main

# ---- a refused run leaves the run directory byte-for-byte unchanged -----------------------------


@pytest.fixture
def finished(ckpt_reference, tmp_path):
    """A copy of conftest's finished run: gpt_tiny made small (SMALL), 30 steps, checkpoints 10,
    20, 30."""
    run_dir = tmp_path / "run"
    shutil.copytree(ckpt_reference, run_dir)
    return run_dir


@pytest.mark.slow
def test_refused_run_leaves_run_dir_unchanged_and_names_what_changed(finished, capsys):
    before = snapshot(finished)
    cases = {
        ("--set", "optim.lr=0.001"): "optim.lr: 0.003 → 0.001",
        ("--recipe", "gpt_small"): "model.n_heads: 4 → 8",
        ("--set", "model.d_model=32"): "model.d_model: 64 → 32",
        ("--set", "optim.lr=-1"): "optim.lr=-1.0 is out of range",
    }
    for args, message in cases.items():
        code = call(train_main.main, ["--run-dir", str(finished), "--steps", "40", *SMALL, *args])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        if "→" in message:
            assert "ckpt.force=true" in err and "another --run-dir" in err
        assert snapshot(finished) == before, f"{args} changed the run directory"


@pytest.mark.slow
def test_steps_at_or_below_the_checkpoint_is_nothing_to_do(finished, capsys):
    before = snapshot(finished)
    for steps in ("5", "30"):
        assert call(train_main.main, ["--run-dir", str(finished), "--steps", steps, *SMALL]) == 0
        err = capsys.readouterr().err.strip()
        assert err == f"jaxpar: checkpoint at step 30 ≥ --steps {steps}; nothing to do"
    assert snapshot(finished) == before  # summary.json, events, incarnation untouched


def test_half_made_run_dir_is_not_left_behind(capsys, tmp_path):
    run_dir = tmp_path / "new"
    # the mesh fails only once the devices are known, after the config checks
    argv = ["--run-dir", str(run_dir), "--mesh", "data=3", "--set", "model.n_layers=1"]
    assert call(train_main.main, argv) == 2
    assert "8 devices" in capsys.readouterr().err
    assert not run_dir.exists()


# ---- the lock -----------------------------------------------------------------------------------


def test_second_run_on_a_locked_run_dir_refuses_naming_the_holder(capsys, tmp_path):
    run_dir = tmp_path / "run"
    lock = ownership.acquire(str(run_dir), "jaxpar launch")
    try:
        before = snapshot(run_dir)
        argv = ["--run-dir", str(run_dir), "--steps", "2", "--set", "model.n_layers=1"]
        assert call(train_main.main, argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert f"pid {os.getpid()}" in err and "jaxpar launch" in err and "in use" in err, err
        assert snapshot(run_dir) == before
        with pytest.raises(ownership.RunDirLocked, match=f"pid {os.getpid()}"):
            ownership.acquire(str(run_dir), "python -m train")
    finally:
        lock.release()
    ownership.acquire(str(run_dir), "python -m train").release()  # free again


def test_a_run_directory_another_user_owns_is_refused_before_anything_is_written(capsys, tmp_path):
    """Another user's folder, writable by all: `python -m train` refuses it in one line (its
    checkpoints could be swapped by that user) and writes nothing there."""
    if os.geteuid() != 0:
        pytest.skip("simulating another user's folder needs root (chown)")
    run_dir = tmp_path / "theirs"
    run_dir.mkdir(mode=0o777)
    os.chmod(run_dir, 0o777)
    os.chown(run_dir, 65534, 65534)
    argv = ["--run-dir", str(run_dir), "--steps", "2", "--set", "model.n_layers=1"]
    assert call(train_main.main, argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "JAXPAR_FOREIGN_RUN_DIR=1" in err, err
    assert os.listdir(run_dir) == []


def test_workers_run_under_their_supervisors_lock(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    lock = ownership.acquire(run_dir, "jaxpar launch")
    try:
        monkeypatch.setenv(ownership.ENV_RUN_LOCK, "not-the-token")
        with pytest.raises(ownership.RunDirLocked):
            ownership.acquire_or_inherit(run_dir, "python -m train")
        monkeypatch.setenv(ownership.ENV_RUN_LOCK, lock.env()[ownership.ENV_RUN_LOCK])
        inherited = ownership.acquire_or_inherit(run_dir, "python -m train")
        assert inherited.fd is None and inherited.token == lock.token
        inherited.release()  # a no-op: the supervisor still holds it
        assert ownership.held(run_dir)
    finally:
        lock.release()
    assert not ownership.held(run_dir)


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    code = (
        "import os, sys; from jaxpar.rundir import ownership; "
        "ownership.acquire(sys.argv[1], 'python -m train'); os._exit(0)"
    )  # dies holding the lock, without releasing it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code, str(run_dir)], check=True, env=env, timeout=300)
    dead = ownership.read_holder(str(run_dir))
    assert dead["pid"] != os.getpid() and not ownership.held(str(run_dir))
    lock = ownership.acquire(str(run_dir), "python -m train")
    try:
        assert lock.took_over["pid"] == dead["pid"]
        assert ownership.read_holder(str(run_dir))["pid"] == os.getpid()
    finally:
        lock.release()


# ---- append-only logs ---------------------------------------------------------------------------


def test_torn_last_line_never_swallows_the_next_record(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    append_line(path, {"step": 1, "loss": 2.0})
    with open(path, "a") as f:
        f.write('{"step": 2, "lo')  # a crash or a full disk mid-write
    append_line(path, {"step": 3, "loss": 1.0})
    records, bad = read_jsonl_counted(path)
    assert [r["step"] for r in records] == [1, 3] and bad == 1


def test_binary_garbage_in_events_does_not_stop_later_starts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "events.jsonl", "wb") as f:
        f.write(b'{"event": "start", "time": 1, "incarnation": 0}\n')
        f.write(os.urandom(512).replace(b"\n", b"") + b"\n\xff\xfe\x00garbage")
    run = RunDir(str(run_dir))
    assert run.incarnation == 1
    run.event("start")
    assert [e["incarnation"] for e in run.events()] == [0, 1]
    assert run.unreadable_lines() == {"events.jsonl": 2}


def test_only_valid_json_is_written(tmp_path):
    path = str(tmp_path / "events.jsonl")
    append_line(path, {"event": "straggler", "factor": float("inf"), "loss": float("nan")})
    write_json(str(tmp_path / "summary.json"), {"goodput": float("-inf"), "steps": 3})

    def strict(name):
        raise ValueError(f"non-standard JSON constant {name}")

    (line,) = open(path).read().splitlines()
    assert json.loads(line, parse_constant=strict) | {"time": 0} == {
        "event": "straggler", "factor": None, "loss": None, "time": 0,
    }  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=strict)
    assert summary == {"goodput": None, "steps": 3}
    assert read_jsonl(path)[0]["factor"] is None


# ---- symlinks -----------------------------------------------------------------------------------


def test_clearing_a_run_dir_folder_never_follows_symlinks_out(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(outside, run_dir / "heartbeats")  # the folder itself is a symlink
    path = ownership.clear_dir(str(run_dir), "heartbeats")
    assert os.path.isdir(path) and not os.path.islink(path)
    assert (outside / "keep.txt").read_text() == "keep"
    (run_dir / "heartbeats" / "proc0.json").write_text("{}")
    os.symlink(outside, run_dir / "heartbeats" / "link")  # an entry is a symlink
    os.symlink(outside / "keep.txt", run_dir / "heartbeats" / "file-link")
    ownership.clear_dir(str(run_dir), "heartbeats")
    assert os.listdir(run_dir / "heartbeats") == []
    assert (outside / "keep.txt").read_text() == "keep"


# ---- a full disk --------------------------------------------------------------------------------


def fill(fs) -> None:
    """Fill the filesystem `fs` to the last byte (a real ENOSPC for the next write)."""
    with open(fs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


def test_heartbeat_on_a_full_disk_leaves_no_temporary_file(small_fs, monkeypatch):
    from jaxpar.worker import bootstrap

    monkeypatch.setitem(bootstrap._state, "hb_dir", None)  # a fresh run directory for this process
    monkeypatch.setitem(bootstrap._state, "history", [])
    run_dir = small_fs / "run"
    bootstrap.heartbeat(str(run_dir), 1)
    fill(small_fs)
    with pytest.raises(OSError) as e:
        bootstrap.heartbeat(str(run_dir), 2)
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(run_dir / "heartbeats") == ["proc0.json"]
    assert bootstrap.read_heartbeat(str(run_dir / "heartbeats" / "proc0.json"))["step"] == 1


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_anything_is_written(small_fs):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.recovery.checkpoint import Checkpointer

    run = RunDir(str(small_fs / "run"))
    ckpt = Checkpointer(run, every=1, keep=2, meta={"config_hash": "c"})
    try:
        with pytest.raises(OSError) as e:
            mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
            w = jax.device_put(jnp.zeros((2 << 20,), jnp.float32), NamedSharding(mesh, P()))
            ckpt.save(1, {"w": w})  # 8 MiB on a 6 MiB disk (a train state's sharding)
        assert e.value.errno == errno.ENOSPC and e.value.filename == ckpt.directory
        assert "needs about 10496 KiB" in str(e.value)  # 8 MiB x 1.25 + 256 KiB
        assert os.listdir(ckpt.directory) == []  # nothing started, nothing to clean up
    finally:
        ckpt.close()
