"""Run-directory files that jaxpar did not write: a lock that is a symlink or another user's, a
metrics line with a non-finite number, a secret file that is no secret; run directories are
private to their owner."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from jaxpar.rundir import ownership, runlog
from jaxpar.rundir.writer import RunDir


def test_a_lock_file_that_is_a_symlink_is_refused_with_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    os.symlink(target, run / "lock")
    with pytest.raises(ownership.RunDirLocked, match="is a symlink .*; remove it") as e:
        ownership.acquire(str(run), "test")
    assert "\n" not in str(e.value)
    assert target.read_text() == "keep"


def test_a_lock_file_of_another_user_is_refused_with_one_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "lock").write_text("{}")
    real_open = os.open

    def no_access(path, flags, *a, **kw):  # what a user other than the file's owner gets
        if str(path).endswith(os.sep + "lock"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(ownership.os, "open", no_access)
    with pytest.raises(
        ownership.RunDirLocked, match="belongs to .* use a run directory of your own"
    ):
        ownership.acquire(str(run), "test")


@pytest.mark.parametrize("foreign", ["", "lock", "checkpoints"])
def test_a_run_directory_of_another_user_is_refused_unless_allowed(tmp_path, monkeypatch, foreign):
    """A run directory, its lock file (a 0666 one can be opened) or its checkpoints/ that another
    user owns: that user could swap the checkpoints, so it is refused in one line naming why
    and the setting that allows it."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "lock").write_text("{}")
    os.chmod(run / "lock", 0o666)
    theirs, real_stat = str(run / foreign) if foreign else str(run), os.stat

    def stat(path, *a, **kw):  # `theirs` belongs to uid 4242
        st = real_stat(path, *a, **kw)
        if os.path.abspath(path) == theirs:
            st = os.stat_result((*st[:4], 4242, *st[5:]))
        return st

    monkeypatch.setattr(ownership.os, "stat", stat)
    monkeypatch.delenv(ownership.ENV_FOREIGN, raising=False)
    with pytest.raises(ownership.ForeignRunDir) as e:
        ownership.acquire(str(run), "test")
    msg = str(e.value)
    assert "\n" not in msg and f"{theirs} belongs to " in msg and "uid 4242" in msg, msg
    assert "can replace its checkpoints" in msg and "JAXPAR_FOREIGN_RUN_DIR=1" in msg, msg
    assert (run / "lock").read_text() == "{}"  # untouched
    monkeypatch.setenv(ownership.ENV_FOREIGN, "1")  # asked for explicitly
    ownership.acquire(str(run), "test").release()


def test_run_directories_are_created_private(tmp_path):
    lock = ownership.acquire(str(tmp_path / "a"), "test")
    lock.release()
    RunDir(str(tmp_path / "b"))
    for name in ("a", "b"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    RunDir(str(shared))  # an existing folder is the user's choice: left as it is
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755


def test_private_umask_only_tightens_and_is_restored(tmp_path):
    old = os.umask(0o022)
    try:
        with ownership.private_umask():
            (tmp_path / "f").write_text("x")
            assert os.umask(0o027) == 0o077
        assert os.umask(0o023) == 0o022
        with ownership.private_umask():
            assert os.umask(0o077) == 0o077
        assert os.umask(0o022) == 0o023
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o600


def _secret(tmp_path, content: bytes, mode: int = 0o600):
    path = tmp_path / "token"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("proc", "under /proc"),
        ("fifo", "not a regular file"),
        ("mode", "chmod 600"),
        ("short", "16 to 4096 printable"),
        ("binary", "16 to 4096 printable"),
        ("huge", "16 to 4096 printable"),
        ("missing", "cannot open it"),
    ],
)
def test_a_secret_file_must_be_a_small_private_regular_file(tmp_path, case, message):
    path = {
        "proc": lambda: "/proc/self/environ",
        "mode": lambda: _secret(tmp_path, b"a" * 32, 0o644),
        "short": lambda: _secret(tmp_path, b"abc\n"),
        "binary": lambda: _secret(tmp_path, b"PATH=/bin\0HOME=/root\0USER=me\0"),
        "huge": lambda: _secret(tmp_path, b"a" * 5000),
        "missing": lambda: str(tmp_path / "absent"),
        "fifo": lambda: (os.mkfifo(tmp_path / "f", 0o600), str(tmp_path / "f"))[1],
    }[case]()
    with pytest.raises(ValueError, match=message) as e:
        ownership.check_secret_file(path, "--token-file")
    assert str(e.value).startswith(f"--token-file {path}") and "\n" not in str(e.value)


def test_a_good_secret_file_passes(tmp_path):
    ownership.check_secret_file(_secret(tmp_path, b"0123456789abcdef" * 4 + b"\n"), "--x")


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "Infinity", "1" + "0" * 400])
def test_a_line_with_a_non_finite_number_is_skipped_and_counted(tmp_path, number):
    path = tmp_path / runlog.METRICS
    good = [{"step": s, "loss": 1.0 / s, "time": 100.0 + s} for s in (1, 2)]
    with open(path, "w") as f:
        f.write(json.dumps(good[0]) + "\n")
        f.write('{"step": 3, "loss": 0.3, "time": ' + number + "}\n")
        f.write(json.dumps(good[1]) + "\n")
    records, bad = runlog.read_jsonl_counted(str(path))
    kept = runlog.well_formed(records)
    assert kept == good
    assert runlog.skipped_lines(str(tmp_path)) == {runlog.METRICS: 1}
    assert runlog.read_run(str(tmp_path))[1] == good


def test_a_lock_file_that_is_a_fifo_never_blocks(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "lock", 0o600)
    assert ownership.read_holder(str(run)) == {}
    assert not ownership.held(str(run))
    with pytest.raises(ownership.RunDirLocked, match="not a regular file"):
        ownership.acquire(str(run), "test")
