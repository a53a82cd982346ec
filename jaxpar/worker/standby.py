"""A standby worker: the next incarnation's worker, built while the current one trains.

`jaxpar launch --standby` starts, once a group has written its `compiled` event (so that the
compiled-program cache holds its step) and completed a step, the next incarnation's workers
with their final environment (process ids, their own jax coordinator, devices, incarnation N+1)
plus JAXPAR_STANDBY=1. Such a worker runs the normal worker path as far as it can without
knowing the failure — jax imported, `jax.distributed` initialised among the
standby processes, mesh and program built, train step loaded from RUN_DIR/compiled (read only) or
compiled, data source built, the step run once on a throwaway state of zeros (its collectives
connected; training.warm_step) — and then:

1. writes the line `ready` to the file descriptor named by JAXPAR_STANDBY_FD (a pipe the
   supervisor reads) and closes it;
2. blocks on its stdin for one line: `{"log": PATH}` means go — its stdout/stderr move to the
   worker log PATH and it goes on with the normal path (lock, restore, `start` event, train);
   end of input (or anything else) releases it: it exits 0 at once.

Before "go" a standby writes nothing to the run directory (no event, heartbeat, lock, log,
stack-dump file or compiled-program entry); its output goes to a temporary file the supervisor
copies into the worker log on "go".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from jaxpar.worker import bootstrap, spare

ENV_STANDBY = "JAXPAR_STANDBY"  # "1": this worker is a standby (waits for "go")
ENV_READY_FD = "JAXPAR_STANDBY_FD"  # the pipe the `ready` line goes to
ENV_PATH = "JAXPAR_START_PATH"  # how this worker came up: standby | spare | cold
READY = b"ready\n"


def pending() -> bool:
    """A standby that has not been told to go yet."""
    return os.environ.get(ENV_STANDBY) == "1"


@contextlib.contextmanager
def no_run_dir():
    """Hide the run directory from what runs inside (jax.distributed start-up installs a stack
    dump file there); a standby must not write it before "go"."""
    saved = os.environ.pop(bootstrap.ENV_RUN_DIR, None) if pending() else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ[bootstrap.ENV_RUN_DIR] = saved


def report_ready() -> None:
    fd = os.environ.get(ENV_READY_FD)
    if fd is None:
        return
    with contextlib.suppress(OSError, ValueError):
        os.write(int(fd), READY)
        os.close(int(fd))


def wait_for_go() -> None:
    """Report ready, then block until "go" (returns) or release (exits 0). A no-op for a worker
    that is not a standby, or once it has gone."""
    if not pending():
        return
    report_ready()
    line = sys.stdin.readline()
    try:
        msg = json.loads(line) if line.strip() else None
    except ValueError:
        msg = None
    if not isinstance(msg, dict) or not isinstance(msg.get("log"), str):
        sys.stdout.flush()
        os._exit(0)  # released: nothing was written, no jax shutdown barrier to wait in
    spare.redirect(msg["log"])  # stdout/stderr to the worker log, stdin from /dev/null
    os.environ.pop(ENV_STANDBY, None)
    os.environ.pop(ENV_READY_FD, None)
    os.environ[ENV_PATH] = "standby"
    bootstrap.install_stack_dump()  # now that the run directory may be written


def start_path() -> str:
    """How this worker came up, for its `start` event: standby | spare | cold."""
    if os.environ.get(ENV_PATH):
        return os.environ[ENV_PATH]
    return "spare" if os.environ.get("JAXPAR_WARM_START") == "1" else "cold"
