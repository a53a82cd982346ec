"""The job's state that the leader's loop and each incarnation share.

`Supervisor` (loop.py) is a `JobState`; an `Incarnation` (incarnation.py) gets the same object,
reads the job's options, nodes and slots, writes supervisor events through `event`, and records
the slowest start-up seen (`startup_measured`), from which the next incarnation's start-up
timeout follows (`timeouts`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from jaxpar.rundir import ownership, runlog
from jaxpar.rundir.runlog import append_line
from jaxpar.supervisor.group import LocalNode, Wakeup
from jaxpar.supervisor.options import Options, cannot_write, say

if TYPE_CHECKING:
    from jaxpar.rundir.ownership import RunDirLock
    from jaxpar.supervisor.transport import RemoteNode


class JobState:
    """What every incarnation of one `jaxpar launch` job reads and updates."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.run_dir = os.path.abspath(opts.run_dir)
        self.events_path = os.path.join(self.run_dir, runlog.EVENTS)
        self.waker = Wakeup()
        self.nodes: list[LocalNode | RemoteNode] = []
        self.slots: list[tuple[int, int]] = []  # (node, local index), indexed by process id
        self.layout: dict | None = None  # after a shrink: {"mesh", "microbatches"} for workers
        self.lock: RunDirLock | None = None  # held for the whole job
        self.incarnation = 0
        self.restarts = 0  # group restarts of any kind
        self.counted = 0  # those that count against --max-restarts
        self.stop_request: int | None = None
        self.startup_measured: float | None = None  # the slowest start-up to the first step
        self.faults_seen: list[dict] = []
        self.timeouts_warned = False  # the collective-vs-hang warning is said once per job

    def take_lock(self) -> bool:
        """Create the run directory and hold its lock for the whole job (a second `jaxpar
        launch` or `python -m train` on it refuses); False, said in one line, if it cannot."""
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            self.lock = ownership.acquire(self.run_dir, "jaxpar launch")
        except ValueError as e:
            say(f"error: {e}")
            return False
        except OSError as e:
            say(f"error: cannot write the run directory {self.run_dir}: {e.strerror or e}")
            return False
        return True

    def event(self, name: str, **fields: Any) -> None:
        """Append a supervisor event to the run's events.jsonl (a full disk is said, not fatal)."""
        line = {"event": name, "time": time.time(), "incarnation": self.incarnation, **fields}
        try:
            append_line(self.events_path, line)
        except OSError as e:
            cannot_write(self.events_path, e)

    def timeouts(self) -> tuple[float, float, float]:
        """(hang, start-up, collective) timeouts in seconds for the next incarnation."""
        o = self.opts
        hang = o.hang_timeout or 60.0
        if o.startup_timeout:
            startup = o.startup_timeout
        else:
            startup = max(120.0, 3 * self.startup_measured) if self.startup_measured else 600.0
        coll = o.collective_timeout or (2 * hang + 60 if o.hang_timeout else 600.0)
        if coll <= hang and not self.timeouts_warned:
            self.timeouts_warned = True
            say(f"warning: collective timeout {coll:.0f}s <= hang timeout {hang:.0f}s: a hang "
                f"may be reported as the peers' collective error")  # fmt: skip
        return hang, startup, coll
