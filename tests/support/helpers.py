"""Running jaxpar's command lines (`python -m train`, `jaxpar ...`) as subprocesses in tests.

    from tests.support.helpers import cpu_env, events, losses, ok, run, start, train_cmd

    proc = ok(run(train_cmd(run_dir, "--set", "ckpt.every=10", steps=30, faults=["kill@15"]), 0))
    assert losses(run_dir)[30] == ...

Every command runs in the checkout, in its own session (process group), and the whole group is
killed when it outlives its timeout. `cpu_env` gives it simulated CPU devices and the pytest
session's persistent compilation cache (set up by tests/conftest.py), so subprocesses that compile
the same program compile it once per session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from jaxpar.rundir.runlog import last_per_step, read_jsonl
from tests.support import forkserver

REPO = Path(__file__).resolve().parents[2]
# XLA flags of the test processes (and their subprocesses): single-threaded CPU ops (8 simulated
# devices share a couple of cores) and a CPU backend that compiles 2-4x faster (LLVM unoptimised,
# the classic fusion emitters) while its steps run 2-4x slower: right for the many programs that
# run a few steps (or a few steps of the small model). Runs of many full-size steps use
# XLA_OPT_FLAGS (`cpu_env(fast_compile=False)`). Runs that a test compares always share them.
XLA_OPT_FLAGS = "--xla_cpu_multi_thread_eigen=false"
# (+ the module compiled in one piece: codegen split for parallel threads costs ~5 % more CPU)
XLA_TEST_FLAGS = (
    f"{XLA_OPT_FLAGS} --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
CACHE_ENV = "JAXPAR_TEST_COMPILATION_CACHE"  # set by conftest: the session's cache directory
LOCAL_ENV = "JAXPAR_TEST_LOCAL_DIR"  # set by conftest: the session's local snapshot tier root
# The environment the test process started with (conftest records it before any test runs): what
# `in_child` gives its subprocess, so nothing an earlier test left in os.environ reaches it.
START_ENV: dict[str, str] = dict(os.environ)
# gpt_tiny made smaller for runs whose point is not the model (checkpoints, faults, supervision):
# one layer of width 64 on batches of 16 x 32 tokens, a quarter of the recipe's 32 x 64. With the
# tests' unoptimised CPU code a step costs ~0.07 CPU-s on 8 simulated devices (the recipe's
# batches at this width ~0.14), and it compiles in seconds.
SMALL_MODEL = ("--set", "model.n_layers=1", "--set", "model.d_model=64", "--set", "model.d_mlp=128")
SMALL = (*SMALL_MODEL, "--set", "model.seq_len=32", "--set", "data.seq_len=32",
         "--set", "data.global_batch=16")  # fmt: skip


def cpu_env(
    devices: int | None = 8, cache: bool = True, fast_compile: bool = True
) -> dict[str, str]:
    """os.environ without JAXPAR_* variables, with XLA_FLAGS for `devices` simulated CPU devices
    (None: no device count, as `jaxpar launch` workers get) and the tests' XLA flags
    (XLA_OPT_FLAGS where not `fast_compile`).

    cache: use the session's persistent compilation cache, every program cached however fast it
    compiled (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0, ..._MIN_ENTRY_SIZE_BYTES=-1), and
    jaxpar's shared compiled-program tier next to it (JAXPAR_COMPILE_CACHE_DIR).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAR_")}
    count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    env["XLA_FLAGS"] = " ".join([*count, XLA_TEST_FLAGS if fast_compile else XLA_OPT_FLAGS])
    if os.environ.get(LOCAL_ENV):  # local snapshots in the session's temp dir, not /dev/shm
        env["JAXPAR_LOCAL_DIR"] = os.environ[LOCAL_ENV]
    if cache and os.environ.get(CACHE_ENV):
        env["JAX_COMPILATION_CACHE_DIR"] = os.environ[CACHE_ENV]
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
        # jax's cache serves process 0 of a multi-process job only; jaxpar's shared tier serves
        # every process (and what jax's cache served first is compiled again by the others)
        env["JAXPAR_COMPILE_CACHE_DIR"] = os.environ[CACHE_ENV] + "-jaxpar"
    return env


