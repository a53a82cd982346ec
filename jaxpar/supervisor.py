"""`jaxpar launch`: start the workers, watch them, restart the group, shrink it, keep the ledger.

    jaxpar launch --nproc 4 --devices-per-proc 2 --run-dir runs/x -- python -m train --steps 200

One agent per host. With --nnodes > 1 the agent of --node-rank 0 leads: it owns the policy and
writes the supervisor events; the others start and stop their local workers on its command over a
small TCP channel at --coordinator HOST:PORT and report every worker exit. A failure anywhere
restarts the whole job. The run directory must be shared (as Orbax checkpoints require).

The loop: spawn a group (fresh coordinator port, incarnation = earlier `start` events) -> watch
(exits at once; hangs from progress heartbeats; stragglers; permanent slot loss from
`fault_injected`) -> dump stacks if hung -> stop survivors (SIGTERM, SIGKILL after a grace) ->
decide (uncounted restart after a preemption, backoff, crash loop, budget, shrink) -> respawn.
Workers get the environment described in jaxpar/launch.py; the summary is jaxpar/goodput.py's.

Elastic shrink (a `fault_injected` with `permanent`, or a lost agent): the job continues on the
largest process count >= --min-nproc that the global batch (RUN_DIR/config.json) divides. The
worker command is rewritten: `--mesh` becomes the old `mesh_resolved` with the batch axes
(data, then fsdp) shrunk, and `--set train.microbatches=M` keeps each device's rows per
microbatch. A preset name given as --mesh is replaced by its spec with the default rules. With
several hosts, the leader's command is the one every agent runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from jaxpar import goodput
from jaxpar import launch as L
from jaxpar import spare as spare_lib
from jaxpar.metrics import append_line, read_jsonl, write_json

LOOPBACK = ("127.0.0.1", "localhost", "::1")
THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


# ---- options ------------------------------------------------------------------------------------


@dataclass
class Options:
    command: list[str]
    nproc: int  # workers on this host
    run_dir: str
    devices_per_proc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str = "127.0.0.1:0"  # agents' control channel (nnodes > 1); host for jax too
    max_restarts: int = 3
    min_nproc: int = 1  # total over all hosts
    hang_timeout: float | None = None  # None: max(60 s, 10 x median step time)
    startup_timeout: float | None = None  # None: 3 x the measured start-up, 600 s at first
    collective_timeout: float | None = None  # None: derived, always > the hang timeout
    # SIGTERM -> SIGKILL. Short: a jax worker takes SIGTERM as a preemption notice and does not
    # exit, and a survivor blocked in a collective with a dead peer never returns (gloo).
    grace_s: float = 1.0
    # pre-start the next group's workers (imports done) while a group trains: faster restarts
    spares: bool = True
    preempt_grace_s: float = 120.0  # time for a coordinated preemption save
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0
    crash_loop: int = 3  # the same failure at the same step this many times in a row: give up
    straggler_factor: float = 2.0
    faults: list[str] = field(default_factory=list)
    rendezvous_timeout_s: float = 300.0
    poll_s: float = 0.1
    status_every_s: float = 30.0

    @property
    def host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0]

    @property
    def control_port(self) -> int:
        return int(self.coordinator.rsplit(":", 1)[1])


def say(msg: str) -> None:
    print(f"[jaxpar launch] {msg}", file=sys.stderr, flush=True)


# ---- policy (pure) ------------------------------------------------------------------------------


def classify_exit(code: int) -> str:
    """The `failure` cause of a worker's return code (negative: killed by that signal)."""
    if code < 0:
        return "signal"
    if code == L.EXIT_COLLECTIVE:
        return "collective"
    if code == L.EXIT_NAN:
        return "nan"
    return "exit"


def _secondary(code: int) -> int:
    """0 for a likely root cause; higher for the consequences of a peer's failure."""
    if code in (L.EXIT_COLLECTIVE, -signal.SIGABRT):
        return 2
    if code == L.EXIT_PREEMPTED:
        return 1
    return 0


def root_exit(exits: list[tuple[int, int]]) -> tuple[int, int]:
    """The (process, code) that most likely started it, from exits in observed order."""
    failed = [(p, c) for p, c in exits if c != 0] or exits
    return min(failed, key=lambda pc: _secondary(pc[1]))


def backoff_s(streak: int, base: float, cap: float) -> float:
    """Delay before a restart: none the first time, then base, 2 base, 4 base ... up to cap."""
    return 0.0 if streak <= 1 else min(cap, base * 2 ** (streak - 2))


class CrashLoop:
    """The same (cause, step) failure again and again; a NaN at the same step twice suffices."""

    def __init__(self, limit: int):
        self.limit, self.last, self.count = limit, None, 0

    def record(self, cause: str, step: int | None) -> bool:
        sig = (cause, step)
        self.count = self.count + 1 if sig == self.last else 1
        self.last = sig
        return self.count >= (min(2, self.limit) if cause == "nan" else self.limit)


