"""One host's standby group (jaxpar/worker/standby.py): workers started ahead with their final
environment that wait on stdin for "go", so a failed group is replaced without a start-up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile

from jaxpar.supervisor.options import say
from jaxpar.worker import standby as standby_lib


class Standby:
    """One host's standby workers (jaxpar/worker/standby.py): started with their final environment and
    JAXPAR_STANDBY=1; each reports `ready` on its own pipe and waits on stdin for "go"."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.procs: dict[int, subprocess.Popen] = {}
        self.ready_fds: dict[int, int] = {}
        self.is_ready: set[int] = set()
        self.dead: set[int] = set()  # closed its pipe without reporting ready
        # each worker's output until "go": a file already unlinked (nothing is left behind
        # when this supervisor is killed), read through this descriptor
        self.tmp_logs: dict[int, int] = {}

    def spawn(self, pid: int, command: list[str], env: dict) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        fd, tmp = tempfile.mkstemp(prefix=f"jaxpar-standby-p{pid}-", suffix=".log")
        os.unlink(tmp)
        env = dict(env, **{standby_lib.ENV_STANDBY: "1", standby_lib.ENV_READY_FD: str(w)})
        try:
            self.procs[pid] = subprocess.Popen(
                command, env=env, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                pass_fds=(w,), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.close(w)
        self.ready_fds[pid], self.tmp_logs[pid] = r, fd

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
            if pid in self.is_ready or pid in self.dead:
                continue
            try:
                data = os.read(fd, 64)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data.startswith(standby_lib.READY.strip()):
                self.is_ready.add(pid)
            elif not data:
                self.dead.add(pid)

    def ready(self) -> bool:
        self._read()
        return len(self.is_ready) == len(self.procs) and not self.failed()

    def failed(self) -> bool:
        self._read()
        return bool(self.dead) or any(p.poll() is not None for p in self.procs.values())

    def go(self, pid: int, log: str, opener) -> None:
        """Append what the worker printed so far to `log`, then tell it to go on there."""
        with opener(log) as out, contextlib.suppress(OSError):
            out.write(self.output(pid))
        proc = self.procs[pid]
        with contextlib.suppress(OSError):  # a worker that died shows as an exit at once
            proc.stdin.write((json.dumps({"log": log}) + "\n").encode())
            proc.stdin.close()

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
        for fd in self.ready_fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.ready_fds = {}
        for fd in self.tmp_logs.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.tmp_logs = {}

    def release(self) -> None:
        """Kill every standby worker (nothing to save: it has written nothing) and wait."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs.values():
            with contextlib.suppress(OSError):
                if p.stdin:
                    p.stdin.close()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                say(f"standby worker pid {p.pid} did not die after SIGKILL")
        self.close_files()
