"""One incarnation of the job: spawn the group on every node, watch it until it is done or fails
(exits the moment they happen; hangs from progress heartbeats; stragglers; permanent slot loss
from `fault_injected`), dump stacks if hung, record the failure and stop the survivors."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import SupervisorEvent
from jaxpar.supervisor.job import JobState
from jaxpar.supervisor.monitor import Monitor, drop_empty_stack_files, stack_files
from jaxpar.supervisor.options import free_port, join_address, say
from jaxpar.supervisor.policy import (
    Outcome,
    classify_exit,
    find_stragglers,
    restart_path,
    root_exit,
    secondary,
)
from jaxpar.worker import bootstrap

HB_EVERY_S = 0.25  # heartbeat files are read this often; exits wake the loop at once
TAIL_LINES = 12  # of a failed worker's log, echoed on the console
# Lines that stay in the worker logs but never reach the console: gloo's "Rank R is connected to
# N peer ranks" (one per process and incarnation, nothing about the failure).
CONSOLE_NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def console_tail(text: str, n: int = TAIL_LINES) -> list[str]:
    """The last `n` lines of a worker log's `text` worth showing on the console (CONSOLE_NOISE
    dropped), each with its line end."""
    lines = text.splitlines(keepends=True)
    return [x for x in lines if not CONSOLE_NOISE.match(x)][-n:]


def say_log_tail(log: str | None) -> None:
    """Echo the last lines of a failed worker's log on the console (its error line among them),
    under the log's path; nothing when the log is absent or unreadable."""
    if not log or not os.path.exists(log):
        return
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 16384))  # the tail of a large log
            last = console_tail(f.read().decode(errors="replace"))
    except OSError:
        return
    if last:
        say(f"last lines of {log}:\n" + "".join("    " + x for x in last).rstrip())


def status_line(incarnation: int, step: int | None, step_time: float | None, said: int | None):
    """The periodic console line on progress, or None: nothing to say until the first heartbeat,
    and a step already reported is not reported again (a long compile showed step 0 twice)."""
    if step is None or step == said:
        return None
    return f"incarnation {incarnation}: step {step}" + (
        f", {step_time:.2f}s/step" if step_time else ""
    )