def train_cmd(run_dir, *args: str, steps: int | None = None, faults=()) -> list[str]:
    """`python -m train --run-dir RUN_DIR --no-progress [--steps N] [--fault F ...] ARGS`."""
    cmd = [sys.executable, "-m", "train", "--run-dir", str(run_dir), "--no-progress"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    for f in faults:
        cmd += ["--fault", f]
    return [*cmd, *args]


def start(cmd: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    """Start `cmd` in the checkout (or `cwd=`) in its own session (output discarded unless
    redirected)."""
    popen.setdefault("cwd", REPO)
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)
    env = cpu_env() if env is None else env
    return subprocess.Popen(cmd, env=env, start_new_session=True, **popen)


def run(
    cmd: list[str], env: dict | None = None, timeout: float = 600, merge: bool = False, cwd=REPO
) -> subprocess.CompletedProcess:
    """Run `cmd` to its end (see `start`) in `cwd`; stdout and stderr as text, stderr in stdout
    if `merge`.

    On timeout the process group is killed and an AssertionError carries the output's tail.
    jaxpar's own command lines in the checkout are forked from a preloaded pool
    (tests/support/forkserver.py): the same run without the ~1.7 CPU-s of imports.
    """
    env = cpu_env() if env is None else env
    if forkserver.forkable(cmd, cwd, REPO):
        done = forkserver.run(cmd, env, timeout, merge, REPO)
        if done is not None:
            return subprocess.CompletedProcess(cmd, *done)
    stderr = subprocess.STDOUT if merge else subprocess.PIPE
    proc = start(cmd, env, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        tail = f"{out[-3000:]}\n{(err or '')[-3000:]}"
        raise AssertionError(f"{cmd} timed out after {timeout}s:\n{tail}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ok(proc: subprocess.CompletedProcess, code: int = 0) -> subprocess.CompletedProcess:
    """Assert the exit code (negative: killed by that signal); returns `proc`."""
    tail = f"{(proc.stdout or '')[-3000:]}\n{(proc.stderr or '')[-3000:]}"
    assert proc.returncode == code, f"rc {proc.returncode} != {code}\n{tail}"
    return proc


def losses(run_dir) -> dict[int, float]:
    """step -> loss of a run directory's metrics.jsonl, the last line per step (after restarts)."""
    lines = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    return {s: m["loss"] for s, m in last_per_step(lines).items()}


def assert_exact(run_dir, ref: dict[int, float]) -> None:
    """The run's losses (last line per step) equal `ref`'s, bitwise, at every step."""
    got = losses(run_dir)
    assert sorted(got) == sorted(ref)
    diff = {s: (got[s], ref[s]) for s in ref if got[s] != ref[s]}
    assert not diff, f"losses differ from the uninterrupted run at steps {sorted(diff)}: {diff}"


def events(run_dir, name: str | None = None, incarnation: int | None = None) -> list[dict]:
    """A run directory's events.jsonl, optionally only one event name and/or incarnation."""
    return [
        e
        for e in read_jsonl(os.path.join(run_dir, "events.jsonl"))
        if (name is None or e["event"] == name)
        and (incarnation is None or e["incarnation"] == incarnation)
    ]


def plain_nodeid(item) -> str:
    """The node id without the `@group` suffix xdist's loadgroup adds."""
    mark = item.get_closest_marker("xdist_group")
    suffix = f"@{mark.args[0]}" if mark and mark.args else ""
    return item.nodeid[: -len(suffix)] if suffix and item.nodeid.endswith(suffix) else item.nodeid


def _child_env(env_name: str, keep: tuple[str, ...]) -> dict[str, str]:
    """START_ENV, not an xdist worker's (the child is a session of its own), marked `env_name`,
    with the variables named in `keep` as the test has set them (and the session's persistent
    compilation cache: what other tests compiled loads from there)."""
    env = {k: v for k, v in START_ENV.items() if not k.startswith("PYTEST_")}
    env.update({k: os.environ[k] for k in (CACHE_ENV, *keep) if k in os.environ})
    env[env_name] = "1"
    return env


def in_child(request, env_name: str, what: str, keep: tuple[str, ...] = ()) -> bool:
    """True when running in the fresh pytest subprocess that runs this one test (marked by the
    environment variable `env_name`); otherwise run that subprocess, assert it passed, and
    return False. For tests that need a process of their own: an XLA abort must not take the
    session down, or the test reads process-wide state (XLA's warnings on stderr) that earlier
    tests in the same worker may have changed."""
    if os.environ.get(env_name):
        return True
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-s", "-n", "0", "-p", "no:cacheprovider",
         plain_nodeid(request.node)],
        cwd=str(request.config.rootpath), env=_child_env(env_name, keep),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{what} in a subprocess failed (rc {proc.returncode}; negative = killed by a signal, "
        f"e.g. an XLA abort):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    print(proc.stdout[-500:])
    return False
