"""This host's workers: spawn a group, reap exits the moment they happen, signal, stop, and keep
a spare pool that forks them (jaxpar/worker/spare.py; hot spares, one per slot, where a pool
cannot serve) and a standby group (jaxpar/worker/standby.py) for the next group."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time

from jaxpar.rundir import runlog
from jaxpar.supervisor.monitor import EventTail
from jaxpar.supervisor.options import (
    TOKEN_ENV,
    Options,
    cannot_write,
    free_port,
    join_address,
    say,
)
from jaxpar.supervisor.policy import worker_env
from jaxpar.supervisor.spare_pool import ForkedWorker, SparePool
from jaxpar.supervisor.standby_group import Standby
from jaxpar.worker import bootstrap
from jaxpar.worker import spare as spare_lib


class Wakeup:
    """Wait until something happens: a watched child exits (a pidfd becomes readable), or
    another thread calls `poke()` (a control-channel message). A timeout bounds the wait."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.sel.register(self._r, selectors.EVENT_READ)

    def poke(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe wakes the waiter all the same
            os.write(self._w, b"!")

    def watch(self, pid: int) -> int | None:
        """A pidfd for `pid` registered for wake-ups (None where the kernel has none)."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None
        self.sel.register(fd, selectors.EVENT_READ)
        return fd

    def unwatch(self, fd: int | None) -> None:
        if fd is None:
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.sel.unregister(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def wait(self, timeout: float) -> None:
        self.sel.select(max(0.0, timeout))
        with contextlib.suppress(OSError):
            while os.read(self._r, 4096):
                pass


def stopped_pids(pids: dict[int, int]) -> list[int]:
    """The keys of `pids` ({process id: os pid}) whose process is stopped (SIGSTOP: state T)."""
    out = []
    for key, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            out.append(key)
    return out


class LocalGroup:
    """This host's workers of one incarnation: spawn, reap, signal, stop."""

    def __init__(self, opts: Options, waker: Wakeup | None = None):
        self.opts = opts
        self.waker = waker or Wakeup()
        self.procs: dict[int, subprocess.Popen | ForkedWorker] = {}
        self.pidfds: dict[int, int | None] = {}
        self.logs: dict[int, str] = {}
        self.reported: set[int] = set()
        self.attempt = -1  # which group these workers are (exits are tagged with it)
        self.spec: dict | None = None
        self.spares: dict[int, subprocess.Popen] = {}  # local rank -> pre-started worker
        self.pool: SparePool | None = None  # forks this host's workers, from the first group on
        self.spares_due = False  # start spares once this group has started
        self.standby: Standby | None = None  # the next incarnation's workers, built ahead
        self.standby_due = False  # build it once this group has completed a step
        self.stepping = False  # the supervisor saw this group complete a step (heartbeats)
        self.seen: set[str] = set()  # this group's events seen so far (start, compiled)
        self.events: EventTail | None = None
        self.log_dir = os.path.join(self.opts.run_dir, runlog.LOGS)

    def _env(self, spec: dict, pid: int, local_rank: int) -> dict[str, str]:
        # the agents' secret stays with the agents: a worker needs none of it (the peer tier
        # makes its own group token), and whatever a worker runs would inherit it
        base = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        return worker_env(
            base, coordinator=spec["coordinator"], bind=spec["bind"],
            nproc=spec["nproc"], process_id=pid, local_rank=local_rank,
            devices_per_proc=self.opts.devices_per_proc, run_dir=self.opts.run_dir,
            incarnation=spec["incarnation"], faults=spec.get("faults", self.opts.faults),
            heartbeat_timeout=spec["collective_timeout"],
            collective_timeout=spec["collective_timeout"], layout=spec.get("layout"),
            run_lock=spec.get("run_lock"),
        )  # fmt: skip

    def start(self, spec: dict) -> None:
        """Start this host's workers of `spec` (the leader's plan), running this agent's own
        command line: a spec says where and as whom to run, never what."""
        self._unwatch_all()
        self.procs, self.logs, self.reported = {}, {}, set()
        self.attempt = int(spec["attempt"])
        self.spec = spec
        if spec.get("standby") and self.standby is not None:
            self._start_standby(spec)
            return
        self.release_standby()  # not the group it was built for (or not ready)
        for local_rank, pid in enumerate(spec["process_ids"]):
            env = self._env(spec, pid, local_rank)
            name = f"inc{spec['incarnation']}-group{spec['attempt']}-proc{pid}.log"
            path = os.path.join(self.log_dir, name)
            self.logs[pid] = path
            spare = self.spares.pop(local_rank, None)
            if spare is not None and self._hand_over(spare, env, self.opts.command, path):
                self.procs[pid] = spare
            elif (forked := self._fork(spec, env, path)) is not None:
                self.procs[pid] = forked
            else:
                with self._log(path) as log:
                    self.procs[pid] = subprocess.Popen(
                        self.opts.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                    )  # fmt: skip
            self.pidfds[pid] = self.waker.watch(self.procs[pid].pid)
        self.release_spares()  # ranks this group does not use (after a shrink)
        self._started()

    def _started(self) -> None:
        self.spares_due = self.opts.spares and not self.spares
        self.standby_due = self.opts.standby and self._standby_here()
        self.stepping = False
        self.seen = set()
        self.events = EventTail(os.path.join(self.opts.run_dir, runlog.EVENTS))  # from now

    def _log(self, path: str):
        """The worker log, opened for appending; /dev/null if it cannot be written."""
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            return open(path, "ab")
        except OSError as e:
            cannot_write(path, e)
            return open(os.devnull, "ab")

    def _unwatch_all(self) -> None:
        for fd in self.pidfds.values():
            self.waker.unwatch(fd)
        self.pidfds = {}

    # -- the spare pool: one preloaded process that forks this host's workers ----------------

    def _pool_wanted(self) -> bool:
        """Spares on, and a command a spare can run."""
        return self.opts.spares and spare_lib.target_of(self.opts.command) is not None

    def open_pool(self, spec: dict, env: dict | None = None) -> None:
        """Start this host's spare pool for the workers of `spec` (a group's first start), unless
        it runs or spares are off. A supervisor that holds the pool's imports forks it from
        itself while it has no thread but the main one (spare_pool._fork_preloaded), so one
        with threads to start (a replica group's hub) opens its pools first; only the
        start-up variables of `spec`'s workers reach the pool, each worker gets its own."""
        if self.pool is not None or not self._pool_wanted():
            return
        first = spec["process_ids"][0]
        env = env or self._env(spec, first, 0)
        with self._log(os.path.join(self.log_dir, f"spare-pool-proc{first}.log")) as log:
            target = spare_lib.target_of(self.opts.command) or ""
            self.pool = SparePool(env, target, log, fork_self=True)

    def open_pool_early(self) -> None:
        """`open_pool` before the first plan is known (a multi-node supervisor or agent, which
        starts threads to meet its peers): a provisional plan gives the workers' start-up
        variables, all the pool takes of it."""
        self.open_pool({"coordinator": "", "bind": "", "nproc": self.opts.nproc,
                        "process_ids": [0], "incarnation": 0, "collective_timeout": 0.0})  # fmt: skip

    def _fork(self, spec: dict, env: dict, path: str) -> ForkedWorker | None:
        """This worker forked from the pool (started with the job's first group), or None."""
        self.open_pool(spec, env)
        if self.pool is None:
            return None
        if self.pool.broken:
            return None
        forked = self.pool.fork({**env, bootstrap.ENV_START_PATH: "spare"}, self.opts.command, path)
        if forked is None:
            say(f"workers start cold from now on: {self.pool.broken}")
        return forked

    def warm(self, nproc: int) -> bool:
        """Whether a group of `nproc` workers on this host would start warm (imports done):
        from the pool, or from as many hot spares."""
        if self.pool is not None:
            return not self.pool.broken
        return len(self.spares) >= nproc or (self.spec is None and self._pool_wanted())

    def release_pool(self) -> None:
        """Once this host's workers are stopped: the pool exits (with the standby workers it
        forked: they are released first)."""
        if self.standby is not None and self.standby.pool is self.pool:
            self.release_standby()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # -- hot spares: the next group's workers, started while this one trains -----------------

    def _hand_over(self, spare: subprocess.Popen, env: dict, command: list[str], log: str) -> bool:
        """Give `spare` this worker's place (a spare still importing is ahead of a cold start
        all the same); False if it is gone."""
        if spare.poll() is not None or spare.stdin is None:
            self._stop_spare(spare)
            return False
        # the worker's `start` event records that it came up warm (unless the spare must exec
        # the command afresh: then it drops this)
        msg = {"env": {**env, bootstrap.ENV_START_PATH: "spare"}, "argv": command, "log": log}
        try:
            spare.stdin.write((json.dumps(msg) + "\n").encode())
            spare.stdin.close()
        except OSError:
            return False
        return True

    def _read_events(self) -> None:
        if (self.spares_due or self.standby_due) and self.spec and self.events is not None:
            inc = self.spec["incarnation"]
            self.seen |= {str(e.get("event")) for e in self.events.read()
                          if e.get("incarnation") == inc}  # fmt: skip

    def _maybe_start_spares(self) -> None:
        """Once this group has started (its `start` event: every worker has imported, joined
        jax.distributed and built its program), start one spare per local rank for the next
        group — so spares do not compete with the group's own start-up, yet are ready early."""
        if not self.spares_due or self.spec is None or runlog.WorkerEvent.START not in self.seen:
            return
        self.spares_due = False
        if self.pool is not None and not self.pool.broken:  # the pool stands in for spares;
            self.pool.prebuild()  # the run's config.json now exists: the model, built ahead
            return
        target = spare_lib.target_of(self.opts.command)
        if target is None:  # a spare runs `python -m MOD` or `python SCRIPT` of this interpreter
            return
        for local_rank, pid in enumerate(self.spec["process_ids"]):
            env = self._env(self.spec, pid, local_rank)
            env[spare_lib.ENV_TARGET] = target
            # named by the global process id: unique across replica groups and hosts
            path = os.path.join(self.log_dir, f"spare-proc{pid}.log")
            with self._log(path) as log:
                self.spares[local_rank] = subprocess.Popen(
                    [sys.executable, "-m", "jaxpar.worker.spare"], env=env, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.PIPE, start_new_session=True,
                )  # fmt: skip

    def _stop_spare(self, spare: subprocess.Popen) -> None:
        with contextlib.suppress(OSError):
            spare.kill()
        spare.wait(timeout=30)

    def release_spares(self) -> None:
        for spare in self.spares.values():
            self._stop_spare(spare)  # nothing to save in a spare: no jax state yet
        self.spares = {}

    # -- the standby group: the next incarnation, built while this one trains ---------------

    def _maybe_start_standby(self) -> None:
        """Once this group has compiled its step (its `compiled` event: the compiled-program
        cache holds the step the standby loads) and completed a step, build the next
        incarnation's group. Not before: on a small machine the build (a python + jax import,
        `jax.distributed` and a program load per process) would slow the group's first step,
        which after a failure is part of the recovery."""
        if not (self.standby_due and self.stepping and self.spec is not None):
            return
        if runlog.WorkerEvent.COMPILED not in self.seen:
            return
        self.standby_due = False
        self.release_standby()
        bind = self._standby_bind()
        port = free_port(bind)
        spec = dict(self.spec, incarnation=self.spec["incarnation"] + 1,
                    attempt=self.spec["attempt"] + 1, coordinator=join_address("127.0.0.1", port),
                    bind=join_address(bind, port), standby=True)  # fmt: skip
        pool = self.pool if self.pool is not None and not self.pool.broken else None
        self.standby = Standby(spec, self.opts.run_dir, pool)
        for local_rank, pid in enumerate(spec["process_ids"]):
            self.standby.spawn(pid, self.opts.command, self._env(spec, pid, local_rank))

    def _standby_here(self) -> bool:
        """Whether this host builds standby groups: a job's group spans every host, so one host."""
        return self.opts.nnodes == 1

    def _standby_bind(self) -> str:
        """Where a standby group's coordinator listens."""
        return self.opts.bind

    def standby_spec(self) -> dict | None:
        return self.standby.spec if self.standby is not None else None

    def standby_ready(self) -> bool:
        if self.standby is None:
            return False
        if self.standby.failed():  # a standby worker died while waiting: not worth keeping
            kept = self.standby.keep_logs(self.log_dir)
            say(f"the standby group failed before it was needed; its output: {', '.join(kept)}")
            self.release_standby()
            return False
        return self.standby.ready()

    def _start_standby(self, spec: dict) -> None:
        """The standby group becomes this group: its logs move to the worker logs, then "go"."""
        sb, self.standby = self.standby, None
        for pid, proc in sb.procs.items():
            name = f"inc{spec['incarnation']}-group{spec['attempt']}-proc{pid}.log"
            path = os.path.join(self.log_dir, name)
            self.logs[pid] = path
            sb.go(pid, path, self._log)
            self.procs[pid] = proc
            self.pidfds[pid] = self.waker.watch(proc.pid)
        sb.close_files()
        self._started()

    def release_standby(self) -> None:
        if self.standby is not None:
            self.standby.release()
            self.standby = None

    # -- the workers ---------------------------------------------------------------------------

    def poll(self) -> list[tuple[int, int]]:
        """Exits not reported before: [(process id, return code)]."""
        out = []
        for pid, p in self.procs.items():
            if pid not in self.reported and p.poll() is not None:
                self.reported.add(pid)
                self.waker.unwatch(self.pidfds.pop(pid, None))
                out.append((pid, p.returncode))
        self._read_events()
        self._maybe_start_spares()
        self._maybe_start_standby()
        return out

    def alive(self) -> list[int]:
        return [pid for pid, p in self.procs.items() if p.poll() is None]

    def stopped(self) -> list[int]:
        """Process ids of live workers that are stopped (SIGSTOP), in order."""
        return stopped_pids({pid: self.procs[pid].pid for pid in self.alive()})

    def send(self, sig: int) -> None:
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[pid].pid, sig)

    def stop(self, grace_s: float) -> dict:
        """SIGTERM the live workers, SIGKILL (their whole process group) after `grace_s`."""
        terminated = self.alive() if grace_s > 0 else []
        if terminated:
            self.send(signal.SIGTERM)
        deadline = time.time() + grace_s
        while self.alive() and time.time() < deadline:
            time.sleep(0.05)
        killed = self.alive()
        self.kill_all()
        self.reported |= set(self.procs)  # stopped on purpose: not exits to report
        self._unwatch_all()
        return {"terminated": len(terminated), "killed": len(killed)}

    def kill_all(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # the worker and anything it started
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                say(f"worker pid {p.pid} did not die after SIGKILL")


class LocalNode:
    """The leader's own workers, behind the same interface as a remote agent."""

    def __init__(self, opts: Options, waker: Wakeup):
        self.group = LocalGroup(opts, waker)
        self.lost = False
        self._result: dict = {}

    def start(self, spec: dict) -> None:
        self.group.start(spec)

    def poll(self) -> list[tuple[int, int]]:
        return self.group.poll()

    def group_stepping(self) -> None:
        """The supervisor saw the current group complete a step (its standby may be built)."""
        self.group.stepping = True

    def stopped(self) -> list[int]:
        return self.group.stopped()

    def signal(self, sig: int) -> None:
        self.group.send(sig)

    def request_stop(self, grace_s: float) -> None:
        self._result = self.group.stop(grace_s)

    def wait_stopped(self) -> dict:
        return self._result

    def log_of(self, pid: int) -> str | None:
        return self.group.logs.get(pid)

    def close(self, code: int) -> None:
        self.group.kill_all()
        self.group.release_spares()
        self.group.release_standby()
        self.group.release_pool()
