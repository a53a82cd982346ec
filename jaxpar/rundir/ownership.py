"""Run-directory safety: one owner at a time, path checks, clearing folders without leaving RUN_DIR.

    lock = ownership.acquire(run_dir, "jaxpar launch")  # RunDirLocked (a ValueError) when held
    env.update(lock.env())                              # workers run under this lock

Design: docs/design.md, "Checks before writing, and one owner at a time".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shlex
import shutil
import socket
import stat
import sys
import time
from dataclasses import dataclass

from jaxpar.rundir import runlog

LOCK_FILE = runlog.LOCK
ENV_RUN_LOCK = "JAXPAR_RUN_LOCK"  # the token of the lock a supervisor holds for its workers
# "1": use a run directory (or its lock file, its checkpoints/) that another user owns
ENV_FOREIGN = "JAXPAR_FOREIGN_RUN_DIR"
_SYSTEM_DIRS = ("/proc", "/sys", "/dev")
RUN_DIR_MODE = 0o700  # a run directory jaxpar creates is its owner's alone
PRIVATE_UMASK = 0o077  # files a jaxpar command creates: no access for group or others
MAX_SECRET_BYTES = 4096


class RunDirLocked(ValueError):
    """Another live process owns the run directory."""


class ForeignRunDir(RunDirLocked):
    """The run directory, its lock file or its checkpoints/ belong to another user."""


# ---- paths --------------------------------------------------------------------------------------


def check_path(run_dir: str, option: str = "--run-dir") -> str:
    """Refuse an output directory that cannot be one (ValueError naming `option` and the fix);
    nothing is created. Returns the absolute path."""
    path = os.path.abspath(run_dir)
    system = under_system_dir(path)
    if system is not None:
        raise ValueError(
            f"{option} {run_dir} is under {system}, a kernel filesystem; use a directory on "
            f"a normal disk, e.g. {option} runs/NAME"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{option} {run_dir} is a file, not a directory; give a directory path")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"{option} {run_dir}: {probe} is a file, so the directory cannot exist")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {run_dir}: {probe} is not writable; choose another directory")
    return path


def check_file_path(out: str, option: str = "--out") -> str:
    """Refuse an output file that cannot be written (ValueError naming `option` and the fix): under
    a kernel filesystem, an existing folder, or under a file or an unwritable folder. Nothing is
    created; the folders missing above it may be. Returns the absolute path."""
    system = under_system_dir(out)
    if system is not None:
        raise ValueError(
            f"{option} {out} is under {system}, a kernel filesystem; write to a normal disk, "
            f"e.g. {option} results/NAME"
        )
    if os.path.isdir(out):
        raise ValueError(f"{option} {out} is a folder; name a file in it, e.g. {option} "
                         f"{os.path.join(out, 'NAME')}")  # fmt: skip
    check_creatable(out, option)
    return os.path.abspath(out)


def check_creatable(out: str, option: str = "--out") -> None:
    """Refuse a path whose nearest existing ancestor is a file or an unwritable folder (ValueError
    naming `option` and the fix): what is missing above it could not be created."""
    probe = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{option} {out}: {probe} is a file, not a folder; choose another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {out}: {probe} is not writable; choose another folder")


def check_owner(run_dir: str) -> None:
    """Refuse (ForeignRunDir, naming the fix) a run directory whose folder, lock file or
    checkpoints/ another user owns, unless $JAXPAR_FOREIGN_RUN_DIR is 1: that user could swap
    its checkpoints (they carry checksums, not a MAC) or plant files a restart trusts. What does
    not exist yet is created by this user, so passes."""
    if os.environ.get(ENV_FOREIGN) == "1":
        return
    path = os.path.abspath(run_dir)
    for what, p in (("", path), (": its lock file ", os.path.join(path, LOCK_FILE)),
                    (": its checkpoints folder ", os.path.join(path, runlog.CHECKPOINTS))):  # fmt: skip
        try:
            uid = os.stat(p).st_uid
        except OSError:
            continue
        if uid != os.geteuid():
            where = f"{run_dir}{what}{p if what else ''}"
            raise ForeignRunDir(
                f"run directory {where} belongs to {_user(uid)}, not to you: that "
                f"user can replace its checkpoints (checksummed, not signed) and the run would "
                f"train on them; use a run directory of your own, or set {ENV_FOREIGN}=1 if you "
                f"trust that user"
            )


def under_system_dir(path: str) -> str | None:
    """The kernel filesystem (/proc, /sys, /dev) `path` resolves into, else None."""
    real = os.path.realpath(path)
    for system in _SYSTEM_DIRS:
        if real == system or real.startswith(system + os.sep):
            return system
    return None


@contextlib.contextmanager
def private_umask():
    """While it lasts, this process (and what it starts) creates files for its user only:
    `jaxpar train` and `jaxpar launch` run under it. The umask only tightens, and is restored."""
    old = os.umask(PRIVATE_UMASK)
    os.umask(old | PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(old)


def make_run_dir(path: str) -> None:
    """Create the run directory (mode 0700, parents as usual); an existing one is left as it is."""
    os.makedirs(path, mode=RUN_DIR_MODE, exist_ok=True)


def check_secret_file(path: str, option: str) -> None:
    """Refuse a file that cannot hold a secret (ValueError naming `option` and the fix): it must
    be a regular file outside /proc, /sys and /dev, owned by this user with no access for group
    or others, at most MAX_SECRET_BYTES, holding one line of 16 or more printable characters."""
    system = under_system_dir(path)
    if system is not None:
        raise ValueError(f"{option} {path} is under {system}; write the secret to a file of yours")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(
                f"{option} {path} is not a regular file; give a file holding the secret"
            )
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(
                f"{option} {path} must belong to you and be readable only by you: chmod 600 {path}"
            )
        blob = os.read(fd, MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    text = blob.strip()
    if len(blob) > MAX_SECRET_BYTES or len(text) < 16 or not all(33 <= b < 127 for b in text):
        raise ValueError(
            f"{option} {path} must hold one line of 16 to {MAX_SECRET_BYTES} printable ASCII "
            f"characters without spaces, e.g. the output of: openssl rand -hex 32"
        )


def inside(run_dir: str, path: str) -> bool:
    """Whether `path`, with every symlink resolved, lies inside `run_dir`."""
    root = os.path.realpath(run_dir)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def clear_dir(run_dir: str, name: str) -> str:
    """Empty RUN_DIR/NAME (creating it if absent) without following symlinks out of the run dir.

    A symlink at RUN_DIR/NAME is removed (not its target) and replaced by a real folder; entries
    that are symlinks are unlinked, sub-folders removed with shutil.rmtree (which never follows
    symlinks). Returns the folder's path."""
    path = os.path.join(os.path.abspath(run_dir), name)
    if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
        os.unlink(path)
    os.makedirs(path, exist_ok=True)
    if not inside(run_dir, path):  # a symlinked parent folder
        raise ValueError(f"{path} resolves outside the run directory {run_dir}; not clearing it")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for entry in os.listdir(fd):
            st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    return path


