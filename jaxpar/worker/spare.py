"""A pre-started worker ("hot spare"): pays Python's and jax's import time before it is needed.

`jaxpar launch` starts one spare per local process slot while a group trains, when the command
is `python -m MOD ARGS` or `python SCRIPT ARGS` of this interpreter. A spare imports jax and
jaxpar's dependencies (no backend is initialised: device count and collectives are still open),
then blocks on its stdin. When the group fails, the supervisor hands each spare the new
incarnation as one JSON line, {"env": {...}, "argv": [...], "log": PATH}; the spare points its
stdout/stderr at the worker log, takes that environment and runs the command in-process via
runpy, as `python -m MOD` or `python SCRIPT` would (a script's directory first on sys.path, in
place of the current one). End of input releases it (exit 0).

What a cold start reads at import time must not differ: if an environment variable named JAX_*
or XLA_* changed since the spare started, or a jax backend was already initialised, the spare
replaces itself with the command (`os.execvpe`) — correct, just not faster.

    python -m jaxpar.worker.spare      # started by the supervisor, never by hand
"""

from __future__ import annotations

import dataclasses
import gc
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
    "jaxpar.api",  # an entrypoint of one's own (jaxpar.entrypoint, build, CheckpointManager)
)
IMPORT_TIME_PREFIXES = ("JAX_", "XLA_")
ENV_TARGET = "JAXPAR_SPARE_TARGET"  # the supervisor's `target_of(command)`, for the preload


def _this_interpreter(exe: str) -> bool:
    path = shutil.which(exe)
    same_dir = path and os.path.dirname(os.path.abspath(path)) == os.path.dirname(sys.executable)
    # same interpreter, same venv (not another one, or a launcher script in front of one)
    return bool(same_dir and os.path.samefile(path, sys.executable))


def module_of(argv: list[str]) -> str | None:
    """MOD of `python -m MOD ...` with this interpreter, else None."""
    if len(argv) < 3 or argv[1] != "-m":
        return None
    return argv[2] if _this_interpreter(argv[0]) else None


def script_of(argv: list[str]) -> str | None:
    """SCRIPT of `python SCRIPT ...` with this interpreter (a file, no interpreter options before
    it), else None."""
    if len(argv) < 2 or argv[1].startswith("-") or not os.path.isfile(argv[1]):
        return None
    return argv[1] if _this_interpreter(argv[0]) else None


def target_of(argv: list[str]) -> str | None:
    """What a spare can run of a command: `module:MOD` or `script:PATH`, else None."""
    module = module_of(argv)
    if module is not None:
        return f"module:{module}"
    script = script_of(argv)
    return f"script:{script}" if script is not None else None


def preload(target: str | None) -> None:
    """Import what the command will (`target`: target_of's). A script runs with its own
    directory first on sys.path instead of the current one, so the imports look there too."""
    kind, _, name = (target or "").partition(":")
    if kind == "script":
        sys.path[0] = _script_dir(name)
    for module in PRELOAD:
        importlib.import_module(module)
    if kind == "module":  # the command's package (not its __main__), e.g. `train` for -m train
        try:
            importlib.import_module(name.split(".")[0])
        except ImportError:
            pass
    from jaxpar.parallel.program import code_digest

    code_digest()  # part of the train step's cache key: read now, not after a failure
    from jaxpar.worker import groups

    if groups.active():  # a replica group's spare: torch imported and its store started now
        groups.engine()
    prebuild_model(os.environ.get(bootstrap.ENV_RUN_DIR))
    # What is imported now lives as long as the process: out of the collector's sight, so a
    # full collection while the worker traces and restores does not walk it again
    gc.collect()
    gc.freeze()


def prebuild_model(run_dir: str | None) -> None:
    """Build the run's model abstractly (engine.model.prebuild: no devices needed) from the
    config.json the running group wrote, for the worker this spare becomes; it also warms jax's
    tracing caches. Anything unexpected (no config, a model class that will not import) leaves
    the build to the worker."""
    from jaxpar.engine import model as model_lib

    if not run_dir:
        return
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            raw = json.load(f)
        values = raw["model"]
        module, _, qualname = values["_class"].partition(":")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: tuple(v) if isinstance(v, list) else v
                  for k, v in values.items() if k in names}  # fmt: skip
        model_cfg = cls(**kwargs)
        model_lib.prebuild(model_cfg, int(raw["train"]["seed"]))
        prebuild_source(raw["data"], model_cfg)
    except Exception as e:  # noqa: BLE001 - the worker builds it as a cold start does
        print(f"spare: model not prebuilt ({type(e).__name__}: {e})", flush=True)


def prebuild_source(data: dict, model_cfg) -> None:
    """Build the run's data source once and drop it, when it is one of jaxpar's registered
    sources (never a MODULE:CALLABLE of the user's): what the sources keep per process (the
    text corpus, scikit-learn's digits and its import) is then loaded when the worker builds it."""
    from jaxpar.data import sources as data_lib

    name = data.get("source")
    if not isinstance(name, str) or name not in data_lib.SOURCE_REGISTRY:
        return
    data_lib.make_source(
        name, seq_len=getattr(model_cfg, "seq_len", data.get("seq_len", 64)),
        vocab_size=getattr(model_cfg, "vocab_size", 256), seed=int(data.get("seed", 0)),
        path=data.get("path", ""), dtype=data.get("dtype", ""),
    )  # fmt: skip


def _script_dir(script: str) -> str:
    return os.path.dirname(os.path.realpath(script))  # as `python SCRIPT` puts it on sys.path


def backend_initialised() -> bool:
    """Whether jax created a backend here (True too when this jax hides that: then the spare
    execs the command, which is always correct; the worker warns about the jax version)."""
    try:
        return _compat.xla_backends_initialized()
    except _compat.InternalChanged:
        return True


def can_run_here(env: dict[str, str], argv: list[str]) -> bool:
    """Whether running `argv` in this process equals a cold start of it."""
    if target_of(argv) is None or backend_initialised():
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
    module, script = module_of(argv), script_of(argv)
    if module is not None:
        sys.argv = [module, *argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *argv[2:]]
        sys.path[0] = _script_dir(script)
        runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main() -> int:
    bootstrap.die_with_supervisor()  # no orphans: a spare dies with the supervisor
    preload(os.environ.get(ENV_TARGET))
    print(f"spare {os.getpid()}: ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # released
    activate(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
