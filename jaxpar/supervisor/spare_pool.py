"""The supervisor's side of the spare pool (jaxpar/worker/spare.py, `--pool`): one preloaded
process per host that forks this host's workers, and `ForkedWorker`, a forked worker behind the
part of `subprocess.Popen` the supervisor uses (pid, poll, wait, kill, returncode)."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

from jaxpar.worker import spare as spare_lib

READY_TIMEOUT_S = 300.0  # for the pool's imports on a loaded host; then workers start cold
MAX_REPLY = 1 << 20  # bytes of the replies not yet read: more means the pool is not the pool


class SparePool:
    """`python -m jaxpar.worker.spare --pool` started with `env`; fork workers from it."""

    def __init__(self, env: dict[str, str], target: str, log, fork_self: bool = False) -> None:
        """`fork_self`: the pool may be forked from this process (a supervisor) when it holds
        the imports already (_fork_preloaded)."""
        env = {**env, spare_lib.ENV_TARGET: target}
        forked = _fork_preloaded(env, log) if fork_self else None
        self.proc = forked or subprocess.Popen(
            [sys.executable, "-m", "jaxpar.worker.spare", "--pool"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
        )  # fmt: skip
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.exits: dict[int, int] = {}  # pid -> return code, as the pool reported them
        self.cpu_s: dict[int, float] = {}  # pid -> CPU seconds, as the pool reported them
        self.forked: set[int] = set()
        self.answers: list[dict] = []  # fork replies not taken yet
        self.buf = b""
        self.gone = False  # the pool exited (or will be ignored from now)
        self.broken = ""  # why forks go cold from now on
        self.prebuilt = False

    # -- replies -------------------------------------------------------------------------------

    def pump(self) -> None:
        """Read what the pool has replied so far (never blocks)."""
        while not self.gone:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._lost("the spare pool exited")
                return
            self.buf += chunk
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                self._take(line)
            if len(self.buf) > MAX_REPLY:
                self._lost("the spare pool's replies are not its protocol")

    def _take(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if "exit" in msg and isinstance(msg.get("code"), int):
            self.exits[int(msg["exit"])] = msg["code"]
            if isinstance(msg.get("cpu_s"), int | float):
                self.cpu_s[int(msg["exit"])] = float(msg["cpu_s"])
        elif "forked" in msg or "refused" in msg:
            self.answers.append(msg)

    def _lost(self, why: str) -> None:
        """The pool is gone: its workers died with it (their parent-death signal is SIGKILL)."""
        self.gone, self.broken = True, self.broken or why
        for pid in self.forked - set(self.exits):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            self.exits[pid] = -signal.SIGKILL

    def _wait_readable(self, timeout: float) -> None:
        with contextlib.suppress(OSError, ValueError):
            select.select([self.fd], [], [], max(0.0, timeout))

    # -- requests ------------------------------------------------------------------------------

    def _send(self, msg: dict) -> bool:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            self._lost("the spare pool exited")
            return False
        return True

    def prebuild(self) -> None:
        """Build the run's model in the pool now (the running group wrote config.json); once."""
        if not (self.gone or self.broken or self.prebuilt):
            self.prebuilt = self._send({"op": "prebuild"})

    def fork(
        self, env: dict[str, str], argv: list[str], log: str, stderr: str | None = None
    ) -> ForkedWorker | None:
        """A worker forked from the pool (stdout and stderr to `log`, or stderr to `stderr`),
        or None (the caller starts it cold): the pool is gone, refused (why in `broken`), or not
        ready within READY_TIMEOUT_S."""
        if self.gone or self.broken:
            return None
        msg = {"op": "fork", "env": env, "argv": argv, "log": log}
        if not self._send(msg if stderr is None else {**msg, "stderr": stderr}):
            return None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.answers and not self.gone and time.monotonic() < deadline:
            self._wait_readable(deadline - time.monotonic())
            self.pump()
        if not self.answers:
            self.broken = self.broken or f"no answer from the spare pool in {READY_TIMEOUT_S:.0f} s"
            return None
        answer = self.answers.pop(0)
        if "refused" in answer:
            self.broken = f"the spare pool refused: {answer['refused']}"
            return None
        pid = int(answer["forked"])
        self.forked.add(pid)
        return ForkedWorker(self, pid)

    def close(self) -> None:
        """Release the pool: it exits once its workers have (the caller stopped them)."""
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.pump()
        self.gone = True
        with contextlib.suppress(OSError):
            self.proc.stdout.close()