# ---- the lock -----------------------------------------------------------------------------------


@dataclass
class RunDirLock:
    """An owned (or inherited) lock on a run directory; `release()` ends ownership."""

    run_dir: str
    token: str
    fd: int | None  # None: inherited from a supervisor, which releases it
    took_over: dict | None = None  # the record of a dead holder this lock replaced

    def env(self) -> dict[str, str]:
        """Environment that lets child workers run under this lock."""
        return {ENV_RUN_LOCK: self.token}

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        # Unlink while still holding the flock: a waiter that opened the old file notices the
        # inode change after it gets the lock and retries on a new file.
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.run_dir, LOCK_FILE))
        os.close(fd)


def read_holder(run_dir: str) -> dict:
    """The lock file's record (pid, host, owner, token, since), {} if absent or unreadable."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device: never read
                return {}
            record = json.loads(os.read(fd, 4096).decode("utf-8", "replace") or "{}")
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def describe(record: dict) -> str:
    since = record.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return (
        f"{record.get('owner', 'a process')} (pid {record.get('pid', '?')} on host "
        f"{record.get('host', '?')}, since {when})"
    )


def locked_message(run_dir: str) -> str:
    return (
        f"run directory {run_dir} is in use by {describe(read_holder(run_dir))}; wait for it to "
        f"finish or stop it, or use another --run-dir"
    )


def acquire(run_dir: str, owner: str) -> RunDirLock:
    """Take the run directory's lock (creating the directory); RunDirLocked if a live process
    holds it. A lock file whose holder is dead is taken over (see `RunDirLock.took_over`)."""
    run_dir = os.path.abspath(run_dir)
    check_owner(run_dir)
    try:
        make_run_dir(run_dir)
    except OSError as e:
        raise ValueError(
            f"cannot create the run directory {run_dir}: {e.strerror}; use another --run-dir"
        ) from None
    path = os.path.join(run_dir, LOCK_FILE)
    for _ in range(100):
        fd = _open_lock(run_dir, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirLocked(locked_message(run_dir)) from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # released and unlinked meanwhile: lock the new file instead
            os.close(fd)
            continue
        previous = read_holder(run_dir)
        token = secrets.token_hex(16)
        record = {
            "pid": os.getpid(), "host": socket.gethostname(), "owner": owner, "token": token,
            "since": time.time(),
        }  # fmt: skip
        data = json.dumps(record).encode() + b"\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        return RunDirLock(run_dir, token, fd, took_over=previous or None)
    raise RunDirLocked(f"run directory {run_dir}: could not take its lock (it kept changing)")


def _open_lock(run_dir: str, path: str) -> int:
    """The lock file's descriptor; a lock file that is a symlink, or that this user cannot open
    (another user's), is refused with one line (RunDirLocked) instead of being used."""
    try:
        fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600
        )
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        raise RunDirLocked(
            f"run directory {run_dir}: its lock file {path} is not a regular file (jaxpar makes "
            f"only regular ones); remove it"
        )
    except OSError as e:
        if os.path.islink(path):
            why = "is a symlink (jaxpar never makes one); remove it"
        elif e.errno in (errno.EACCES, errno.EPERM):
            owner = _owner_of(path)
            why = f"belongs to {owner} and you cannot open it; use a run directory of your own"
        else:
            why = f"cannot be opened ({e.strerror}); remove it"
        raise RunDirLocked(f"run directory {run_dir}: its lock file {path} {why}") from None


