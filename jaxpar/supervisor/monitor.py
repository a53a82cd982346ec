"""Watching one incarnation through the run directory: progress heartbeats, new events, the step
in progress, and the hang decision. Times are the supervisor's clock (hosts' clocks may differ)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from dataclasses import dataclass, field

from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import WorkerEvent
from jaxpar.supervisor.policy import Outcome
from jaxpar.worker import bootstrap


class Heartbeats:
    """Progress of one incarnation from RUN_DIR/heartbeats/proc<P>.json."""

    def __init__(self, run_dir: str, nproc: int, incarnation: int):
        self.dir = os.path.join(run_dir, bootstrap.HEARTBEAT_DIR)
        self.nproc, self.incarnation = nproc, incarnation
        self.first: dict[int, int] = {}
        self.last: dict[int, tuple[int, float]] = {}  # process -> (step, seen at)
        self.recent: dict[int, list] = {}
        self.stepping_since: float | None = None  # when a completed step was first seen

    def clear(self) -> None:
        """Remove the previous incarnation's heartbeats (files only: never follows a link)."""
        if not os.path.isdir(self.dir) or os.path.islink(self.dir):
            return
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if os.path.islink(path) or os.path.isfile(path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    def update(self, now: float) -> None:
        for p in range(self.nproc):
            rec = bootstrap.read_heartbeat(os.path.join(self.dir, f"proc{p}.json"))
            if not isinstance(rec, dict) or rec.get("incarnation") != self.incarnation:
                continue
            try:
                step = int(rec["step"])
            except (KeyError, TypeError, ValueError):
                continue
            recent = rec.get("recent")
            self.recent[p] = recent if isinstance(recent, list) else []
            self.first.setdefault(p, step)
            if p not in self.last or self.last[p][0] != step:
                self.last[p] = (step, now)
        # A step completed: a process arrived at a later step than it started at (its own
        # history holds two arrivals), or was seen to advance. Workers may get several steps
        # ahead of the first read: that is progress too.
        if self.stepping_since is None and any(
            s > self.first[p] or len(self.recent.get(p, [])) >= 2 for p, (s, _) in self.last.items()
        ):
            self.stepping_since = now

    def max_step(self) -> int | None:
        return max((s for s, _ in self.last.values()), default=None)

    def stalest(self, now: float) -> tuple[int, float]:
        """The process whose progress is oldest, and for how long (clock starts at stepping);
        among equals the one at the lowest step (the others wait for it)."""
        assert self.stepping_since is not None

        def key(p: int) -> tuple[float, int]:
            step, seen = self.last.get(p, (-1, self.stepping_since))
            return now - max(seen, self.stepping_since), -step

        p = max(range(self.nproc), key=key)
        return p, key(p)[0]

    def step_time(self) -> float | None:
        times = [t for r in self.recent.values() for t in _intervals(r)]
        return statistics.median(times) if times else None


def _intervals(recent: list) -> list[float]:
    try:
        pairs = zip(recent[:-1], recent[1:], strict=True)
        return [b[1] - a[1] for a, b in pairs if b[0] == a[0] + 1]
    except (TypeError, IndexError):
        return []


class EventTail:
    """New complete lines of events.jsonl since the last call."""

    def __init__(self, path: str):
        self.path = path
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict):
                out.append(e)
        return out


@dataclass
class Seen:
    """What the events of the current incarnation have told the supervisor so far."""

    lost: set[int] = field(default_factory=set)  # processes gone for good (permanent faults)
    save_open: float | None = None  # a save began (supervisor clock) and has not ended
    finishing: float | None = None  # past the last step (`done`) or a worker exited 0


