"""A standby worker: the next incarnation's worker, built while the current one trains.

`jaxpar launch --standby` starts, once a group has written its `compiled` event (so that the
compiled-program cache holds its step) and completed a step, the next incarnation's workers
with their final environment (process ids, their own jax coordinator, devices, incarnation N+1)
plus JAXPAR_STANDBY=1. Such a worker runs the normal worker path as far as it can without
knowing the failure — jax imported, `jax.distributed` initialised among the
standby processes, mesh and program built, train step loaded from RUN_DIR/compiled (read only) or
compiled, data source built, the step run once on a throwaway state of zeros (its collectives
connected; training.warm_step) — and then:

1. opens for reading the named pipe JAXPAR_STANDBY_GO, then writes the line `ready` to the named
   pipe JAXPAR_STANDBY_READY (both made by the supervisor in a private directory of its own,
   which it may remove from then on) and closes it;
2. blocks on the go pipe for one line: `{"log": PATH}` means go — its stdout/stderr move to the
   worker log PATH and it goes on with the normal path (lock, restore, `start` event, train);
   end of input (the supervisor closed the pipe, or died) or anything else releases it: it
   exits 0 at once.

The channels are named, not inherited, so the supervisor can fork a standby from its spare pool
(jaxpar/worker/spare.py: imports paid once, pages shared with the pool) as well as start it.
Before "go" a standby writes nothing to the run directory (no event, heartbeat, lock, log,
stack-dump file or compiled-program entry); its output goes to a file in the supervisor's
private directory, which the supervisor copies into the worker log on "go".

How this process came up is one `StartRole`, read once from what the supervisor set when it
spawned the process (`role()`): `wait_for_go` changes that object, never the environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from dataclasses import dataclass

from jaxpar.worker import bootstrap, spare

ENV_STANDBY = "JAXPAR_STANDBY"  # "1": this worker is a standby (waits for "go")
ENV_READY = "JAXPAR_STANDBY_READY"  # the named pipe the `ready` line goes to
ENV_GO = "JAXPAR_STANDBY_GO"  # the named pipe "go" (or the end of input) comes from
READY = b"ready\n"
MAX_GO = 1 << 16  # bytes of the "go" line


@dataclass
class StartRole:
    """How this worker process came up: `standby` (built ahead; `waiting` until its "go"),
    `spare` (a pre-started process handed a slot) or `cold`."""

    path: str
    waiting: bool = False
    ready_path: str | None = None
    go_path: str | None = None

    @classmethod
    def from_environment(cls, environ: dict[str, str]) -> StartRole:
        """What the supervisor said: JAXPAR_STANDBY (and its channels), JAXPAR_START_PATH."""
        if environ.get(ENV_STANDBY) == "1":
            return cls("standby", True, environ.get(ENV_READY), environ.get(ENV_GO))
        return cls("spare" if environ.get(bootstrap.ENV_START_PATH) == "spare" else "cold")

    def report_ready(self) -> None:
        path, self.ready_path = self.ready_path, None
        if path is None:
            return
        with contextlib.suppress(OSError):  # no reader: the supervisor is gone (go reads EOF)
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, READY)
            finally:
                os.close(fd)

    def wait_for_go(self) -> None:
        """Report ready, then block until "go" (returns) or release (exits 0). A no-op for a
        worker that is not a standby, or once it has gone."""
        if not self.waiting:
            return
        line = b""
        try:  # opened first: once `ready` is read, the supervisor may remove the names
            go = os.open(self.go_path or "", os.O_RDONLY | os.O_NONBLOCK)  # never waits
            os.set_blocking(go, True)  # reads do: until the line, or the writer's end
        except OSError:
            go = None
        if go is not None:
            self.report_ready()
            with os.fdopen(go, "rb") as f:
                line = f.readline(MAX_GO)
        try:
            msg = json.loads(line) if line.strip() else None
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("log"), str):
            sys.stdout.flush()
            os._exit(0)  # released: nothing was written, no jax shutdown barrier to wait in
        spare.redirect(msg["log"])  # stdout/stderr to the worker log, stdin from /dev/null
        self.waiting = False
        bootstrap.install_stack_dump()  # now that the run directory may be written


def dir_prefix(run_dir: str) -> str:
    """The name prefix of the supervisor's private directory for the standby workers of the run
    in `run_dir` (in the temporary directory): a waiting standby's stdout and stderr are a file
    there."""
    digest = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return f"jaxpar-standby-{digest}-"


_ROLE: list[StartRole] = []  # this process's role, read from its environment on first use


def role() -> StartRole:
    """This process's `StartRole` (one per process: the supervisor's word does not change)."""
    if not _ROLE:
        _ROLE.append(StartRole.from_environment(dict(os.environ)))
        for name in (ENV_STANDBY, ENV_READY, ENV_GO):  # read once; processes this one starts
            os.environ.pop(name, None)  # are not standbys (and the channels are this one's)
    return _ROLE[0]


def pending() -> bool:
    """A standby that has not been told to go yet."""
    return role().waiting


def wait_for_go() -> None:
    """`role().wait_for_go()`: the one place a standby waits (the loop, or a user's own loop's
    first run-directory writer); a no-op for any other worker."""
    role().wait_for_go()


def start_path() -> str:
    """How this worker came up, for its `start` event: standby | spare | cold."""
    return role().path