def shrink_plan(
    available: int, devices_per_proc: int, global_batch: int, mesh: dict[str, int],
    microbatches: int, min_nproc: int,
) -> dict | None:  # fmt: skip
    """The largest process count <= available and >= min_nproc whose devices divide the global
    batch (per process and per data-parallel way), with the mesh's batch axes (data, fsdp)
    shrunk and more gradient-accumulation microbatches so that each device still holds the same
    rows per microbatch. The global batch is kept. None if there is no such count."""
    fixed = mesh.get("tensor", 1) * mesh.get("pipeline", 1)
    old_ways = mesh.get("data", 1) * mesh.get("fsdp", 1)
    for n in range(available, min_nproc - 1, -1):
        devices = n * devices_per_proc
        if devices % fixed or global_batch % n:
            continue
        ways = devices // fixed  # the batch is split this many ways (data x fsdp)
        if global_batch % ways:
            continue
        # Processes split data first, then fsdp (jaxpar.mesh): fsdp must absorb the rest.
        for fsdp in (math.gcd(mesh.get("fsdp", 1), ways), 1):
            if fsdp % (n // math.gcd(ways // fsdp, n)) == 0:
                break
        else:
            continue
        m = max(microbatches, math.ceil(microbatches * old_ways / ways))
        while global_batch % (ways * m):
            m += 1
        return {"nproc": n, "mesh": dict(mesh, data=ways // fsdp, fsdp=fsdp), "microbatches": m}
    return None


def mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{a}={mesh[a]}" for a in ("data", "fsdp", "tensor", "pipeline") if a in mesh)


def rewrite_command(cmd: list[str], mesh: str, microbatches: int) -> list[str]:
    """The worker command for a shrunk job: `--mesh` replaced (or added) and
    `--set train.microbatches=` replaced (or added). Assumes `python -m train`'s options."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(cmd):
        if skip:
            skip = False
            continue
        if arg == "--mesh":
            skip = True
            continue
        if arg.startswith("--mesh="):
            continue
        if arg == "--set" and i + 1 < len(cmd) and cmd[i + 1].startswith("train.microbatches="):
            skip = True
            continue
        if arg.startswith("--set=train.microbatches="):
            continue
        out.append(arg)
    return out + ["--mesh", mesh, "--set", f"train.microbatches={microbatches}"]


def find_stragglers(
    recent: dict[int, list[list[float]]], factor: float, min_lag_s: float = 0.05
) -> list[dict]:
    """Processes that reach the same steps later than the others.

    `recent[p]` is [[step, time], ...] from process p's heartbeats (time of arrival at the next
    step). Over the last common steps, a process's lag is its arrival minus the earliest; with
    period T, its own work per step is about T and the others' T - lag, so its slowdown factor
    is T / (T - lag).
    """
    if len(recent) < 2:
        return []
    by_p = {p: {int(s): t for s, t in r} for p, r in recent.items()}
    common = sorted(set.intersection(*(set(d) for d in by_p.values())))[-6:]
    if len(common) < 3:
        return []
    first = [min(d[s] for d in by_p.values()) for s in common]
    pairs = zip(first[:-1], first[1:], common[:-1], common[1:], strict=True)
    periods = [b - a for a, b, s0, s1 in pairs if s1 == s0 + 1]
    if not periods:
        return []
    period = statistics.median(periods)
    out = []
    for p, d in by_p.items():
        lag = statistics.median(d[s] - f for s, f in zip(common, first, strict=True))
        f = period / max(period - lag, 1e-6) if lag < period else math.inf
        if lag >= min_lag_s and f >= factor:
            out.append({"process": p, "step": common[-1], "lag_s": lag, "factor": f,
                        "step_time_s": period})  # fmt: skip
    return out


def worker_env(
    base: dict[str, str], *, coordinator: str, bind: str, nproc: int, process_id: int,
    local_rank: int, devices_per_proc: int, run_dir: str, incarnation: int, faults: list[str],
    heartbeat_timeout: float, collective_timeout: float,
) -> dict[str, str]:  # fmt: skip
    """The environment of one worker (the contract is in jaxpar/launch.py)."""
    env = dict(base)
    flags = env.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        flags = f"{flags} {THREAD_FLAGS}".strip()
    env.update(
        {
            L.ENV_COORDINATOR: coordinator,
            L.ENV_COORDINATOR_BIND: bind,
            L.ENV_NUM_PROCESSES: str(nproc),
            L.ENV_PROCESS_ID: str(process_id),
            L.ENV_DEVICES_PER_PROC: str(devices_per_proc),
            L.ENV_RUN_DIR: run_dir,
            L.ENV_INCARNATION: str(incarnation),
            L.ENV_SUPERVISED: "1",
            L.ENV_SUPERVISOR_PID: str(os.getpid()),
            L.ENV_HEARTBEAT_TIMEOUT: str(int(heartbeat_timeout)),
            L.ENV_COLLECTIVE_TIMEOUT: str(int(collective_timeout)),
            "XLA_FLAGS": flags,
            "PYTHONUNBUFFERED": "1",
        }
    )
    faults = [f for f in (env.get(L.ENV_FAULTS, "").split(";") + faults) if f.strip()]
    if faults:
        env[L.ENV_FAULTS] = ";".join(dict.fromkeys(faults))
    ids = range(local_rank * devices_per_proc, (local_rank + 1) * devices_per_proc)
    env.setdefault("JAX_LOCAL_DEVICE_IDS", ",".join(map(str, ids)))  # accelerators only
    return env


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind(("" if host not in LOOPBACK else host, 0))
        return s.getsockname()[1]


# ---- this host's workers ------------------------------------------------------------------------


class LocalGroup:
    """This host's workers of one incarnation: spawn, reap, signal, stop."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, str] = {}
        self.reported: set[int] = set()
        self.attempt = -1  # which group these workers are (exits are tagged with it)
        self.spec: dict | None = None
        self.spares: dict[int, subprocess.Popen] = {}  # local rank -> pre-started worker
        self.spares_due = False  # start spares once this group has started
        self.events: EventTail | None = None
        self.log_dir = os.path.join(self.opts.run_dir, "logs")

    def _env(self, spec: dict, pid: int, local_rank: int) -> dict[str, str]:
        return worker_env(
            dict(os.environ), coordinator=spec["coordinator"], bind=spec["bind"],
            nproc=spec["nproc"], process_id=pid, local_rank=local_rank,
            devices_per_proc=self.opts.devices_per_proc, run_dir=self.opts.run_dir,
            incarnation=spec["incarnation"], faults=spec.get("faults", self.opts.faults),
            heartbeat_timeout=spec["collective_timeout"],
            collective_timeout=spec["collective_timeout"],
        )  # fmt: skip

    def start(self, spec: dict) -> None:
        self.procs, self.logs, self.reported = {}, {}, set()
        self.attempt = int(spec["attempt"])
        self.spec = spec
        os.makedirs(self.log_dir, exist_ok=True)
        for local_rank, pid in enumerate(spec["process_ids"]):
            env = self._env(spec, pid, local_rank)
            name = f"inc{spec['incarnation']}-group{spec['attempt']}-proc{pid}.log"
            path = os.path.join(self.log_dir, name)
            self.logs[pid] = path
            spare = self.spares.pop(local_rank, None)
            if spare is not None and self._hand_over(spare, env, spec["command"], path):
                self.procs[pid] = spare
                continue
            with open(path, "ab") as log:
                self.procs[pid] = subprocess.Popen(
                    spec["command"], env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
        self.release_spares()  # ranks this group does not use (after a shrink)
        self.spares_due = self.opts.spares
        self.events = EventTail(os.path.join(self.opts.run_dir, "events.jsonl"))  # from now

    # -- hot spares: the next group's workers, started while this one trains -----------------

    def _hand_over(self, spare: subprocess.Popen, env: dict, command: list[str], log: str) -> bool:
        """Give `spare` this worker's place (a spare still importing is ahead of a cold start
        all the same); False if it is gone."""
        if spare.poll() is not None or spare.stdin is None:
            self._stop_spare(spare)
            return False
        try:
            spare.stdin.write(
                (json.dumps({"env": env, "argv": command, "log": log}) + "\n").encode()
            )
            spare.stdin.close()
        except OSError:
            return False
        return True

    def _maybe_start_spares(self) -> None:
        """Once this group has started (its `start` event: every worker has imported, joined
        jax.distributed and built its program), start one spare per local rank for the next
        group — so spares do not compete with the group's own start-up, yet are ready early."""
        if not self.spares_due or self.spec is None or self.events is None:
            return
        inc = self.spec["incarnation"]
        if not any(e.get("event") == "start" and e.get("incarnation") == inc
                   for e in self.events.read()):  # fmt: skip
            return
        self.spares_due = False
        module = spare_lib.module_of(self.spec["command"])
        if module is None:  # a spare can only run `python -m MOD` of this interpreter
            return
        for local_rank, pid in enumerate(self.spec["process_ids"]):
            env = self._env(self.spec, pid, local_rank)
            env["JAXPAR_SPARE_MODULE"] = module
            path = os.path.join(self.log_dir, f"spare{local_rank}.log")
            with open(path, "ab") as log:
                self.spares[local_rank] = subprocess.Popen(
                    [sys.executable, "-m", "jaxpar.spare"], env=env, stdout=log,
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

    def poll(self) -> list[tuple[int, int]]:
        """Exits not reported before: [(process id, return code)]."""
        out = []
        for pid, p in self.procs.items():
            if pid not in self.reported and p.poll() is not None:
                self.reported.add(pid)
                out.append((pid, p.returncode))
        self._maybe_start_spares()
        return out

    def alive(self) -> list[int]:
        return [pid for pid, p in self.procs.items() if p.poll() is None]

    def send(self, sig: int) -> None:
        for pid in self.alive():
            try:
                os.kill(self.procs[pid].pid, sig)
            except ProcessLookupError:
                pass

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
        return {"terminated": len(terminated), "killed": len(killed)}

    def kill_all(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker and anything it started
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                say(f"worker pid {p.pid} did not die after SIGKILL")


# ---- the control channel between agents ---------------------------------------------------------


class Channel:
    """Newline-delimited JSON over TCP; a reader thread queues incoming messages."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbox: queue.Queue = queue.Queue()
        self.closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self.inbox.put(json.loads(line))
        except OSError:
            pass
        self.closed = True
        self.inbox.put(None)

    def send(self, msg: dict) -> None:
        with self._lock:
            try:
                self.sock.sendall((json.dumps(msg) + "\n").encode())
            except OSError:
                self.closed = True

    def messages(self, timeout: float = 0.0) -> list[dict | None]:
        out = []
        try:
            out.append(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def wait_for(self, key: str, timeout: float) -> dict | None:
        """The next message carrying `key` (others are put back afterwards)."""
        deadline, held = time.time() + timeout, []
        try:
            while time.time() < deadline:
                try:
                    msg = self.inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if msg is None:
                    return None
                if key in msg:
                    return msg
                held.append(msg)
            return None
        finally:
            for m in held:
                self.inbox.put(m)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class LocalNode:
    """The leader's own workers, behind the same interface as a remote agent."""

    def __init__(self, opts: Options):
        self.group = LocalGroup(opts)
        self.lost = False

    def start(self, spec: dict) -> None:
        self.group.start(spec)

    def poll(self) -> list[tuple[int, int]]:
        return self.group.poll()

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


class RemoteNode:
    """Another host's agent, driven over its Channel."""

    def __init__(self, chan: Channel, hello: dict):
        self.chan, self.hello, self.lost = chan, hello, False
        self.pending: list[tuple[int, int]] = []
        self.attempt = -1

    def start(self, spec: dict) -> None:
        self.attempt = int(spec["attempt"])
        self.chan.send({"cmd": "start", "spec": spec})

    def poll(self) -> list[tuple[int, int]]:
        for msg in self.chan.messages():
            if msg is None:
                self.lost = True
            elif "exit" in msg and msg.get("attempt") == self.attempt:  # not a stopped group's
                self.pending.append((int(msg["exit"]), int(msg["code"])))
        out, self.pending = self.pending, []
        return out

    def signal(self, sig: int) -> None:
        self.chan.send({"cmd": "signal", "sig": int(sig)})

    def request_stop(self, grace_s: float) -> None:
        self.chan.send({"cmd": "stop", "grace_s": grace_s})
        self._grace = grace_s

    def wait_stopped(self) -> dict:
        if self.lost or self.chan.closed:
            return {}
        msg = self.chan.wait_for("stopped", self._grace + 30)
        if msg is None:
            self.lost = True
            return {}
        return msg["stopped"]

    def log_of(self, pid: int) -> str | None:
        return None

    def close(self, code: int) -> None:
        self.chan.send({"cmd": "exit", "code": code})
        self.chan.close()


def run_follower(opts: Options) -> int:
    """Agent on a host other than --node-rank 0: run local workers on the leader's command."""
    deadline = time.time() + opts.rendezvous_timeout_s
    while True:
        try:
            sock = socket.create_connection((opts.host, opts.control_port), timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                say(f"no leader at {opts.coordinator} after {opts.rendezvous_timeout_s:.0f}s")
                return 1
            time.sleep(0.5)
    sock.settimeout(None)
    chan = Channel(sock)
    chan.send({"hello": opts.node_rank, "nproc": opts.nproc, "host": socket.gethostname()})
    group = LocalGroup(opts)
    signal.signal(signal.SIGTERM, lambda *_: group.send(signal.SIGTERM))  # preemption notice
    say(f"node {opts.node_rank}: joined the leader at {opts.coordinator}")
    try:
        while True:
            for msg in chan.messages(timeout=opts.poll_s):
                if msg is None:
                    say(f"node {opts.node_rank}: leader gone; stopping local workers")
                    return 1
                cmd = msg.get("cmd")
                if cmd == "start":
                    group.start(msg["spec"])
                elif cmd == "signal":
                    group.send(int(msg["sig"]))
                elif cmd == "stop":
                    chan.send({"stopped": group.stop(float(msg["grace_s"]))})
                elif cmd == "exit":
                    return int(msg.get("code", 0))
            for pid, code in group.poll():
                chan.send({"exit": pid, "code": code, "attempt": group.attempt})
    finally:
        group.kill_all()
        group.release_spares()
        chan.close()


# ---- watching one incarnation -------------------------------------------------------------------


class Heartbeats:
    """Progress of one incarnation from RUN_DIR/heartbeats/proc<P>.json (supervisor's clock)."""

    def __init__(self, run_dir: str, nproc: int, incarnation: int):
        self.dir = os.path.join(run_dir, L.HEARTBEAT_DIR)
        self.nproc, self.incarnation = nproc, incarnation
        self.first: dict[int, int] = {}
        self.last: dict[int, tuple[int, float]] = {}  # process -> (step, seen at)
        self.recent: dict[int, list] = {}
        self.stepping_since: float | None = None  # when a first step had completed

    def clear(self) -> None:
        if os.path.isdir(self.dir):
            for name in os.listdir(self.dir):
                os.remove(os.path.join(self.dir, name))

    def update(self, now: float) -> None:
        for p in range(self.nproc):
            rec = L.read_heartbeat(os.path.join(self.dir, f"proc{p}.json"))
            if rec is None or rec.get("incarnation") != self.incarnation:
                continue
            step = int(rec["step"])
            self.recent[p] = rec.get("recent", [])
            self.first.setdefault(p, step)
            if p not in self.last or self.last[p][0] != step:
                self.last[p] = (step, now)
        if self.stepping_since is None and any(
            s > self.first[p] for p, (s, _) in self.last.items()
        ):
            self.stepping_since = now

    def max_step(self) -> int | None:
        return max((s for s, _ in self.last.values()), default=None)

    def stalest(self, now: float) -> tuple[int, float]:
        """The process whose progress is oldest, and for how long (clock starts at stepping)."""
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
    return [b[1] - a[1] for a, b in zip(recent[:-1], recent[1:], strict=True) if b[0] == a[0] + 1]


class EventTail:
    """New complete lines of events.jsonl since the last call."""

    def __init__(self, path: str):
        self.path = path
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


@dataclass
class Outcome:
    kind: str  # done | failure | preempted | stopped
    cause: str = ""
    process: int | None = None
    code: int | None = None
    step: int | None = None
    lost: list[int] = field(default_factory=list)  # process ids gone for good
    detail: str = ""
    max_step: int | None = None
    exits: list[tuple[int, int]] = field(default_factory=list)  # all seen, in order
    stale_s: float | None = None  # hangs: how long without progress when detected


@dataclass
class _Seen:
    """What the events of the current incarnation have told the supervisor so far."""

    lost: set[int] = field(default_factory=set)  # processes gone for good (permanent faults)
    save_open: float | None = None  # a save began (supervisor clock) and has not ended
    finishing: float | None = None  # past the last step (`done`) or a worker exited 0


# ---- the leader ---------------------------------------------------------------------------------


class Supervisor:
    """Runs the job: one group of workers per incarnation, restarted until done or given up."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.run_dir = os.path.abspath(opts.run_dir)
        self.events_path = os.path.join(self.run_dir, "events.jsonl")
        self.nodes: list[LocalNode | RemoteNode] = []
        self.slots: list[tuple[int, int]] = []  # (node, local index), indexed by process id
        self.command = list(opts.command)
        self.incarnation = 0
        self.restarts = 0  # group restarts of any kind
        self.counted = 0  # those that count against --max-restarts
        self.stop_request: int | None = None
        self.startup_measured: float | None = None
        self.faults_seen: list[dict] = []

    def event(self, name: str, **fields: Any) -> None:
        line = {"event": name, "time": time.time(), "incarnation": self.incarnation, **fields}
        append_line(self.events_path, line)

    def _count_starts(self) -> int:
        return sum(1 for e in read_jsonl(self.events_path) if e.get("event") == "start")

    def _on_signal(self, signum, frame) -> None:
        if self.stop_request is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_request = signum

    # -- the whole job ------------------------------------------------------------------------

    def run(self) -> int:
        t0 = time.time()
        os.makedirs(self.run_dir, exist_ok=True)
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        status, code = "failed", 1
        try:
            self.nodes = [LocalNode(self.opts), *self._rendezvous()]
            per_node = [self.opts.nproc] + [int(n.hello["nproc"]) for n in self.nodes[1:]]
            self.slots = [(n, i) for n, k in enumerate(per_node) for i in range(k)]
            self.incarnation = self._count_starts()
            self.event(
                "launch", nproc=len(self.slots), nnodes=len(self.nodes),
                devices_per_proc=self.opts.devices_per_proc, max_restarts=self.opts.max_restarts,
                command=shlex.join(self.command), pid=os.getpid(),
            )  # fmt: skip
            status, code = self._loop()
        finally:
            for node in self.nodes:
                node.close(code)
            for s, h in handlers.items():
                signal.signal(s, h)
            summary = goodput.summarize_run(
                self.run_dir, time.time() - t0, self.restarts, status,
                counted_restarts=self.counted, nproc=len(self.slots),
            )  # fmt: skip
            write_json(os.path.join(self.run_dir, "summary.json"), summary)
            say(goodput.format_summary(summary))
        return code

    def _rendezvous(self) -> list[RemoteNode]:
        if self.opts.nnodes <= 1:
            return []
        host = self.opts.host if self.opts.host in LOOPBACK else ""
        server = socket.create_server((host, self.opts.control_port), reuse_port=False)
        server.settimeout(1.0)
        deadline = time.time() + self.opts.rendezvous_timeout_s
        remotes: dict[int, RemoteNode] = {}
        say(f"waiting for {self.opts.nnodes - 1} agent(s) at {self.opts.coordinator}")
        try:
            while len(remotes) < self.opts.nnodes - 1:
                if time.time() > deadline or self.stop_request is not None:
                    raise RuntimeError(
                        f"only {len(remotes) + 1} of {self.opts.nnodes} agents joined at "
                        f"{self.opts.coordinator} within {self.opts.rendezvous_timeout_s:.0f}s"
                    )
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    continue
                sock.settimeout(None)
                chan = Channel(sock)
                hello = chan.wait_for("hello", 30)
                if hello is None:
                    chan.close()
                    continue
                remotes[int(hello["hello"])] = RemoteNode(chan, hello)
        finally:
            server.close()
        return [remotes[r] for r in sorted(remotes)]

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
                self.event("restart", attempt=self.restarts, nproc=len(self.slots), counted=False,
                           backoff_s=0.0, reason="preempted")  # fmt: skip
                say("preempted: restarting (not counted against --max-restarts)")
                continue
            reason = self._give_up_reason(out, crash)
            if reason is None and out.lost:
                reason = self._shrink(out.lost)
            if reason is not None:
                self.event("gave_up", reason=reason)
                say(f"giving up: {reason}. Checkpoints in {self.run_dir}/checkpoints are intact.")
                return "gave_up", 1
            streak += 1
            delay = backoff_s(streak, self.opts.backoff_base_s, self.opts.backoff_cap_s)
            self.counted += 1
            self.restarts += 1
            self.incarnation = self._count_starts()
            self.event("restart", attempt=self.restarts, nproc=len(self.slots), counted=True,
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
        """Drop lost slots and fit the job on what is left; returns a reason to give up, or None."""
        before = len(self.slots)
        for p in sorted(set(lost), reverse=True):
            if p < len(self.slots):
                del self.slots[p]
        try:
            with open(os.path.join(self.run_dir, "config.json")) as f:
                cfg = json.load(f)
            batch = int(cfg["data"]["global_batch"])
            mesh_s = cfg.get("mesh_resolved") or ""
            mesh = {k: int(v) for k, v in (kv.split("=") for kv in mesh_s.split(",") if kv)}
            micro = int(cfg.get("train", {}).get("microbatches", 1))
        except (OSError, KeyError, ValueError) as e:
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
        self.command = rewrite_command(self.command, mesh_new, plan["microbatches"])
        self.incarnation = self._count_starts()
        self.event("shrink", from_nproc=before, to_nproc=plan["nproc"], lost=sorted(set(lost)),
                   mesh=mesh_new, microbatches=plan["microbatches"])  # fmt: skip
        say(f"shrink {before} -> {plan['nproc']} processes, mesh {mesh_new}, "
            f"microbatches {plan['microbatches']}")  # fmt: skip
        return None

    def _sleep(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end and self.stop_request is None:
            time.sleep(min(0.1, end - time.time()))

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
        port = free_port(host)
        coordinator = f"{host}:{port}"
        bind = coordinator if host in LOOPBACK else f"[::]:{port}"
        hang, startup, coll = self._timeouts()
        hb = Heartbeats(self.run_dir, nproc, self.incarnation)
        hb.clear()
        tail = EventTail(self.events_path)
        self.event("group_started", nproc=nproc, coordinator=coordinator, attempt=self.restarts,
                   hang_timeout_s=self.opts.hang_timeout, startup_timeout_s=startup,
                   collective_timeout_s=coll)  # fmt: skip
        t_spawn = time.time()
        for n, node in enumerate(self.nodes):
            ids = [pid for pid, (nn, _) in enumerate(self.slots) if nn == n]
            node.start({"incarnation": self.incarnation, "coordinator": coordinator, "bind": bind,
                        "nproc": nproc, "process_ids": ids, "command": self.command,
                        "attempt": self.restarts, "faults": self.opts.faults,
                        "collective_timeout": coll})  # fmt: skip
        say(f"incarnation {self.incarnation}: {nproc} processes started, coordinator {coordinator}")
        out = self._watch(nproc, hb, tail, t_spawn, hang, startup)
        if hb.stepping_since is not None:  # the slowest start-up so far sets the next timeout
            measured = hb.stepping_since - t_spawn
            self.startup_measured = max(self.startup_measured or 0.0, measured)
        if out.kind in ("failure", "preempted"):
            self._record(out)
        self._stop_group(out)
        return out

    def _record(self, out: Outcome) -> None:
        if out.kind == "preempted":
            self.event("preemption", process=out.process, code=out.code, step=out.step)
            return
        fields: dict[str, Any] = {"cause": out.cause, "process": out.process, "code": out.code,
                                  "step": out.step}  # fmt: skip
        if out.code is not None and out.code < 0:
            fields["signal"] = signal.Signals(-out.code).name
        if out.detail:
            fields["detail"] = out.detail
        if out.lost:
            fields["lost"] = out.lost
        if out.exits:
            fields["exits"] = out.exits
        if out.stale_s is not None:
            fields["stale_s"] = out.stale_s
        self.event("failure", **fields)
        where = f" at step {out.step}" if out.step is not None else " during start-up"
        say(f"failure{where}: {out.cause} of process {out.process} (code {out.code}) "
            f"{out.detail}".rstrip())  # fmt: skip
        log = self._log_of(out.process)
        if log and os.path.exists(log) and out.cause not in ("hang",):
            with open(log, errors="replace") as f:
                last = f.readlines()[-12:]
            say(f"last lines of {log}:\n" + "".join("    " + x for x in last).rstrip())

    def _log_of(self, pid: int | None) -> str | None:
        if pid is None or pid >= len(self.slots):
            return None
        return self.nodes[self.slots[pid][0]].log_of(pid)

    def _stop_group(self, out: Outcome) -> None:
        t = time.time()
        if out.cause == "hang":
            for node in self.nodes:
                node.signal(signal.SIGUSR1)
            deadline = time.time() + 2.0  # faulthandler writes at once; files may be remote
            while len(self._stack_files()) < len(self.slots) and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.1)  # let the last one finish writing
            files = self._stack_files()
            self.event("stacks_dumped", process=out.process, files=files)
            say(f"stacks of every worker dumped to {', '.join(files) or '(none)'}")
        # A failed group's survivors cannot finish a collective without the lost peer (a SIGTERM
        # would only start a preemption save that cannot complete): kill them at once.
        grace = {"done": 30.0, "failure": 0.0}.get(out.kind, self.opts.grace_s)
        for node in reversed(self.nodes):  # remote agents first: they stop in parallel
            node.request_stop(grace)
        stopped = [node.wait_stopped() for node in self.nodes]
        self._drop_empty_stack_files()
        if out.kind == "done":
            return
        self.event("survivors_stopped", seconds=time.time() - t,
                   terminated=sum(s.get("terminated", 0) for s in stopped),
                   killed=sum(s.get("killed", 0) for s in stopped))  # fmt: skip

    def _stack_files(self) -> list[str]:
        d = os.path.join(self.run_dir, L.STACKS_DIR)
        if not os.path.isdir(d):
            return []
        prefix = f"inc{self.incarnation}-"
        return sorted(
            os.path.join(L.STACKS_DIR, n)
            for n in os.listdir(d)
            if n.startswith(prefix) and os.path.getsize(os.path.join(d, n)) > 0
        )

    def _drop_empty_stack_files(self) -> None:
        d = os.path.join(self.run_dir, L.STACKS_DIR)
        for n in os.listdir(d) if os.path.isdir(d) else []:
            path = os.path.join(d, n)
            if os.path.getsize(path) == 0:
                os.remove(path)

    def _watch(
        self, nproc: int, hb: Heartbeats, tail: EventTail, t_spawn: float, hang: float,
        startup: float,
    ) -> Outcome:  # fmt: skip
        exits: list[tuple[int, int]] = []
        seen = _Seen()
        first_bad: float | None = None
        reported: set[int] = set()
        next_hb = next_status = 0.0
        while True:
            now = time.time()
            if self.stop_request is not None:
                return self._honour_signal(nproc, exits)
            for n, node in enumerate(self.nodes):
                exits += node.poll()
                gone = [p for p, (nn, _) in enumerate(self.slots) if nn == n]
                if node.lost and gone:
                    return Outcome("failure", "exit", gone[0], None, self._failed_step(hb), gone,
                                   f"agent of node {n} lost", hb.max_step())  # fmt: skip
            self._read_events(tail, seen, now)
            if now >= next_hb:
                hb.update(now)
                next_hb = now + 0.25
                self._stragglers(hb, reported)
            codes = dict(exits)
            bad = [(p, c) for p, c in exits if c != 0]
            if len(codes) == nproc and not bad:
                return Outcome("done", max_step=hb.max_step())
            if bad:
                first_bad = first_bad or now
                preempt = all(c == L.EXIT_PREEMPTED for _, c in bad)
                # wait briefly for the root cause only if all we have are its consequences
                root_seen = any(_secondary(c) == 0 for _, c in bad)
                settle = self.opts.preempt_grace_s if preempt else (0.0 if root_seen else 0.3)
                if len(codes) < nproc and now - first_bad < settle:
                    time.sleep(self.opts.poll_s)
                    continue
                hb.update(time.time())
                self._read_events(tail, seen, now)
                p, c = root_exit(exits)
                kind = "preempted" if preempt and len(codes) == nproc else "failure"
                cause = "preempted" if kind == "preempted" else classify_exit(c)
                return Outcome(kind, cause, p, c, self._failed_step(hb), sorted(seen.lost),
                               max_step=hb.max_step(), exits=exits)  # fmt: skip
            if codes or seen.finishing is not None:  # past the last step: no heartbeats now
                seen.finishing = seen.finishing or now
                if now - seen.finishing > max(60.0, hang):
                    p = min(set(range(nproc)) - set(codes))
                    return Outcome("failure", "hang", p, None, self._failed_step(hb),
                                   detail="did not exit after the last step")  # fmt: skip
            elif (out := self._hang(nproc, hb, now, t_spawn, hang, startup, seen)) is not None:
                return out
            if now >= next_status:
                if next_status and hb.max_step() is not None:
                    st = hb.step_time()
                    say(f"incarnation {self.incarnation}: step {hb.max_step()}"
                        + (f", {st:.2f}s/step" if st else ""))  # fmt: skip
                next_status = now + self.opts.status_every_s
            time.sleep(self.opts.poll_s)

    def _read_events(self, tail: EventTail, seen: _Seen, now: float) -> None:
        for e in tail.read():
            kind = e.get("event")
            if kind == "fault_injected":
                self.faults_seen.append(e)
                if e.get("permanent"):
                    seen.lost.add(int(e.get("process", 0)))
            elif kind == "save_begin":
                seen.save_open = now
            elif kind == "save_end":
                seen.save_open = None
            elif kind in ("done", "wall_time_limit"):
                seen.finishing = now

    def _hang(self, nproc, hb, now, t_spawn, hang, startup, seen: _Seen) -> Outcome | None:
        if hb.stepping_since is None:
            if now - t_spawn <= startup:
                return None
            missing = [p for p in range(nproc) if p not in hb.last]
            return Outcome(
                "failure",
                "hang",
                missing[0] if missing else 0,
                None,
                None,
                detail=f"no first step within the start-up timeout {startup:.0f}s",
            )
        limit = self.opts.hang_timeout
        if limit is None:  # auto: 10 step times, at least a minute
            limit = max(hang, 10 * (hb.step_time() or 0.0))
        p, stale = hb.stalest(now)
        if seen.save_open is not None:  # a save may compile; give it the start-up time
            if now - seen.save_open <= startup:
                return None
            stale = now - seen.save_open
        elif stale <= limit:
            return None
        hung = [e for e in self.faults_seen
                if e.get("kind") == "hang" and e.get("incarnation") == self.incarnation]  # fmt: skip
        if hung:
            p = int(hung[-1].get("process", p))
        return Outcome(
            "failure",
            "hang",
            p,
            None,
            self._failed_step(hb),
            detail=f"no progress for {stale:.1f}s",
            max_step=hb.max_step(),
            stale_s=stale,
        )

    def _failed_step(self, hb: Heartbeats) -> int | None:
        """The step in progress at the failure: the injected fault's, else one past the last
        completed one (heartbeats and metrics of this incarnation)."""
        ending = [
            e for e in self.faults_seen
            if e.get("incarnation") == self.incarnation and e.get("kind") in goodput.ENDING_FAULTS
        ]  # fmt: skip
        if ending:
            return int(ending[-1]["step"])
        done = [s for s in (hb.max_step(), self._last_logged_step()) if s is not None]
        return max(done) + 1 if done else None

    def _last_logged_step(self) -> int | None:
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            start = max(0, os.path.getsize(path) - 8192)
            f.seek(start)
            lines = f.read().splitlines()[1 if start else 0 :]  # the first may be cut
        for line in reversed(lines):
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if "loss" in m and m.get("incarnation") == self.incarnation:
                return int(m["step"])
        return None

    def _stragglers(self, hb: Heartbeats, reported: set[int]) -> None:
        for s in find_stragglers(hb.recent, self.opts.straggler_factor):
            if s["process"] in reported:
                continue
            reported.add(s["process"])
            self.event("straggler", **s)
            say(
                f"straggler: process {s['process']} reaches each step {s['lag_s']:.2f}s after the "
                f"others ({s['factor']:.1f}x their step time) at step {s['step']}"
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
                time.sleep(self.opts.poll_s)
            return Outcome("stopped", "preempted", code=L.EXIT_PREEMPTED)
        say("interrupted: stopping the workers")
        return Outcome("stopped", "interrupted", code=130)


def main(opts: Options) -> int:
    """`jaxpar launch`: lead the job (node rank 0) or follow the leader."""
    if opts.nnodes > 1 and opts.node_rank != 0:
        return run_follower(opts)
    return Supervisor(opts).run()