class Incarnation:
    """One group of workers on every node, from spawn to stopped survivors."""

    def __init__(self, job: JobState):
        self.job = job

    def run(self, nproc: int) -> Outcome:
        host = self.job.opts.host if self.job.opts.nnodes > 1 else "127.0.0.1"
        port = free_port(self.job.opts.bind)
        coordinator = join_address(host, port)
        bind = join_address(self.job.opts.bind, port)
        hang, startup, coll = self.job.timeouts()
        mon = Monitor(self.job.run_dir, nproc, self.job.incarnation, self.job.faults_seen)
        specs = []
        for n in range(len(self.job.nodes)):
            ids = [pid for pid, (nn, _) in enumerate(self.job.slots) if nn == n]
            specs.append({"incarnation": self.job.incarnation, "coordinator": coordinator,
                          "bind": bind, "nproc": nproc, "process_ids": ids,
                          "attempt": self.job.restarts, "faults": self.job.opts.faults,
                          "collective_timeout": coll, "layout": self.job.layout,
                          "run_lock": self.job.lock.token})  # fmt: skip
        path, why = self._restart_path(specs[0])
        if path == "standby":  # the standby group already runs its own jax coordinator
            sb = self.job.nodes[0].group.standby_spec() or {}
            coordinator, bind = sb["coordinator"], sb["bind"]
            specs[0].update(coordinator=coordinator, bind=bind, standby=True)
        self.job.event(SupervisorEvent.GROUP_STARTED, nproc=nproc, coordinator=coordinator, attempt=self.job.restarts,
                   hang_timeout_s=self.job.opts.hang_timeout, startup_timeout_s=startup,
                   collective_timeout_s=coll, path=path,
                   **({"standby_unused": why} if why else {}))  # fmt: skip
        t_spawn = time.time()
        for node, spec in zip(self.job.nodes, specs, strict=True):
            node.start(spec)
        say(
            f"incarnation {self.job.incarnation}: {nproc} processes started, coordinator {coordinator}"
        )
        out = self._watch(nproc, mon, t_spawn, hang, startup)
        if mon.hb.stepping_since is not None:  # the slowest start-up so far sets the next timeout
            measured = mon.hb.stepping_since - t_spawn
            self.job.startup_measured = max(self.job.startup_measured or 0.0, measured)
        if out.kind in ("failure", "preempted"):
            self._record(out)
        self._stop_group(out)
        return out

    def _restart_path(self, want: dict) -> tuple[str, str]:
        """standby | spares | cold for the group about to start, and why not the standby."""
        group = self.job.nodes[0].group
        warm = group.warm(len(want["process_ids"]))
        if self.job.incarnation == 0 and group.standby is None:
            return ("spares" if warm else "cold"), ""  # the job's first start
        return restart_path(
            enabled=self.job.opts.standby, nnodes=len(self.job.nodes), standby=group.standby_spec(),
            ready=group.standby_ready(), want=want,
            spares=warm,
        )  # fmt: skip

    def _record(self, out: Outcome) -> None:
        if out.kind == "preempted":
            self.job.event(
                SupervisorEvent.PREEMPTION, process=out.process, code=out.code, step=out.step
            )
            return
        fields: dict[str, Any] = {"cause": out.cause, "process": out.process, "code": out.code,
                                  "step": out.step}  # fmt: skip
        if out.code is not None and out.code < 0:
            fields["signal"] = signal.Signals(-out.code).name
        for name in ("detail", "lost", "exits", "stale_s"):
            if getattr(out, name) not in (None, "", []):
                fields[name] = getattr(out, name)
        self.job.event(SupervisorEvent.FAILURE, **fields)
        where = f" at step {out.step}" if out.step is not None else " during start-up"
        injected = [e.get("spec") for e in self.job.faults_seen
                    if e.get("incarnation") == self.job.incarnation
                    and e.get("kind") in runlog.ENDING_FAULTS]  # fmt: skip
        why = f" — injected fault {injected[-1]}" if injected else ""
        say(f"failure{where}: {out.cause} of process {out.process} (code {out.code}) "
            f"{out.detail}".rstrip() + why)  # fmt: skip
        if out.cause != "hang":
            say_log_tail(self._log_of(out.process))

    def _log_of(self, pid: int | None) -> str | None:
        if pid is None or pid >= len(self.job.slots):
            return None
        return self.job.nodes[self.job.slots[pid][0]].log_of(pid)

    def _stop_group(self, out: Outcome) -> None:
        t = time.time()
        if out.cause == "hang":
            for node in self.job.nodes:
                node.signal(signal.SIGCONT)  # a stopped worker cannot dump (nor die of SIGTERM)
                node.signal(signal.SIGUSR1)
            deadline = time.time() + 2.0  # faulthandler writes at once; files may be remote
            while (
                len(stack_files(self.job.run_dir, self.job.incarnation)) < len(self.job.slots)
                and time.time() < deadline
            ):
                time.sleep(0.05)
            time.sleep(0.1)  # let the last one finish writing
            files = stack_files(self.job.run_dir, self.job.incarnation)
            self.job.event(SupervisorEvent.STACKS_DUMPED, process=out.process, files=files)
            say(f"stacks of every worker dumped to {', '.join(files) or '(none)'}")
        # A failed group's survivors cannot finish a collective without the lost peer (a SIGTERM
        # would only start a preemption save that cannot complete): kill them at once.
        grace = {"done": 30.0, "failure": 0.0}.get(out.kind, self.job.opts.grace_s)
        for node in reversed(self.job.nodes):  # remote agents first: they stop in parallel
            node.request_stop(grace)
        stopped = [node.wait_stopped() for node in self.job.nodes]
        drop_empty_stack_files(self.job.run_dir)
        if out.kind == "done":
            return
        self.job.event(SupervisorEvent.SURVIVORS_STOPPED, seconds=time.time() - t,
                   terminated=sum(s.get("terminated", 0) for s in stopped),
                   killed=sum(s.get("killed", 0) for s in stopped))  # fmt: skip

    def _stopped(self) -> list[int]:
        """Process ids of workers seen stopped (SIGSTOP) on any host, in order."""
        return sorted(
            {p for node in self.job.nodes for p in node.stopped()} & set(range(len(self.job.slots)))
        )

    def _watch(self, nproc: int, mon: Monitor, t_spawn: float, hang: float, startup: float):
        exits: list[tuple[int, int]] = []
        first_bad: float | None = None
        reported: set[int] = set()
        hb, seen = mon.hb, mon.seen
        next_hb = next_status = 0.0
        said = None  # the step of the last status line: a step is reported once
        while True:
            now = time.time()
            if self.job.stop_request is not None:
                return self._honour_signal(nproc, exits)
            for n, node in enumerate(self.job.nodes):
                exits += node.poll()
                gone = [p for p, (nn, _) in enumerate(self.job.slots) if nn == n]
                if node.lost and gone:
                    return Outcome("failure", "exit", gone[0], None, mon.failed_step(), gone,
                                   f"agent of node {n} lost", hb.max_step())  # fmt: skip
            mon.read_events(now)
            if now >= next_hb:
                hb.update(now)
                next_hb = now + HB_EVERY_S
                self._stragglers(hb, reported)
                if hb.stepping_since is not None:
                    for node in self.job.nodes:
                        node.group_stepping()
            codes = dict(exits)
            bad = [(p, c) for p, c in exits if c != 0]
            if len(codes) == nproc and not bad:
                return Outcome("done", max_step=hb.max_step())
            if bad:
                first_bad = first_bad or now
                preempt = all(c == bootstrap.EXIT_PREEMPTED for _, c in bad)
                # wait briefly for the root cause only if all we have are its consequences
                root_seen = any(secondary(c) == 0 for _, c in bad)
                settle = self.job.opts.preempt_grace_s if preempt else (0.0 if root_seen else 0.3)
                if len(codes) < nproc and now - first_bad < settle:
                    self.job.waker.wait(min(settle - (now - first_bad), HB_EVERY_S))
                    continue
                hb.update(time.time())
                mon.read_events(now)
                p, c = root_exit(exits)
                kind = "preempted" if preempt and len(codes) == nproc else "failure"
                cause = "preempted" if kind == "preempted" else classify_exit(c)
                return Outcome(kind, cause, p, c, mon.failed_step(), sorted(seen.lost),
                               max_step=hb.max_step(), exits=exits)  # fmt: skip
            if codes or seen.finishing is not None:  # past the last step: no heartbeats now
                seen.finishing = seen.finishing or now
                if now - seen.finishing > max(60.0, hang):
                    p = min(set(range(nproc)) - set(codes))
                    return Outcome("failure", "hang", p, None, mon.failed_step(),
                                   detail="did not exit after the last step")  # fmt: skip
            else:
                auto = self.job.opts.hang_timeout is None
                out = mon.hang(now, t_spawn, hang, startup, auto, self._stopped())
                if out is not None:
                    return out
            if now >= next_status:
                line = status_line(self.job.incarnation, hb.max_step(), hb.step_time(), said)
                if next_status and line:
                    said = hb.max_step()
                    say(line)
                next_status = now + self.job.opts.status_every_s
            self.job.waker.wait(max(0.0, next_hb - time.time()))

    def _stragglers(self, hb, reported: set[int]) -> None:
        for s in find_stragglers(hb.recent, self.job.opts.straggler_factor):
            if s["process"] in reported:
                continue
            reported.add(s["process"])
            self.job.event(SupervisorEvent.STRAGGLER, **s)
            factor = f"{s['factor']:.1f}x" if s["factor"] is not None else "many times"
            say(
                f"straggler: process {s['process']} reaches each step {s['lag_s']:.2f}s after the "
                f"others ({factor} their step time) at step {s['step']}"
            )

    def _honour_signal(self, nproc: int, exits: list[tuple[int, int]]) -> Outcome:
        sig = self.job.stop_request
        if sig == signal.SIGTERM:
            say("SIGTERM: passing the preemption notice to the workers (they save and exit)")
            for node in self.job.nodes:
                node.signal(signal.SIGTERM)
            deadline = time.time() + self.job.opts.preempt_grace_s
            while len(dict(exits)) < nproc and time.time() < deadline:
                for node in self.job.nodes:
                    exits += node.poll()
                self.job.waker.wait(self.job.opts.poll_s)
            return Outcome("stopped", "preempted", code=bootstrap.EXIT_PREEMPTED)
        say("interrupted: stopping the workers")
        return Outcome("stopped", "interrupted", code=130)
