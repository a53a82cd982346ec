"""Worker-side process set-up: simulated CPU devices, jax.distributed from the environment,
progress heartbeats, fast exit on collective errors, stack dumps on request.

A worker (normally `python -m train`) calls, before jax's first use:

    launch.configure_devices()     # K simulated CPU devices, XLA timeouts
    launch.initialize_from_env()   # jax.distributed: explicit env / SLURM / Open MPI / K8s
    with launch.guard():           # collective error -> os._exit(EXIT_COLLECTIVE)
        ...train, calling launch.heartbeat(run_dir, step) when about to run each step...

The environment `jaxpar launch` (jaxpar/supervisor/) gives each worker is the contract below
(ENV_*); cluster launchers (srun, mpirun) give the environment jax detects itself. A worker
takes its run directory from JAXPAR_RUN_DIR when its command has no --run-dir (the supervisor
does not edit the command for that). XLA_FLAGS gets one compute thread per worker.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from jaxpar import _compat
from jaxpar.rundir import runlog

# Worker exit codes the supervisor understands (anything else non-zero is cause `exit`).
EXIT_PREEMPTED = 42  # a preemption notice (SIGTERM) was honoured: checkpoint saved, then exit
EXIT_COLLECTIVE = 43  # a collective / coordination error: a peer is gone, exit without waiting
EXIT_NAN = 44  # a non-finite loss (or a NaN state to be saved): roll back to the last checkpoint
EXIT_REPLICA = 45  # data-parallel replicas disagree: restart from the last good checkpoint
EXIT_USAGE = 2  # a usage or configuration error: the supervisor does not restart it
EXIT_NO_SPACE = 46  # the run directory's disk is full (ENOSPC): restarting cannot help

# The environment `jaxpar launch` gives each worker.
ENV_COORDINATOR = "JAXPAR_COORDINATOR"  # HOST:PORT of process 0's coordinator, fresh each time
ENV_COORDINATOR_BIND = "JAXPAR_COORDINATOR_BIND"  # where process 0 binds (default: the address)
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_DEVICES_PER_PROC = "JAXPAR_DEVICES_PER_PROC"
ENV_RUN_DIR = "JAXPAR_RUN_DIR"
ENV_INCARNATION = "JAXPAR_INCARNATION"
ENV_SUPERVISED = "JAXPAR_SUPERVISED"  # workers then leave summary.json to the supervisor
ENV_SUPERVISOR_PID = "JAXPAR_SUPERVISOR_PID"  # the worker dies with it (Linux PR_SET_PDEATHSIG)
ENV_FAULTS = "JAXPAR_FAULTS"  # fault specs, ';'-separated (jaxpar/worker/faults.py)
ENV_HEARTBEAT_TIMEOUT = "JAXPAR_HEARTBEAT_TIMEOUT_S"  # jax.distributed's dead-process timeout
ENV_COLLECTIVE_TIMEOUT = "JAXPAR_COLLECTIVE_TIMEOUT_S"  # a collective waiting longer aborts
# After an elastic shrink: the layout the training loop must use, whatever its command line says
# (jaxpar.worker.training applies it, so any entrypoint can be shrunk).
ENV_START_PATH = "JAXPAR_START_PATH"  # a spare handed a slot: "spare" (else standby or cold)
ENV_MESH = "JAXPAR_MESH"  # mesh spec, e.g. "data=4,fsdp=1,tensor=1,pipeline=1"
ENV_MICROBATCHES = "JAXPAR_MICROBATCHES"  # gradient-accumulation microbatches per step
# A replica group's worker (`jaxpar launch --groups`): its index among all the job's processes
# (group * P + process id), which names its heartbeat and stack files
ENV_GLOBAL_PROCESS = "JAXPAR_GLOBAL_PROCESS"

COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"
HEARTBEAT_DIR = runlog.HEARTBEATS
STACKS_DIR = runlog.STACKS
_HISTORY = 16  # (step, time) pairs kept in a progress heartbeat, for straggler detection

_state: dict[str, Any] = {
    "hb_dir": None,
    "history": [],
    "stack_file": None,
    "versions_checked": False,
}


def configure_devices() -> None:
    """Give the CPU backend simulated devices unless XLA_FLAGS already sets a count.

    JAXPAR_DEVICES_PER_PROC (set by `jaxpar launch`) wins; otherwise 8. Only affects the CPU
    backend, so it is harmless where an accelerator is present. Also turns
    JAXPAR_COLLECTIVE_TIMEOUT_S into XLA's CPU collective timeout. Must run before jax's first use.
    """
    import jax

    flags = os.environ.get("XLA_FLAGS", "")
    timeout = os.environ.get(ENV_COLLECTIVE_TIMEOUT)
    if timeout and COLLECTIVE_TIMEOUT_FLAG not in flags:
        flags = f"{flags} {COLLECTIVE_TIMEOUT_FLAG}={int(float(timeout))}".strip()
        os.environ["XLA_FLAGS"] = flags
    per_proc = os.environ.get(ENV_DEVICES_PER_PROC)
    if per_proc:
        jax.config.update("jax_num_cpu_devices", int(per_proc))
    elif "xla_force_host_platform_device_count" not in flags:
        jax.config.update("jax_num_cpu_devices", 8)


def detect_cluster(env: dict[str, str] | None = None) -> str | None:
    """Which launcher described this process: "explicit", "slurm", "ompi", "k8s" or None.

    "k8s" is an Indexed Job / JobSet pod (JOB_COMPLETION_INDEX) whose manifest gives
    JAXPAR_COORDINATOR and JAXPAR_NUM_PROCESSES; the index is the process id.
    """
    env = os.environ if env is None else env
    if env.get(ENV_COORDINATOR):
        return "k8s" if ENV_PROCESS_ID not in env and "JOB_COMPLETION_INDEX" in env else "explicit"
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "ompi"
    return None


def timeouts_from_env() -> dict[str, int]:
    """jax.distributed timeouts: the supervisor's values, not jax's 100 s / 300 s defaults."""
    hb = int(float(os.environ.get(ENV_HEARTBEAT_TIMEOUT, "100")))
    coll = os.environ.get(ENV_COLLECTIVE_TIMEOUT)
    shutdown = int(float(coll)) if coll else 300
    return {"heartbeat_timeout_seconds": max(hb, 1), "shutdown_timeout_seconds": max(shutdown, 1)}


COORDINATOR_POLL_S = 0.005
COORDINATOR_WAIT_S = 30.0


def wait_for_coordinator(addr: str, timeout_s: float = COORDINATOR_WAIT_S) -> bool:
    """Return once `addr` (HOST:PORT, the coordination service process 0 starts) accepts a TCP
    connection: True; False after `timeout_s` (jax.distributed then reports what it finds).

    A process whose jax.distributed client connects before process 0's service listens is
    turned away, and gRPC waits out its reconnect backoff (about a second) before it tries
    again: a restarted group then spent 1.2-1.5 s in its init instead of 0.3, whenever a peer
    was forked a few milliseconds before process 0. Polling the port first costs nothing when
    it is already up."""
    host, _, port = addr.rpartition(":")
    if not port.isdigit():
        return False  # not HOST:PORT: jax.distributed says what is wrong with it
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(COORDINATOR_POLL_S)


def initialize_from_env(*, stack_dump: bool = True) -> bool:
    """Start jax.distributed when the environment describes a multi-process job.

    Explicit (`jaxpar launch`, or a K8s manifest): JAXPAR_COORDINATOR, JAXPAR_NUM_PROCESSES,
    JAXPAR_PROCESS_ID (JOB_COMPLETION_INDEX on K8s). SLURM (srun) and Open MPI (mpirun):
    jax's own cluster detection. CPU workers use gloo collectives. The coordinator binds to the
    address it is given (loopback for `jaxpar launch` on one host) unless
    JAXPAR_COORDINATOR_BIND says otherwise. `stack_dump=False` (a standby before its "go")
    installs no stack-dump file in the run directory. Returns whether jax.distributed was started.
    """
    kind = detect_cluster()
    die_with_supervisor()
    if kind is None:
        warn_versions()
        return False
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = timeouts_from_env()
    if os.environ.get(ENV_COORDINATOR_BIND):
        kwargs["coordinator_bind_address"] = os.environ[ENV_COORDINATOR_BIND]
    if kind in ("explicit", "k8s"):
        addr = os.environ[ENV_COORDINATOR]
        pid_var = ENV_PROCESS_ID if kind == "explicit" else "JOB_COMPLETION_INDEX"
        kwargs.setdefault("coordinator_bind_address", addr)
        process_id = int(os.environ[pid_var])
        if process_id != 0:
            wait_for_coordinator(addr)
        jax.distributed.initialize(
            addr,
            num_processes=int(os.environ[ENV_NUM_PROCESSES]),
            process_id=process_id,
            **kwargs,
        )
    else:
        jax.distributed.initialize(cluster_detection_method=kind, **kwargs)
    if stack_dump:
        install_stack_dump()
    if jax.process_index() == 0:
        warn_versions()
    return True


def warn_versions() -> None:
    """Print `_compat.check_versions()`'s warnings to stderr, once per process: the installed
    jax, jaxlib or orbax-checkpoint differs from the version jaxpar's use of its internals was
    tested with (nothing with constraints.txt's pins). Process 0's set-up calls it."""
    if _state["versions_checked"]:
        return
    _state["versions_checked"] = True
    for line in _compat.check_versions():
        print(f"jaxpar: warning: {line}", file=sys.stderr, flush=True)


def barrier(name: str) -> None:
    """Wait until every process of the jax.distributed job gets here (no-op without one).

    The coordination service's barrier, not a collective: gloo gives the first collective over a
    set of devices 30 s for every peer to join it, so a process that compiles much sooner than
    its peers (a persistent-cache hit that only process 0 gets, a loaded host) fails there
    unless they start it together. Waits up to the collective timeout (at least 300 s).
    """
    if not distributed_active():
        return
    timeout_s = max(300, timeouts_from_env()["shutdown_timeout_seconds"])
    _compat.distributed_client().wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)


def die_with_supervisor() -> None:
    """Ask Linux to SIGKILL this worker if its supervisor dies (no orphaned workers)."""
    parent = os.environ.get(ENV_SUPERVISOR_PID)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the supervisor died before prctl took effect
        os._exit(1)


def install_stack_dump() -> None:
    """SIGUSR1 dumps every thread's Python stack to RUN_DIR/stacks/inc<I>-proc<P>.txt.

    faulthandler writes from the C signal handler, so it works while the main thread is blocked
    in a collective or a sleep. The supervisor sends SIGUSR1 before killing a hung group.
    """
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir or _state["stack_file"] is not None or not hasattr(signal, "SIGUSR1"):
        return
    os.makedirs(os.path.join(run_dir, STACKS_DIR), exist_ok=True)
    path = os.path.join(run_dir, STACKS_DIR, f"inc{_incarnation()}-proc{_process_index()}.txt")
    f = open(path, "a")  # kept open for the process's life: the handler writes to its fd
    _state["stack_file"] = f
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)


def process_index() -> int:
    import jax

    return jax.process_index()


def _process_index() -> int:
    if ENV_GLOBAL_PROCESS in os.environ:
        return int(os.environ[ENV_GLOBAL_PROCESS])
    if ENV_PROCESS_ID in os.environ:
        return int(os.environ[ENV_PROCESS_ID])
    import jax

    return jax.process_index()


def _incarnation() -> int:
    return incarnation_from_env() or 0


def incarnation_from_env() -> int | None:
    """The incarnation number `jaxpar launch` assigned (None when not launched by it)."""
    value = os.environ.get(ENV_INCARNATION)
    return int(value) if value else None


def heartbeat(run_dir: str, step: int) -> None:
    """Record progress: atomically write RUN_DIR/heartbeats/proc<P>.json.

    Call it when `step` steps are done and the process is about to run the next one, before
    anything that synchronises processes (a global device_put checks values across processes):
    a slow process then arrives here late (stragglers), a hung one not at all (hangs).
    {"step", "time", "pid", "incarnation", "recent": [[step, time], ...]}. Costs ~0.1 ms.
    """
    hb_dir = _state["hb_dir"]
    if hb_dir is None or not hb_dir.startswith(os.path.abspath(run_dir)):
        hb_dir = os.path.join(os.path.abspath(run_dir), HEARTBEAT_DIR)
        os.makedirs(hb_dir, exist_ok=True)
        _state["hb_dir"], _state["history"] = hb_dir, []
    now = time.time()
    history = _state["history"]
    history.append([int(step), now])
    del history[:-_HISTORY]
    record = {
        "step": int(step),
        "time": now,
        "pid": os.getpid(),
        "incarnation": incarnation_from_env(),
        "recent": history,
    }
    path = os.path.join(hb_dir, f"proc{_process_index()}.json")
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: leave no 0-byte temporary file behind
            os.remove(tmp)
        raise


def read_heartbeat(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def distributed_active() -> bool:
    try:
        return _compat.distributed_client() is not None
    except ImportError:  # no jax
        return False


# An XLA status as jax raises it outside JaxRuntimeError: with one device per process a gloo
# collective whose peer died fails with "ValueError: UNKNOWN: Gloo AllGather failed: ...
# Connection closed by peer" (jax 0.10; with several local devices it is a JaxRuntimeError).
_XLA_STATUS_ERROR = re.compile(
    r"^(UNKNOWN|INTERNAL|UNAVAILABLE|ABORTED|CANCELLED|DEADLINE_EXCEEDED|FAILED_PRECONDITION): "
    r".*(Gloo|gloo|[Cc]ollective|[Cc]oordination)",
    re.DOTALL,
)


def is_collective_error(exc: BaseException) -> bool:
    """A runtime error from XLA (gloo, the coordination service): in a multi-process job it
    means a peer is gone or the job is being torn down."""
    try:
        import jax
    except ImportError:
        return False
    if isinstance(exc, jax.errors.JaxRuntimeError):
        return True
    return isinstance(exc, (ValueError, RuntimeError)) and bool(_XLA_STATUS_ERROR.match(str(exc)))


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Leave at once on an error in a multi-process job, instead of waiting in jax's shutdown
    barrier for the dead peer (2-6 s or more): collective errors exit with EXIT_COLLECTIVE,
    other exceptions with 1, after printing the traceback. SystemExit passes through.

    Measured with gloo: a peer that dies between collectives makes the next one fail within
    ~0.03 s; a peer killed while the others are inside a collective leaves them blocked with no
    error until the collective timeout, so the supervisor stops such survivors itself."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        if not distributed_active():
            raise
        code = EXIT_COLLECTIVE if is_collective_error(e) else 1
        what = "collective/coordination error" if code == EXIT_COLLECTIVE else "error"
        print(f"jaxpar worker: {what}, exiting with code {code}", file=sys.stderr)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_worker(fn: Callable[[], int | None]) -> int:
    """Run `fn` under `guard()`; returns its exit code (None -> 0)."""
    with guard():
        return fn() or 0
