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

from jaxpar.engine.mesh import mesh_text
from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import SupervisorEvent, WorkerEvent, read_jsonl, write_json
from jaxpar.supervisor.channel import token
from jaxpar.supervisor.group import LocalNode
from jaxpar.supervisor.incarnation import Incarnation
from jaxpar.supervisor.job import JobState
from jaxpar.supervisor.options import cannot_write, say
from jaxpar.supervisor.policy import CrashLoop, Outcome, backoff_s, shrink_plan
from jaxpar.supervisor.transport import Rendezvous
from jaxpar.worker import bootstrap


class Supervisor(JobState):
    """Runs the job: one group of workers per incarnation, restarted until done or given up."""

    def _count_starts(self) -> int:
        return sum(1 for e in read_jsonl(self.events_path) if e.get("event") == WorkerEvent.START)

    def _on_signal(self, signum, frame) -> None:
        if self.stop_request is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_request = signum
        self.waker.poke()

    # -- the whole job ------------------------------------------------------------------------

    def run(self) -> int:
        t0 = time.time()
        if not self.take_lock():  # one job per run directory
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
                self.nodes[0].group.open_pool_early()  # a fork, before the rendezvous' threads
                server = Rendezvous(self.opts, key, self.event, self.waker)
                self.nodes += server.wait(lambda: self.stop_request is not None)
            per_node = [self.opts.nproc] + [n.nproc for n in self.nodes[1:]]
            self.slots = [(n, i) for n, k in enumerate(per_node) for i in range(k)]
            self.incarnation = self._count_starts()
            self.event(
                SupervisorEvent.LAUNCH, nproc=len(self.slots), nnodes=len(self.nodes),
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
        from jaxpar.rundir import goodput  # numpy: only at the end

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
            out = Incarnation(self).run(len(self.slots))
            if out.kind == "done":
                return "completed", 0
            if out.kind == "stopped":
                return out.cause, int(out.code or 1)
            if out.max_step is not None and out.max_step > best:
                best, streak = out.max_step, 0
            if out.kind == "preempted":
                self.restarts += 1
                self.incarnation = self._count_starts()
                self.event(SupervisorEvent.RESTART, attempt=self.restarts, nproc=len(self.slots), counted=False,
                           backoff_s=0.0, reason="preempted")  # fmt: skip
                say("preempted: restarting (not counted against --max-restarts)")
                continue
            reason = self._give_up_reason(out, crash)
            if reason is None and out.lost:
                reason = self._shrink(out.lost)
            if reason is not None:
                extra = {}
                if out.code == bootstrap.EXIT_NO_SPACE:
                    # Every worker is stopped: free the space the failed save took (the process
                    # that saw ENOSPC first may not be the one that would have removed it).
                    ckpt = os.path.join(self.run_dir, runlog.CHECKPOINTS)
                    extra["discarded"] = runlog.discard_uncommitted(ckpt)
                self.event(SupervisorEvent.GAVE_UP, reason=reason, **extra)
                say(f"giving up: {reason}. Checkpoints in {self.run_dir}/checkpoints are intact.")
                return (
                    "gave_up",
                    bootstrap.EXIT_NO_SPACE if out.code == bootstrap.EXIT_NO_SPACE else 1,
                )
            streak += 1
            delay = backoff_s(streak, self.opts.backoff_base_s, self.opts.backoff_cap_s)
            self.counted += 1
            self.restarts += 1
            self.incarnation = self._count_starts()
            self.event(SupervisorEvent.RESTART, attempt=self.restarts, nproc=len(self.slots), counted=True,
                       backoff_s=delay, reason=out.cause)  # fmt: skip
            say(
                f"restart {self.counted}/{self.opts.max_restarts} on {len(self.slots)} processes"
                + (f" after {delay:.0f}s backoff" if delay else "")
            )
            self._sleep(delay)

    def _give_up_reason(self, out: Outcome, crash: CrashLoop) -> str | None:
        if out.code == bootstrap.EXIT_USAGE:
            return (
                f"process {out.process} exited with code 2 (a usage or configuration error, "
                f"restarting will not help)"
            )
        if out.code == bootstrap.EXIT_NO_SPACE:
            return (
                f"process {out.process} ran out of disk space in {self.run_dir} (exit "
                f"{bootstrap.EXIT_NO_SPACE}); free space there, then run the same command again"
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
        The new layout reaches the workers in their environment (jaxpar.worker.bootstrap.ENV_MESH)."""
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
        self.event(SupervisorEvent.SHRINK, from_nproc=before, to_nproc=plan["nproc"], lost=sorted(set(lost)),
                   mesh=mesh_new, microbatches=plan["microbatches"])  # fmt: skip
        say(f"shrink {before} -> {plan['nproc']} processes, mesh {mesh_new}, "
            f"microbatches {plan['microbatches']}")  # fmt: skip
        return None

    def _sleep(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end and self.stop_request is None:
            self.waker.wait(min(0.5, end - time.time()))
