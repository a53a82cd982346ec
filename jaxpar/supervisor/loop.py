"""The leader's loop: one group of workers per incarnation, restarted until done or given up.

spawn a group (fresh coordinator port, incarnation = earlier `start` events) -> watch (exits the
moment they happen; hangs from progress heartbeats; stragglers; permanent slot loss from
`fault_injected`) -> dump stacks if hung -> stop survivors (SIGTERM, SIGKILL after a grace) ->
decide (uncounted restart after a preemption, backoff, crash loop, budget, shrink) -> respawn.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
from typing import Any

from jaxpar import launch as L
from jaxpar import rundir, runlog
from jaxpar.mesh import mesh_text
from jaxpar.runlog import S, W, append_line, read_jsonl, write_json
from jaxpar.supervisor.channel import token
from jaxpar.supervisor.group import LocalNode, Wakeup
from jaxpar.supervisor.monitor import Monitor, drop_empty_stack_files, stack_files
from jaxpar.supervisor.options import Options, cannot_write, free_port, join_address, say
from jaxpar.supervisor.policy import (
    CrashLoop,
    Outcome,
    backoff_s,
    classify_exit,
    find_stragglers,
    restart_path,
    root_exit,
    secondary,
    shrink_plan,
)
from jaxpar.supervisor.transport import RemoteNode, Rendezvous

HB_EVERY_S = 0.25  # heartbeat files are read this often; exits wake the loop at once


class Supervisor:
    """Runs the job: one group of workers per incarnation, restarted until done or given up."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.run_dir = os.path.abspath(opts.run_dir)
        self.events_path = os.path.join(self.run_dir, runlog.EVENTS)
        self.waker = Wakeup()
        self.nodes: list[LocalNode | RemoteNode] = []
        self.slots: list[tuple[int, int]] = []  # (node, local index), indexed by process id
        self.layout: dict | None = None  # after a shrink: {"mesh", "microbatches"} for workers
        self.lock: rundir.RunDirLock | None = None  # held for the whole job
        self.incarnation = 0
        self.restarts = 0  # group restarts of any kind
        self.counted = 0  # those that count against --max-restarts
        self.stop_request: int | None = None
        self.startup_measured: float | None = None
        self.faults_seen: list[dict] = []

    def event(self, name: str, **fields: Any) -> None:
        line = {"event": name, "time": time.time(), "incarnation": self.incarnation, **fields}
        try:
            append_line(self.events_path, line)
        except OSError as e:
            cannot_write(self.events_path, e)

    def _count_starts(self) -> int:
        return sum(1 for e in read_jsonl(self.events_path) if e.get("event") == W.START)

    def _on_signal(self, signum, frame) -> None:
        if self.stop_request is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_request = signum
        self.waker.poke()

    # -- the whole job ------------------------------------------------------------------------

    def run(self) -> int:
        t0 = time.time()
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            # one job per run directory: a second `jaxpar launch` or `python -m train` refuses
            self.lock = rundir.acquire(self.run_dir, "jaxpar launch")
        except ValueError as e:
            say(f"error: {e}")
            return 2
        except OSError as e:
            say(f"error: cannot write the run directory {self.run_dir}: {e.strerror or e}")
            return 2
        try:
            key = token(self.opts) if self.opts.nnodes > 1 else b""
        except ValueError as e:
            self.lock.release()
            say(f"error: {e}")
            return 2
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        status, code = "failed", 1
        try:
            self.nodes = [LocalNode(self.opts, self.waker)]
            if self.opts.nnodes > 1:
                server = Rendezvous(self.opts, key, self.event, self.waker)
                self.nodes += server.wait(lambda: self.stop_request is not None)
            per_node = [self.opts.nproc] + [n.nproc for n in self.nodes[1:]]
            self.slots = [(n, i) for n, k in enumerate(per_node) for i in range(k)]
            self.incarnation = self._count_starts()
            self.event(
                S.LAUNCH, nproc=len(self.slots), nnodes=len(self.nodes),
                devices_per_proc=self.opts.devices_per_proc, max_restarts=self.opts.max_restarts,
                command=shlex.join(self.opts.command), pid=os.getpid(),
            )  # fmt: skip
            status, code = self._loop()
        except (RuntimeError, OSError) as e:
            say(f"error: {e}")
        finally:
            for node in self.nodes:
                node.close(code)
            for s, h in handlers.items():
                signal.signal(s, h)
            self._summary(time.time() - t0, status)
            if self.lock is not None:
                self.lock.release()
        return code

    def _summary(self, wall_s: float, status: str) -> None:
        from jaxpar import goodput  # numpy: only at the end

        try:
            summary = goodput.summarize_run(
                self.run_dir, wall_s, self.restarts, status, counted_restarts=self.counted,
                nproc=len(self.slots),
            )  # fmt: skip
            write_json(os.path.join(self.run_dir, runlog.SUMMARY), summary)
        except OSError as e:
            cannot_write(os.path.join(self.run_dir, runlog.SUMMARY), e)
            return
        say(goodput.format_summary(summary))

    def _loop(self) -> tuple[str, int]:
        crash = CrashLoop(self.opts.crash_loop)
        streak, best = 0, -1
        while True:
            self.incarnation = self._count_starts()
            out = self._run_group(len(self.slots))
            if out.kind == "done":
                return "completed", 0
            if out.kind == "stopped":
                return out.cause, int(out.code or 1)
            if out.max_step is not None and out.max_step > best:
                best, streak = out.max_step, 0
            if out.kind == "preempted":
                self.restarts += 1
                self.incarnation = self._count_starts()
                self.event(S.RESTART, attempt=self.restarts, nproc=len(self.slots), counted=False,
                           backoff_s=0.0, reason="preempted")  # fmt: skip
                say("preempted: restarting (not counted against --max-restarts)")
                continue
            reason = self._give_up_reason(out, crash)
            if reason is None and out.lost:
                reason = self._shrink(out.lost)
            if reason is not None:
                self.event(S.GAVE_UP, reason=reason)
                say(f"giving up: {reason}. Checkpoints in {self.run_dir}/checkpoints are intact.")
                return "gave_up", L.EXIT_NO_SPACE if out.code == L.EXIT_NO_SPACE else 1
            streak += 1
            delay = backoff_s(streak, self.opts.backoff_base_s, self.opts.backoff_cap_s)
            self.counted += 1
            self.restarts += 1
            self.incarnation = self._count_starts()
            self.event(S.RESTART, attempt=self.restarts, nproc=len(self.slots), counted=True,
                       backoff_s=delay, reason=out.cause)  # fmt: skip
            say(
                f"restart {self.counted}/{self.opts.max_restarts} on {len(self.slots)} processes"
                + (f" after {delay:.0f}s backoff" if delay else "")
            )
            self._sleep(delay)

    def _give_up_reason(self, out: Outcome, crash: CrashLoop) -> str | None:
        if out.code == L.EXIT_USAGE:
            return (
                f"process {out.process} exited with code 2 (a usage or configuration error, "
                f"restarting will not help)"
            )
        if out.code == L.EXIT_NO_SPACE:
            return (
                f"process {out.process} ran out of disk space in {self.run_dir} (exit "
                f"{L.EXIT_NO_SPACE}); free space there, then run the same command again"
            )
        if crash.record(out.cause, out.step):
            where = f"step {out.step}" if out.step is not None else "start-up"
            what = "non-finite loss" if out.cause == "nan" else f"failure ({out.cause})"
            return f"crash loop: the same {what} at {where} {crash.count} times in a row"
        if self.counted >= self.opts.max_restarts:
            return (
                f"restart budget spent ({self.counted} of --max-restarts {self.opts.max_restarts})"
            )
        return None

    def _shrink(self, lost: list[int]) -> str | None:
        """Drop lost slots and fit the job on what is left; returns a reason to give up, or None.
        The new layout reaches the workers in their environment (jaxpar.launch.ENV_MESH)."""
        before = len(self.slots)
        for p in sorted(set(lost), reverse=True):
            if p < len(self.slots):
                del self.slots[p]
        try:
            with open(os.path.join(self.run_dir, runlog.CONFIG)) as f:
                cfg = json.load(f)
            batch = int(cfg["data"]["global_batch"])
            mesh_s = cfg.get("mesh_resolved") or ""
            mesh = {k: int(v) for k, v in (kv.split("=") for kv in mesh_s.split(",") if kv)}
            micro = int(cfg.get("train", {}).get("microbatches", 1))
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as e:
            return f"lost process(es) {lost}, and cannot shrink without RUN_DIR/config.json ({e})"
        plan = shrink_plan(
            len(self.slots), self.opts.devices_per_proc, batch, mesh or {"data": before},
            micro, self.opts.min_nproc,
        )  # fmt: skip
        if plan is None:
            return (
                f"lost process(es) {lost}: no process count between --min-nproc "
                f"{self.opts.min_nproc} and {len(self.slots)} divides global batch {batch}"
            )
        self.slots = self.slots[: plan["nproc"]]
        if self.slots[0][0] != 0:
            return "elastic shrink left no process on the leader's host (process 0 runs there)"
        mesh_new = mesh_text(plan["mesh"])
        self.layout = {"mesh": mesh_new, "microbatches": plan["microbatches"]}
        self.incarnation = self._count_starts()
        self.event(S.SHRINK, from_nproc=before, to_nproc=plan["nproc"], lost=sorted(set(lost)),
                   mesh=mesh_new, microbatches=plan["microbatches"])  # fmt: skip
        say(f"shrink {before} -> {plan['nproc']} processes, mesh {mesh_new}, "
            f"microbatches {plan['microbatches']}")  # fmt: skip
        return None

    def _sleep(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end and self.stop_request is None:
            self.waker.wait(min(0.5, end - time.time()))

    # -- one incarnation ----------------------------------------------------------------------

    def _timeouts(self) -> tuple[float, float, float]:
        o = self.opts
        hang = o.hang_timeout or 60.0
        if o.startup_timeout:
            startup = o.startup_timeout
        else:
            startup = max(120.0, 3 * self.startup_measured) if self.startup_measured else 600.0
        coll = o.collective_timeout or (2 * hang + 60 if o.hang_timeout else 600.0)
        if coll <= hang:
            say(f"warning: collective timeout {coll:.0f}s <= hang timeout {hang:.0f}s: a hang "
                f"may be reported as the peers' collective error")  # fmt: skip
        return hang, startup, coll

    def _run_group(self, nproc: int) -> Outcome:
        host = self.opts.host if self.opts.nnodes > 1 else "127.0.0.1"
        port = free_port(self.opts.bind)
        coordinator = join_address(host, port)
        bind = join_address(self.opts.bind, port)
        hang, startup, coll = self._timeouts()
        mon = Monitor(self.run_dir, nproc, self.incarnation, self.faults_seen)
        specs = []
        for n in range(len(self.nodes)):
            ids = [pid for pid, (nn, _) in enumerate(self.slots) if nn == n]
            specs.append({"incarnation": self.incarnation, "coordinator": coordinator,
                          "bind": bind, "nproc": nproc, "process_ids": ids,
                          "attempt": self.restarts, "faults": self.opts.faults,
                          "collective_timeout": coll, "layout": self.layout,
                          "run_lock": self.lock.token})  # fmt: skip
        path, why = self._restart_path(specs[0])
        if path == "standby":  # the standby group already runs its own jax coordinator
            sb = self.nodes[0].group.standby_spec() or {}
            coordinator, bind = sb["coordinator"], sb["bind"]
            specs[0].update(coordinator=coordinator, bind=bind, standby=True)
        self.event(S.GROUP_STARTED, nproc=nproc, coordinator=coordinator, attempt=self.restarts,
                   hang_timeout_s=self.opts.hang_timeout, startup_timeout_s=startup,
                   collective_timeout_s=coll, path=path,
                   **({"standby_unused": why} if why else {}))  # fmt: skip
        t_spawn = time.time()
        for node, spec in zip(self.nodes, specs, strict=True):
            node.start(spec)
        say(f"incarnation {self.incarnation}: {nproc} processes started, coordinator {coordinator}")
        out = self._watch(nproc, mon, t_spawn, hang, startup)
        if mon.hb.stepping_since is not None:  # the slowest start-up so far sets the next timeout
            measured = mon.hb.stepping_since - t_spawn
            self.startup_measured = max(self.startup_measured or 0.0, measured)
        if out.kind in ("failure", "preempted"):
            self._record(out)
        self._stop_group(out)
        return out

    def _restart_path(self, want: dict) -> tuple[str, str]:
        """standby | spares | cold for the group about to start, and why not the standby."""
        group = self.nodes[0].group
        if self.incarnation == 0 and group.standby is None:
            return ("spares" if group.spares else "cold"), ""  # the job's first start
        return restart_path(
            enabled=self.opts.standby, nnodes=len(self.nodes), standby=group.standby_spec(),
            ready=group.standby_ready(), want=want,
            spares=bool(group.spares) and len(group.spares) >= len(want["process_ids"]),
        )  # fmt: skip

    def _record(self, out: Outcome) -> None:
        if out.kind == "preempted":
            self.event(S.PREEMPTION, process=out.process, code=out.code, step=out.step)
            return
        fields: dict[str, Any] = {"cause": out.cause, "process": out.process, "code": out.code,
                                  "step": out.step}  # fmt: skip
        if out.code is not None and out.code < 0:
            fields["signal"] = signal.Signals(-out.code).name
        for name in ("detail", "lost", "exits", "stale_s"):
            if getattr(out, name) not in (None, "", []):
                fields[name] = getattr(out, name)
        self.event(S.FAILURE, **fields)
        where = f" at step {out.step}" if out.step is not None else " during start-up"
        injected = [e.get("spec") for e in self.faults_seen
                    if e.get("incarnation") == self.incarnation
                    and e.get("kind") in runlog.ENDING_FAULTS]  # fmt: skip
        why = f" — injected fault {injected[-1]}" if injected else ""
        say(f"failure{where}: {out.cause} of process {out.process} (code {out.code}) "
            f"{out.detail}".rstrip() + why)  # fmt: skip
        log = self._log_of(out.process)
        if log and os.path.exists(log) and out.cause not in ("hang",):
            try:
                with open(log, "rb") as f:
                    f.seek(max(0, os.path.getsize(log) - 16384))  # the tail of a large log
                    last = f.read().decode(errors="replace").splitlines(keepends=True)[-12:]
            except OSError:
                return
            say(f"last lines of {log}:\n" + "".join("    " + x for x in last).rstrip())

    def _log_of(self, pid: int | None) -> str | None:
        if pid is None or pid >= len(self.slots):
            return None
        return self.nodes[self.slots[pid][0]].log_of(pid)

    def _stop_group(self, out: Outcome) -> None:
        t = time.time()
        if out.cause == "hang":
            for node in self.nodes:
                node.signal(signal.SIGCONT)  # a stopped worker cannot dump (nor die of SIGTERM)
                node.signal(signal.SIGUSR1)
            deadline = time.time() + 2.0  # faulthandler writes at once; files may be remote
            while (
                len(stack_files(self.run_dir, self.incarnation)) < len(self.slots)
                and time.time() < deadline
            ):
                time.sleep(0.05)
            time.sleep(0.1)  # let the last one finish writing
            files = stack_files(self.run_dir, self.incarnation)
            self.event(S.STACKS_DUMPED, process=out.process, files=files)
            say(f"stacks of every worker dumped to {', '.join(files) or '(none)'}")
        # A failed group's survivors cannot finish a collective without the lost peer (a SIGTERM
        # would only start a preemption save that cannot complete): kill them at once.
        grace = {"done": 30.0, "failure": 0.0}.get(out.kind, self.opts.grace_s)
        for node in reversed(self.nodes):  # remote agents first: they stop in parallel
            node.request_stop(grace)
        stopped = [node.wait_stopped() for node in self.nodes]
        drop_empty_stack_files(self.run_dir)
        if out.kind == "done":
            return
        self.event(S.SURVIVORS_STOPPED, seconds=time.time() - t,
                   terminated=sum(s.get("terminated", 0) for s in stopped),
                   killed=sum(s.get("killed", 0) for s in stopped))  # fmt: skip

    def _stopped(self) -> list[int]:
        """Process ids of workers seen stopped (SIGSTOP) on any host, in order."""
        return sorted(
            {p for node in self.nodes for p in node.stopped()} & set(range(len(self.slots)))
        )

    def _watch(self, nproc: int, mon: Monitor, t_spawn: float, hang: float, startup: float):
        exits: list[tuple[int, int]] = []
        first_bad: float | None = None
        reported: set[int] = set()
        hb, seen = mon.hb, mon.seen
        next_hb = next_status = 0.0
        while True:
            now = time.time()
            if self.stop_request is not None:
                return self._honour_signal(nproc, exits)
            for n, node in enumerate(self.nodes):
                exits += node.poll()
                gone = [p for p, (nn, _) in enumerate(self.slots) if nn == n]
                if node.lost and gone:
                    return Outcome("failure", "exit", gone[0], None, mon.failed_step(), gone,
                                   f"agent of node {n} lost", hb.max_step())  # fmt: skip
            mon.read_events(now)
            if now >= next_hb:
                hb.update(now)
                next_hb = now + HB_EVERY_S
                self._stragglers(hb, reported)
                if hb.stepping_since is not None:
                    for node in self.nodes:
                        node.group_stepping()
            codes = dict(exits)
            bad = [(p, c) for p, c in exits if c != 0]
            if len(codes) == nproc and not bad:
                return Outcome("done", max_step=hb.max_step())
            if bad:
                first_bad = first_bad or now
                preempt = all(c == L.EXIT_PREEMPTED for _, c in bad)
                # wait briefly for the root cause only if all we have are its consequences
                root_seen = any(secondary(c) == 0 for _, c in bad)
                settle = self.opts.preempt_grace_s if preempt else (0.0 if root_seen else 0.3)
                if len(codes) < nproc and now - first_bad < settle:
                    self.waker.wait(min(settle - (now - first_bad), HB_EVERY_S))
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
                auto = self.opts.hang_timeout is None
                out = mon.hang(now, t_spawn, hang, startup, auto, self._stopped())
                if out is not None:
                    return out
            if now >= next_status:
                if next_status and hb.max_step() is not None:
                    st = hb.step_time()
                    say(f"incarnation {self.incarnation}: step {hb.max_step()}"
                        + (f", {st:.2f}s/step" if st else ""))  # fmt: skip
                next_status = now + self.opts.status_every_s
            self.waker.wait(max(0.0, next_hb - time.time()))

    def _stragglers(self, hb, reported: set[int]) -> None:
        for s in find_stragglers(hb.recent, self.opts.straggler_factor):
            if s["process"] in reported:
                continue
            reported.add(s["process"])
            self.event(S.STRAGGLER, **s)
            factor = f"{s['factor']:.1f}x" if s["factor"] is not None else "many times"
            say(
                f"straggler: process {s['process']} reaches each step {s['lag_s']:.2f}s after the "
                f"others ({factor} their step time) at step {s['step']}"
            )

    def _honour_signal(self, nproc: int, exits: list[tuple[int, int]]) -> Outcome:
        sig = self.stop_request
        if sig == signal.SIGTERM:
            say("SIGTERM: passing the preemption notice to the workers (they save and exit)")
            for node in self.nodes:
                node.signal(signal.SIGTERM)
            deadline = time.time() + self.opts.preempt_grace_s
            while len(dict(exits)) < nproc and time.time() < deadline:
                for node in self.nodes:
                    exits += node.poll()
                self.waker.wait(self.opts.poll_s)
            return Outcome("stopped", "preempted", code=L.EXIT_PREEMPTED)
        say("interrupted: stopping the workers")
        return Outcome("stopped", "interrupted", code=130)
