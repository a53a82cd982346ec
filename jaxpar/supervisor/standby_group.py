"""One host's standby group (jaxpar/worker/standby.py): workers started ahead with their final
environment that wait for "go", so a failed group is replaced without a start-up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile

from jaxpar.supervisor.options import say
from jaxpar.supervisor.spare_pool import ForkedWorker, SparePool
from jaxpar.worker import standby as standby_lib


class Standby:
    """One host's standby workers (jaxpar/worker/standby.py): started with their final environment and
    JAXPAR_STANDBY=1 (forked from the host's spare pool where it can, else started); each reports
    `ready` on its own named pipe and waits on another for "go"."""

    def __init__(self, spec: dict, run_dir: str, pool: SparePool | None = None):
        self.spec = spec
        self.pool = pool  # forks the workers (None, or refused: they are started cold)
        self.procs: dict[int, subprocess.Popen | ForkedWorker] = {}
        # the named pipes and output files, in a directory only this user reads, named after
        # the run (standby.dir_prefix); its names are removed as soon as the workers hold them open
        # (what is left if this supervisor is killed before they do: a few empty pipes and the
        # output so far), the directory once every worker is ready, and at release
        self.dir = tempfile.mkdtemp(prefix=standby_lib.dir_prefix(run_dir))
        self.ready_fds: dict[int, int] = {}  # read ends (opened read-write: never an EOF)
        self.go_fds: dict[int, int] = {}  # write ends (closed: the worker is released)
        self.is_ready: set[int] = set()
        # each worker's output until "go", read through this descriptor
        self.tmp_logs: dict[int, int] = {}

    def _names(self, pid: int) -> tuple[str, str, str]:
        base = os.path.join(self.dir, f"proc{pid}")
        return f"{base}.ready", f"{base}.go", f"{base}.log"

    def spawn(self, pid: int, command: list[str], env: dict) -> None:
        ready, go, out = self._names(pid)
        os.mkfifo(ready, 0o600)
        os.mkfifo(go, 0o600)
        self.ready_fds[pid] = os.open(ready, os.O_RDWR | os.O_NONBLOCK)
        self.go_fds[pid] = os.open(go, os.O_RDWR)
        self.tmp_logs[pid] = fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        env = dict(env, **{standby_lib.ENV_STANDBY: "1", standby_lib.ENV_READY: ready,
                           standby_lib.ENV_GO: go})  # fmt: skip
        forked = self.pool.fork(env, command, out) if self.pool is not None else None
        self.procs[pid] = forked or subprocess.Popen(
            command, env=env, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    def output(self, pid: int) -> bytes:
        """What standby worker `pid` printed so far."""
        fd, chunks, at = self.tmp_logs[pid], [], 0
        with contextlib.suppress(OSError):
            while chunk := os.pread(fd, 1 << 20, at):
                chunks.append(chunk)
                at += len(chunk)
        return b"".join(chunks)

    def _read(self) -> None:
        for pid, fd in self.ready_fds.items():
            if pid in self.is_ready:
                continue
            try:
                data = os.read(fd, 64)
            except OSError:  # nothing yet (a dead worker shows in failed())
                continue
            if data.startswith(standby_lib.READY.strip()):
                self.is_ready.add(pid)
                for name in self._names(pid):  # it holds them open: the names can go
                    with contextlib.suppress(OSError):
                        os.unlink(name)
                with contextlib.suppress(OSError):  # once empty
                    os.rmdir(self.dir)

    def ready(self) -> bool:
        self._read()
        return len(self.is_ready) == len(self.procs) and not self.failed()

    def failed(self) -> bool:
        return any(p.poll() is not None for p in self.procs.values())

    def go(self, pid: int, log: str, opener) -> None:
        """Append what the worker printed so far to `log`, then tell it to go on there."""
        with opener(log) as out, contextlib.suppress(OSError):
            out.write(self.output(pid))
        fd = self.go_fds.pop(pid)
        with contextlib.suppress(OSError):  # a worker that died shows as an exit at once
            os.write(fd, (json.dumps({"log": log}) + "\n").encode())
        os.close(fd)

    def keep_logs(self, log_dir: str) -> list[str]:
        """Copy each standby worker's output to LOG_DIR/standby-inc<I>-proc<P>.log."""
        out = []
        for pid in self.tmp_logs:
            path = os.path.join(log_dir, f"standby-inc{self.spec['incarnation']}-proc{pid}.log")
            with contextlib.suppress(OSError), open(path, "ab") as g:
                g.write(self.output(pid))
                out.append(path)
        return out

    def close_files(self) -> None:
        for fds in (self.ready_fds, self.go_fds, self.tmp_logs):
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            fds.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def release(self) -> None:
        """Kill every standby worker (nothing to save: it has written nothing) and wait."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if p.poll() is None:  # (a forked one's pid is its pool's to reap)
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                say(f"standby worker pid {p.pid} did not die after SIGKILL")
        self.close_files()