def _fork_preloaded(env: dict[str, str], log) -> _PoolProcess | None:
    """The pool forked from this process when it already holds what the pool would import (the
    supervisor started from Python that imported jaxpar's workers, or itself forked from a pool):
    one Python thread, the preload imported, no jax backend, the same start-up variables. The
    fork is then what `python -m jaxpar.worker.spare --pool` would be, less ~1.6 CPU-s of
    imports. None: start it cold."""
    if (
        threading.active_count() != 1
        or not all(name in sys.modules for name in spare_lib.PRELOAD)
        or not spare_lib.same_start(env)
    ):
        return None
    requests, replies = os.pipe(), os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the pool: nothing of the supervisor's but its imports
        code = 1
        try:
            os.setsid()
            # the supervisor's garbage finalised now, while its descriptors are still its own,
            # and the rest out of the collector's sight: nothing of it closes a descriptor later
            gc.collect()
            gc.freeze()
            os.dup2(log.fileno(), 2)
            os.dup2(2, 1)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(requests[0], 3)
            os.dup2(replies[1], 4)
            os.closerange(5, os.sysconf("SC_OPEN_MAX"))  # the supervisor's sockets, pipes, logs
            _fresh_signals()
            atexit._clear()  # the supervisor's
            os.environ.clear()
            os.environ.update(env)
            sys.argv = [spare_lib.__file__, "--pool"]
            sys.path[0] = os.getcwd()  # as `python -m` puts it there
            code = spare_lib.serve(3, 4)
        except SystemExit as e:
            code = spare_lib.exit_code(e.code)
        except BaseException:  # noqa: BLE001 - reported to the pool's log
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(requests[0])
    os.close(replies[1])
    return _PoolProcess(pid, requests[1], replies[0])


def _fresh_signals() -> None:
    """Signal handling as a new interpreter has it (the supervisor's handlers, wake-up fd,
    mask and timer gone)."""
    signal.set_wakeup_fd(-1)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    ignored = {signal.SIGPIPE, getattr(signal, "SIGXFSZ", signal.SIGPIPE)}
    for sig in signal.valid_signals():
        fresh = (
            signal.default_int_handler if sig == signal.SIGINT
            else signal.SIG_IGN if sig in ignored else signal.SIG_DFL
        )  # fmt: skip
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if signal.getsignal(sig) != fresh:
                signal.signal(sig, fresh)


class _PoolProcess:
    """A pool forked from this process, as the part of `subprocess.Popen` SparePool uses."""

    def __init__(self, pid: int, stdin: int, stdout: int) -> None:
        self.pid = pid
        self.stdin = os.fdopen(stdin, "wb")
        self.stdout = os.fdopen(stdout, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (1e9 if timeout is None else timeout)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)


class ForkedWorker:
    """A worker the pool forked, as the supervisor sees a `subprocess.Popen` (its own session:
    its pid is its process group's)."""

    def __init__(self, pool: SparePool, pid: int) -> None:
        self.pool, self.pid = pool, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.pool.pump()
            if self.pid not in self.pool.exits and _exited(self.pid):
                # it has ended; the pool reports it the moment it reaps it
                self.wait_reported(5.0)
            self.returncode = self.pool.exits.get(self.pid)
        return self.returncode

    def wait_reported(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.pid not in self.pool.exits and time.monotonic() < deadline:
            self.pool._wait_readable(deadline - time.monotonic())
            self.pool.pump()

    def wait(self, timeout: float | None = None) -> int:
        self.wait_reported(1e9 if timeout is None else timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def cpu_s(self) -> float | None:
        """CPU seconds it used, with the processes it waited for, once it has ended."""
        return self.pool.cpu_s.get(self.pid)


def _exited(pid: int) -> bool:
    """Whether `pid` has ended (a zombie its parent has not reaped yet, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True