def _owner_of(path: str) -> str:
    try:
        uid = os.stat(path, follow_symlinks=False).st_uid
    except OSError:
        return "another user"
    return _user(uid)


def _user(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def acquire_or_inherit(run_dir: str, owner: str) -> RunDirLock:
    """`acquire`, unless JAXPAR_RUN_LOCK names the token of the lock now held on this run
    directory (a supervisor's): then the caller runs under that lock and releases nothing."""
    token = os.environ.get(ENV_RUN_LOCK)
    if token and read_holder(run_dir).get("token") == token and held(run_dir):
        return RunDirLock(os.path.abspath(run_dir), token, None)
    return acquire(run_dir, owner)


def held(run_dir: str) -> bool:
    """Whether a live process holds the run directory's lock (nothing is created)."""
    path = os.path.join(os.path.abspath(run_dir), LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock taken just now
    return False


def resume_command(run_dir: str, argv: list[str] | None = None) -> str:
    """The command line of this process (sys.orig_argv) with its --run-dir made explicit: what
    resumes the run after an interruption."""
    argv = list(sys.orig_argv if argv is None else argv)
    if len(argv) > 1 and os.path.basename(argv[1]) == "jaxpar":  # the console script
        argv = argv[1:]
    if argv:
        argv[0] = (
            "python"
            if os.path.basename(argv[0]).startswith("python")
            else os.path.basename(argv[0])
        )
    if not any(a == "--run-dir" or a.startswith("--run-dir=") for a in argv):
        argv += ["--run-dir", run_dir]
    return shlex.join(argv)
