"""A pre-started worker ("hot spare"): pays Python's and jax's import time before it is needed.

`jaxpar launch` starts one spare per local process slot while a group trains. A spare imports
jax and jaxpar's dependencies (no backend is initialised: device count and collectives are
still open), then blocks on its stdin. When the group fails, the supervisor hands each spare the
new incarnation as one JSON line, {"env": {...}, "argv": [...], "log": PATH}; the spare points
its stdout/stderr at the worker log, takes that environment and runs the command in-process
(`python -m MOD ARGS` via runpy, as `python -m` would). End of input releases it (exit 0).

What a cold start reads at import time must not differ: if an environment variable named JAX_*
or XLA_* changed since the spare started, or a jax backend was already initialised, the spare
replaces itself with the command (`os.execvpe`) — correct, just not faster.

    python -m jaxpar.worker.spare      # started by the supervisor, never by hand
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import shutil
import sys

from jaxpar import _compat
from jaxpar.worker import bootstrap

# Imported ahead of need: what a jaxpar worker imports before its first step.
PRELOAD = (
    "numpy",
    "jax",
    "jax.numpy",
    "flax.nnx",
    "optax",
    "orbax.checkpoint",
    "jaxpar.worker.training",
    "jaxpar.recovery.checkpoint",
    "jaxpar.worker.bootstrap",
)
IMPORT_TIME_PREFIXES = ("JAX_", "XLA_")


def module_of(argv: list[str]) -> str | None:
    """MOD of `python -m MOD ...` with this interpreter, else None."""
    if len(argv) < 3 or argv[1] != "-m":
        return None
    exe = shutil.which(argv[0])
    same_dir = exe and os.path.dirname(os.path.abspath(exe)) == os.path.dirname(sys.executable)
    if same_dir and os.path.samefile(exe, sys.executable):  # same interpreter, same venv
        return argv[2]
    return None  # another interpreter or venv (or a launcher script in front of one)


def preload(command_module: str | None) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    if command_module:  # the command's package (not its __main__), e.g. `train` for -m train
        try:
            importlib.import_module(command_module.split(".")[0])
        except ImportError:
            pass


def backend_initialised() -> bool:
    """Whether jax created a backend here (True too when this jax hides that: then the spare
    execs the command, which is always correct; the worker warns about the jax version)."""
    try:
        return _compat.xla_backends_initialized()
    except _compat.InternalChanged:
        return True


def can_run_here(env: dict[str, str], argv: list[str]) -> bool:
    """Whether running `argv` in this process equals a cold start of it."""
    if module_of(argv) is None or backend_initialised():
        return False
    keys = {k for k in (*env, *os.environ) if k.startswith(IMPORT_TIME_PREFIXES)}
    return all(env.get(k) == os.environ.get(k) for k in keys)


def redirect(log: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def activate(msg: dict) -> None:
    """Become the worker `msg` describes (never returns)."""
    env, argv = dict(msg["env"]), list(msg["argv"])
    redirect(msg["log"])
    if not can_run_here(env, argv):
        env.pop(bootstrap.ENV_START_PATH, None)  # a cold start after all
        os.execvpe(argv[0], argv, env)
    os.environ.clear()
    os.environ.update(env)  # the worker's environment, as an exec would set it
    module = module_of(argv)
    sys.argv = [module, *argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def main() -> int:
    bootstrap.die_with_supervisor()  # no orphans: a spare dies with the supervisor
    preload(os.environ.get("JAXPAR_SPARE_MODULE"))
    print(f"spare {os.getpid()}: ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # released
    activate(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
