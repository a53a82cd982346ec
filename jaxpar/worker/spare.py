"""A pre-started worker ("hot spare"): pays Python's and jax's import time before it is needed.

`jaxpar launch` starts one spare per local process slot while a group trains, when the command
is `python -m MOD ARGS` or `python SCRIPT ARGS` of this interpreter. A spare imports jax and
jaxpar's dependencies (no backend is initialised: device count and collectives are still open),
then blocks on its stdin. When the group fails, the supervisor hands each spare the new
incarnation as one JSON line, {"env": {...}, "argv": [...], "log": PATH}; the spare points its
stdout/stderr at the worker log, takes that environment and runs the command in-process via
runpy, as `python -m MOD` or `python SCRIPT` would (a script's directory first on sys.path, in
place of the current one). End of input releases it (exit 0).

What a cold start reads at start-up and import time must not differ: if an environment variable
named JAX_*, XLA_* or PYTHON* (PYTHONPATH: where the imports come from) changed since the spare
started, or a jax backend was already initialised, the spare replaces itself with the command
(`os.execvpe`) — correct, just not faster.

The spare pool (`python -m jaxpar.worker.spare --pool`) is the same preload in one process per
host that forks each worker instead of becoming one: `jaxpar launch` starts it with a job's first
group and asks it for every worker of every group (the first one too), so a host pays the
imports once rather than once per worker and per restart. Its protocol, one JSON line each way
(requests on stdin, replies on stdout; the pool's own output goes to stderr):

    {"op": "fork", "env": {...}, "argv": [...], "log": PATH}  ->  {"forked": PID}
                                                                   | {"refused": WHY}
    {"op": "prebuild"}   build the run's model abstractly now (config.json exists by then)
    (a forked worker ends)                     ->  {"exit": PID, "code": CODE, "cpu_s": SECONDS}

A fork request may add "stderr": PATH (the worker's stderr apart from its stdout, which goes to
the log). A forked worker is a child of the pool (its parent-death signal follows the pool, which
dies with the supervisor); CODE is what `subprocess.Popen.returncode` would say (-N: signal N),
SECONDS the CPU time it used with the processes it waited for (as `wait4` reports it). The
pool forks only while it is what a cold start would be: one Python thread, no jax backend, and
the worker's JAX_*/XLA_*/PYTHON* environment its own. End of input: the pool exits once its
workers have.

    python -m jaxpar.worker.spare      # started by the supervisor, never by hand
    python -m jaxpar.worker.spare --pool
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import importlib
import json
import os
import runpy
import selectors
import shutil
import sys
import threading
import traceback

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
# read when the interpreter starts (PYTHONPATH, PYTHONHASHSEED, ...) or jax is imported
IMPORT_TIME_PREFIXES = ("JAX_", "XLA_", "PYTHON")
# ... except what jax reads only when the worker calls it (jax.distributed.initialize), which a
# worker's slot sets apart from its neighbours'
RUN_TIME_ONLY = frozenset({"JAX_LOCAL_DEVICE_IDS"})
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


def preload(target: str | None, pool: bool = False) -> None:
    """Import what the command will (`target`: target_of's). A script runs with its own
    directory first on sys.path instead of the current one, so the imports look there too.
    `pool`: this process forks workers, so it starts no thread (a replica group's engine only
    imported: each worker starts its own)."""
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

    if groups.active() and pool:  # the group engine's import (torch), never its threads
        try:
            importlib.import_module("torch.distributed")
        except ImportError:
            pass  # the worker says so: its exchange goes through the hub
    elif groups.active():  # a replica group's spare: torch imported and its store started now
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

    if not run_dir or not os.path.exists(os.path.join(run_dir, "config.json")):
        return  # a new run: its first group writes it (the pool prebuilds when asked, then)
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
    return target_of(argv) is not None and same_start(env)


def same_start(env: dict[str, str]) -> bool:
    """Whether this process is what an interpreter started with `env` would be once it imported
    jax: no jax backend yet, and the same JAX_*/XLA_*/PYTHON* variables."""
    if backend_initialised():
        return False
    keys = {k for k in (*env, *os.environ)
            if k.startswith(IMPORT_TIME_PREFIXES) and k not in RUN_TIME_ONLY}  # fmt: skip
    return all(env.get(k) == os.environ.get(k) for k in keys)


def redirect(log: str, stderr: str | None = None) -> None:
    """stdout (and stderr, unless `stderr` names its own file) appended to `log`; stdin from
    /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    streams = {log: (1,), stderr: (2,)} if stderr and stderr != log else {log: (1, 2)}
    for path, targets in streams.items():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for target in targets:
            os.dup2(fd, target)
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
    _run(argv)
    sys.exit(0)


def _run(argv: list[str]) -> None:
    """Run `argv` (target_of's kinds) in this process, as `python -m MOD` / `python SCRIPT`."""
    module, script = module_of(argv), script_of(argv)
    if module is not None:
        sys.argv = [module, *argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *argv[2:]]
        sys.path[0] = _script_dir(script)
        runpy.run_path(script, run_name="__main__")


# -- the spare pool: one preloaded process per host that forks the workers -------------------

MAX_REQUEST = 16 << 20  # bytes of one request line (an environment and a command line)


def exit_code(code: object) -> int:
    """The process exit status `sys.exit(code)` gives (None: 0; an int; anything else printed
    to stderr: 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """End a forked worker as the interpreter would end a cold one: wait for its non-daemon
    threads, run its atexit functions, flush, exit with `code` (never returns)."""
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - as at interpreter exit: reported, the code stands
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _forked_worker(msg: dict, server_fds: list[int]) -> None:
    """In the child the pool just forked: become the worker `msg` describes (never returns)."""
    code = 1
    try:
        os.setsid()  # its own session and process group, as the supervisor's Popen gives
        for fd in server_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        env = dict(msg["env"])
        env[bootstrap.ENV_SUPERVISOR_PID] = str(os.getppid())  # it dies with the pool
        stderr = msg.get("stderr")
        redirect(msg["log"], stderr if isinstance(stderr, str) else None)
        os.environ.clear()
        os.environ.update(env)
        _name_process(f"jaxpar-proc{env.get(bootstrap.ENV_PROCESS_ID, '')}")
        bootstrap.die_with_supervisor()
        # what the pool froze stays frozen, as in a spare: the worker's collections never walk
        # (or write to, page by page, as the fork shares them) the imported objects
        _run(list(msg["argv"]))
        code = 0
    except SystemExit as e:
        code = exit_code(e.code)
    except BaseException:  # noqa: BLE001 - an uncaught exception, as the interpreter reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def _name_process(name: str) -> None:
    """The name `top`, `pgrep NAME` and `ps -o comm` show (Linux; its command line stays the
    pool's)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_name = 15
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _Pool:
    """The pool's loop: requests from the supervisor, forks, and the exits of its workers."""

    def __init__(self, requests: int, replies: int):
        self.requests, self.replies = requests, replies
        self.sel = selectors.DefaultSelector()
        self.sel.register(requests, selectors.EVENT_READ, None)
        self.children: dict[int, int] = {}  # pid -> pidfd
        self.buf = b""
        self.open = True

    def reply(self, msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        while data:
            data = data[os.write(self.replies, data) :]

    def why_not(self, msg: dict) -> str:
        """Why a fork now would not equal a cold start of `msg` ("" if it would)."""
        if threading.active_count() != 1:
            return f"{threading.active_count()} Python threads in the pool"
        if not can_run_here(dict(msg["env"]), list(msg["argv"])):
            return "a cold start would differ (a jax backend, or JAX_*/XLA_*/PYTHON* changed)"
        return ""

    def fork(self, msg: dict) -> None:
        why = self.why_not(msg)
        if why:
            self.reply({"refused": why})
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            fds = [self.requests, self.replies, self.sel.fileno(), *self.children.values()]
            _forked_worker(msg, fds)
        fd = os.pidfd_open(pid)
        self.children[pid] = fd
        self.sel.register(fd, selectors.EVENT_READ, pid)
        self.reply({"forked": pid})

    def handle(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        op = msg.get("op") if isinstance(msg, dict) else None
        if op == "fork":
            self.fork(msg)
        elif op == "prebuild":
            prebuild_model(os.environ.get(bootstrap.ENV_RUN_DIR))
            gc.collect()
            gc.freeze()
        else:
            print(f"spare pool: ignored a request it does not know ({line[:80]!r})", flush=True)

    def read_requests(self) -> None:
        chunk = os.read(self.requests, 1 << 16)
        if not chunk:  # released: no more workers; exit once the ones running have
            self.open = False
            self.sel.unregister(self.requests)
            return
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                self.handle(line)
        if len(self.buf) > MAX_REQUEST:
            raise SystemExit(f"spare pool: a request over {MAX_REQUEST} bytes")

    def reap(self, pid: int) -> None:
        _, status, usage = os.wait4(pid, 0)
        fd = self.children.pop(pid)
        self.sel.unregister(fd)
        os.close(fd)
        cpu_s = round(usage.ru_utime + usage.ru_stime, 3)
        self.reply({"exit": pid, "code": os.waitstatus_to_exitcode(status), "cpu_s": cpu_s})

    def loop(self) -> None:
        while self.open or self.children:
            for key, _ in self.sel.select():
                if key.data is None:
                    self.read_requests()
                else:
                    self.reap(key.data)


def serve(requests: int | None = None, replies: int | None = None) -> int:
    """The spare pool's process (see the module's doc); `requests` and `replies`: descriptors
    already apart from 0/1/2 (a pool forked from a preloaded supervisor: spare_pool.py)."""
    bootstrap.die_with_supervisor()  # and its workers with it (their parent-death signal)
    # requests and replies on descriptors of their own: what the pool or a worker prints never
    # reaches the protocol, and a worker's 0/1/2 are its own from the fork on
    how = "forked from the supervisor's imports"
    if requests is None or replies is None:
        requests, replies, how = os.dup(0), os.dup(1), "imports done"
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    preload(os.environ.get(ENV_TARGET), pool=True)
    print(f"spare pool {os.getpid()}: ready ({how})", flush=True)
    _Pool(requests, replies).loop()
    return 0


def main() -> int:
    if sys.argv[1:] == ["--pool"]:
        return serve()
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
