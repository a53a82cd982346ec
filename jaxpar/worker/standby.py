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

How this process came up is one `StartRole`, read once from what the supervisor set when it
spawned the process (`role()`): `wait_for_go` changes that object, never the environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass

from jaxpar.worker import bootstrap, spare

ENV_STANDBY = "JAXPAR_STANDBY"  # "1": this worker is a standby (waits for "go")
ENV_READY_FD = "JAXPAR_STANDBY_FD"  # the pipe the `ready` line goes to
READY = b"ready\n"


@dataclass
class StartRole:
    """How this worker process came up: `standby` (built ahead; `waiting` until its "go"),
    `spare` (a pre-started process handed a slot) or `cold`."""

    path: str
    waiting: bool = False
    ready_fd: int | None = None

    @classmethod
    def from_environment(cls, environ: dict[str, str]) -> StartRole:
        """What the supervisor said: JAXPAR_STANDBY (and its ready pipe), JAXPAR_START_PATH."""
        if environ.get(ENV_STANDBY) == "1":
            fd = environ.get(ENV_READY_FD)
            return cls("standby", waiting=True, ready_fd=int(fd) if fd else None)
        return cls("spare" if environ.get(bootstrap.ENV_START_PATH) == "spare" else "cold")

    def report_ready(self) -> None:
        fd, self.ready_fd = self.ready_fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(fd, READY)
            os.close(fd)

    def wait_for_go(self) -> None:
        """Report ready, then block until "go" (returns) or release (exits 0). A no-op for a
        worker that is not a standby, or once it has gone."""
        if not self.waiting:
            return
        self.report_ready()
        line = sys.stdin.readline()
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


_ROLE: list[StartRole] = []  # this process's role, read from its environment on first use


def role() -> StartRole:
    """This process's `StartRole` (one per process: the supervisor's word does not change)."""
    if not _ROLE:
        _ROLE.append(StartRole.from_environment(dict(os.environ)))
        for name in (ENV_STANDBY, ENV_READY_FD):  # read once; processes this one starts are
            os.environ.pop(name, None)  # not standbys (and the ready pipe is this one's)
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