class Monitor:
    """One incarnation's heartbeats and events, and what they mean."""

    def __init__(self, run_dir: str, nproc: int, incarnation: int, faults_seen: list[dict]):
        self.run_dir, self.nproc, self.incarnation = run_dir, nproc, incarnation
        self.hb = Heartbeats(run_dir, nproc, incarnation)
        self.hb.clear()
        self.tail = EventTail(os.path.join(run_dir, runlog.EVENTS))
        self.seen = Seen()
        self.faults_seen = faults_seen  # every incarnation's `fault_injected`, kept by the loop

    def read_events(self, now: float) -> None:
        for e in self.tail.read():
            kind = e.get("event")
            if kind == WorkerEvent.FAULT_INJECTED:
                self.faults_seen.append(e)
                if e.get("permanent"):
                    try:
                        self.seen.lost.add(int(e.get("process", 0)))
                    except (TypeError, ValueError):
                        continue
            elif kind == WorkerEvent.SAVE_BEGIN:
                self.seen.save_open = now
            elif kind == WorkerEvent.SAVE_END:
                self.seen.save_open = None
            elif kind in (WorkerEvent.DONE, WorkerEvent.WALL_TIME_LIMIT):
                self.seen.finishing = now

    def _faults(self, kinds: tuple[str, ...]) -> list[dict]:
        return [e for e in self.faults_seen
                if e.get("incarnation") == self.incarnation and e.get("kind") in kinds]  # fmt: skip

    def hang(
        self, now: float, t_spawn: float, hang_s: float, startup_s: float, auto: bool,
        stopped: list[int],
    ) -> Outcome | None:  # fmt: skip
        """A hang, or None. Before any step completed only the start-up timeout applies; after,
        the stalest process's time without progress (an open save gets the start-up time).
        `auto`: the limit is at least 10 step times. `stopped`: processes seen stopped
        (SIGSTOP) — they are the ones blamed."""
        hb = self.hb
        if hb.stepping_since is None:
            if now - t_spawn <= startup_s:
                return None
            missing = [p for p in range(self.nproc) if p not in hb.last]
            blame = stopped or missing or [0]
            return Outcome("failure", "hang", blame[0], None, None,
                           detail=f"no first step within the start-up timeout {startup_s:.0f}s")  # fmt: skip
        limit = max(hang_s, 10 * (hb.step_time() or 0.0)) if auto else hang_s
        p, stale = hb.stalest(now)
        if self.seen.save_open is not None:  # a save may compile; give it the start-up time
            if now - self.seen.save_open <= startup_s:
                return None
            stale = now - self.seen.save_open
        elif stale <= limit:
            return None
        hung = self._faults(("hang",))
        if hung:
            p = int(hung[-1].get("process", p))
        elif stopped:
            p = stopped[0]
        return Outcome("failure", "hang", p, None, self.failed_step(),
                       detail=f"no progress for {stale:.1f}s", max_step=hb.max_step(),
                       stale_s=stale)  # fmt: skip

    def failed_step(self) -> int | None:
        """The step in progress at the failure: the injected fault's, else one past the last
        completed one (heartbeats and metrics of this incarnation)."""
        ending = self._faults(runlog.ENDING_FAULTS)
        if ending:
            return int(ending[-1]["step"])
        done = [s for s in (self.hb.max_step(), self._last_logged_step()) if s is not None]
        return max(done) + 1 if done else None

    def _last_logged_step(self) -> int | None:
        path = os.path.join(self.run_dir, runlog.METRICS)
        try:
            with open(path, "rb") as f:
                start = max(0, os.path.getsize(path) - 8192)
                f.seek(start)
                lines = f.read().splitlines()[1 if start else 0 :]  # the first may be cut
        except OSError:
            return None
        for line in reversed(lines):
            try:
                m = json.loads(line)
                if "loss" in m and m.get("incarnation") == self.incarnation:
                    return int(m["step"])
            except (ValueError, TypeError, AttributeError, KeyError):
                continue
        return None


def stack_files(run_dir: str, incarnation: int) -> list[str]:
    """The non-empty stack dumps of `incarnation`, relative to the run directory."""
    d = os.path.join(run_dir, bootstrap.STACKS_DIR)
    prefix = f"inc{incarnation}-"
    try:
        names = [n for n in os.listdir(d) if n.startswith(prefix)]
        return sorted(os.path.join(bootstrap.STACKS_DIR, n) for n in names
                      if os.path.getsize(os.path.join(d, n)) > 0)  # fmt: skip
    except OSError:
        return []


def drop_empty_stack_files(run_dir: str) -> None:
    """Remove the empty dump files of workers that were never asked (never follows a link)."""
    d = os.path.join(run_dir, bootstrap.STACKS_DIR)
    try:
        for n in os.listdir(d) if os.path.isdir(d) and not os.path.islink(d) else []:
            path = os.path.join(d, n)
            if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) == 0:
                os.remove(path)
    except OSError:
        return
