"""The tests' single-process runs of jaxpar (`python -m train ...`, `python -m jaxpar.cli ...`)
forked from jaxpar's own spare pool (jaxpar/worker/spare.py, `--pool`) instead of started cold.

A cold `python -m train` pays ~1.7 CPU-s of imports (jax, flax, orbax, optax, grain) before its
first line of work; the suite starts such runs a couple of hundred times. A pool per pytest
process and per start-up environment (the JAX_*/XLA_*/PYTHON* variables: what a fork must not
change; the MAX_POOLS used last are kept) pays them once and forks each run, exactly as
`jaxpar launch` forks its workers: the run is the same command in the same environment, its own
session, stdout and stderr to files read back when it ends. What the pool would not run as a cold start would (its own rules: a backend created, a
JAX_*/XLA_*/PYTHON* variable changed) and commands in another directory start cold.

The CPU the forked runs use is reported by the pool (`wait4` of each run); `cpu_s()` adds it to
the pools' own (their imports, their forks), and tests/conftest.py counts it in each test's row of
JAXPAR_TEST_CPU_LOG: forking moves no CPU out of the log.

JAXPAR_TEST_FORK=0 starts every run cold.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from jaxpar.supervisor.spare_pool import SparePool
from jaxpar.worker import spare as spare_lib

FORK_ENV = "JAXPAR_TEST_FORK"
MODULES = ("train", "jaxpar.cli")  # what the pool runs: jaxpar's own command lines
MAX_POOLS = 3  # per test process (each holds jax and jaxpar imported: ~300 MB)

_pools: dict[tuple, SparePool] = {}  # used from the main thread only (see forkable)
_logs = tempfile.mkdtemp(prefix="jaxpar-test-fork-")


def _import_time(env: dict[str, str]) -> tuple:
    names = {k for k in env if k.startswith(spare_lib.IMPORT_TIME_PREFIXES)}
    return tuple(sorted((k, env[k]) for k in names - spare_lib.RUN_TIME_ONLY))


def forkable(cmd: list[str], cwd, repo: Path) -> bool:
    """Whether `cmd` run in `cwd` is one the pool runs (`python -m MODULE` of this interpreter,
    in the checkout)."""
    if (
        os.environ.get(FORK_ENV, "1") == "0"
        or threading.current_thread() != threading.main_thread()
    ):
        return False  # the pool's replies are read by one thread: runs started in others go cold
    return spare_lib.module_of(cmd) in MODULES and Path(cwd).resolve() == repo.resolve()


def _pool(env: dict[str, str], repo: Path) -> SparePool:
    key = _import_time(env)
    pool = _pools.pop(key, None)  # (re)inserted last: the most recently used
    if pool is not None and (pool.gone or pool.broken):
        pool.close()
        pool = None
    if pool is None:
        while len(_pools) >= MAX_POOLS:
            _pools.pop(next(iter(_pools))).close()  # it exits once its runs have
        # what the pool imports is the checkout's (its working directory is sys.path[0], as for
        # `python -m train` there); jaxpar's per-run variables come with each request
        own = {k: v for k, v in env.items() if not k.startswith("JAXPAR_")}
        log = os.fdopen(tempfile.mkstemp(dir=_logs, suffix=".log")[0], "ab")
        cwd = os.getcwd()
        os.chdir(repo)
        try:
            pool = SparePool(own, "module:train", log)
        finally:
            os.chdir(cwd)
        log.close()
    _pools[key] = pool
    return pool


def run(cmd: list[str], env: dict[str, str], timeout: float, merge: bool, repo: Path):
    """`cmd` forked from the pool and run to its end: (returncode, stdout, stderr), stderr in
    stdout if `merge`; None when the pool cannot run it (the caller starts it cold).

    On timeout its process group is killed and an AssertionError carries the output's tail."""
    pool = _pool(env, repo)
    fd, out = tempfile.mkstemp(dir=_logs, suffix=".out")
    os.close(fd)
    err = None if merge else out[: -len(".out")] + ".err"
    try:
        worker = pool.fork(env, list(cmd), out, err)
        if worker is None:
            return None
        try:
            code = worker.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(60)
            raise AssertionError(f"{cmd} timed out after {timeout}s:\n{_read(out)[-3000:]}\n"
                                 f"{_read(err)[-3000:] if err else ''}") from None  # fmt: skip
        return code, _read(out), (None if merge else _read(err))
    finally:
        for path in (out, err):
            if path and os.path.exists(path):
                os.unlink(path)


def start(cmd: list[str], env: dict[str, str], log: str, repo: Path):
    """`cmd` forked from the pool, stdout and stderr to `log`: a ForkedWorker (pid, poll, wait,
    kill; its own session), or None when the pool cannot run it (the caller starts it cold)."""
    if not forkable(cmd, repo, repo):
        return None
    return _pool(env, repo).fork(env, list(cmd), log)


def cpu_s() -> float:
    """CPU seconds of this process's live pools, their own and those of the runs they reported
    ended. A pool released is waited for: from then on RUSAGE_CHILDREN holds all of it."""
    total = 0.0
    for pool in _pools.values():
        pool.pump()
        total += sum(pool.cpu_s.values()) + _own_cpu(pool.proc.pid)
    return total


def _own_cpu(pid: int) -> float:
    """A live process's own CPU seconds (not its children's)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _read(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


@atexit.register
def close() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()
    shutil.rmtree(_logs, ignore_errors=True)
