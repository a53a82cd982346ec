"""The supervisor's pure decisions: what an exit means, which one was the root cause, how long to
back off, when failures are a crash loop, how to shrink the job, who straggles, what a worker's
environment is. No processes, sockets or files here."""

from __future__ import annotations

import math
import os
import signal
import statistics
from dataclasses import dataclass, field

from jaxpar.engine.mesh import AXES, BATCH_AXES, HOST_AXES, batch_ways
from jaxpar.rundir.ownership import ENV_RUN_LOCK
from jaxpar.worker import bootstrap

THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"


@dataclass
class Outcome:
    """How one incarnation ended."""

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


def classify_exit(code: int) -> str:
    """The `failure` cause of a worker's return code (negative: killed by that signal)."""
    if code < 0:
        return "signal"
    if code == bootstrap.EXIT_COLLECTIVE:
        return "collective"
    if code == bootstrap.EXIT_NAN:
        return "nan"
    return "exit"


EXIT_MEANINGS = {
    bootstrap.EXIT_USAGE: "a usage or configuration error",
    bootstrap.EXIT_PREEMPTED: "it saved on a preemption notice",
    bootstrap.EXIT_COLLECTIVE: "a collective or coordination error: a peer was lost",
    bootstrap.EXIT_NAN: "a non-finite loss, or a state of NaNs that was not saved",
    bootstrap.EXIT_REPLICA: "data-parallel replicas disagree",
    bootstrap.EXIT_NO_SPACE: "the run directory's disk is full",
}


def exit_text(code: int) -> str:
    """A worker's return code in words, for a console line: "was killed by SIGKILL (code -9)",
    "exited with code 44 (a non-finite loss, ...)"."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (code {code})"
    meaning = EXIT_MEANINGS.get(code)
    return f"exited with code {code}" + (f" ({meaning})" if meaning else "")


def secondary(code: int) -> int:
    """0 for a likely root cause; higher for the consequences of a peer's failure."""
    if code in (bootstrap.EXIT_COLLECTIVE, -signal.SIGABRT):
        return 2
    if code == bootstrap.EXIT_PREEMPTED:
        return 1
    return 0


def root_exit(exits: list[tuple[int, int]]) -> tuple[int, int]:
    """The (process, code) that most likely started it, from exits in observed order."""
    failed = [(p, c) for p, c in exits if c != 0] or exits
    return min(failed, key=lambda pc: secondary(pc[1]))


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
    outer, inner = HOST_AXES  # processes are laid along these batch axes, outer first
    fixed = math.prod(mesh.get(a, 1) for a in AXES if a not in HOST_AXES)
    # Batch axes inside a process (expert) keep their size and split the batch further.
    inside = math.prod(mesh.get(a, 1) for a in BATCH_AXES if a not in HOST_AXES)
    old_ways = batch_ways(mesh)
    for n in range(available, min_nproc - 1, -1):
        devices = n * devices_per_proc
        if devices % fixed or global_batch % n:
            continue
        ways = devices // fixed  # the batch is split this many ways over (outer x inner)
        if global_batch % (ways * inside):
            continue
        # The inner axis must absorb the processes the outer one cannot take.
        for k in (math.gcd(mesh.get(inner, 1), ways), 1):
            if k % (n // math.gcd(ways // k, n)) == 0:
                break
        else:
            continue
        m = max(microbatches, math.ceil(microbatches * old_ways / (ways * inside)))
        while global_batch % (ways * inside * m):
            m += 1
        return {"nproc": n, "mesh": dict(mesh, **{outer: ways // k, inner: k}), "microbatches": m}
    return None


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
            out.append({"process": p, "step": common[-1], "lag_s": lag,
                        "factor": f if math.isfinite(f) else None,
                        "step_time_s": period})  # fmt: skip
    return out


def worker_env(
    base: dict[str, str], *, coordinator: str, bind: str, nproc: int, process_id: int,
    local_rank: int, devices_per_proc: int, run_dir: str, incarnation: int, faults: list[str],
    heartbeat_timeout: float, collective_timeout: float, layout: dict | None = None,
    run_lock: str | None = None,
) -> dict[str, str]:  # fmt: skip
    """The environment of one worker (the contract is in jaxpar/worker/bootstrap.py). `layout` is a
    shrunk job's {"mesh": "data=4,...", "microbatches": M}; the training loop applies it."""
    env = dict(base)
    flags = env.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        flags = f"{flags} {THREAD_FLAGS}".strip()
    env.update(
        {
            bootstrap.ENV_COORDINATOR: coordinator,
            bootstrap.ENV_COORDINATOR_BIND: bind,
            bootstrap.ENV_NUM_PROCESSES: str(nproc),
            bootstrap.ENV_PROCESS_ID: str(process_id),
            bootstrap.ENV_DEVICES_PER_PROC: str(devices_per_proc),
            bootstrap.ENV_RUN_DIR: run_dir,
            bootstrap.ENV_INCARNATION: str(incarnation),
            bootstrap.ENV_SUPERVISED: "1",
            bootstrap.ENV_SUPERVISOR_PID: str(os.getpid()),
            bootstrap.ENV_HEARTBEAT_TIMEOUT: str(int(heartbeat_timeout)),
            bootstrap.ENV_COLLECTIVE_TIMEOUT: str(int(collective_timeout)),
            "XLA_FLAGS": flags,
            "PYTHONUNBUFFERED": "1",
        }
    )
    for key in (bootstrap.ENV_MESH, bootstrap.ENV_MICROBATCHES):
        env.pop(key, None)  # only the supervisor's own layout, never one inherited
    env.pop(ENV_RUN_LOCK, None)
    if run_lock:  # the workers run under the supervisor's lock on the run directory
        env[ENV_RUN_LOCK] = run_lock
    if layout:
        env[bootstrap.ENV_MESH] = str(layout["mesh"])
        env[bootstrap.ENV_MICROBATCHES] = str(int(layout["microbatches"]))
    faults = [f for f in (env.get(bootstrap.ENV_FAULTS, "").split(";") + faults) if f.strip()]
    if faults:
        env[bootstrap.ENV_FAULTS] = ";".join(dict.fromkeys(faults))
    ids = range(local_rank * devices_per_proc, (local_rank + 1) * devices_per_proc)
    env.setdefault("JAX_LOCAL_DEVICE_IDS", ",".join(map(str, ids)))  # accelerators only
    return env


# what must equal between a standby group's spec and the group a restart needs
STANDBY_KEYS = ("incarnation", "attempt", "nproc", "process_ids", "layout", "faults",
                "collective_timeout")  # fmt: skip


def restart_path(
    *, enabled: bool, nnodes: int, standby: dict | None, ready: bool, want: dict, spares: bool
) -> tuple[str, str]:
    """How the next group starts: ("standby", "") when a ready standby group was built for
    exactly this group, else ("spares" | "cold", why the standby is not used; "" when standby
    groups are off)."""
    why = ""
    if enabled:
        if nnodes > 1:
            why = "multi-node job"
        elif standby is None:
            why = "no standby group"
        elif any(standby.get(k) != want.get(k) for k in ("nproc", "process_ids", "layout")):
            why = "layout changed"
        elif any(standby.get(k) != want.get(k) for k in STANDBY_KEYS):
            why = "built for another incarnation"
        elif not ready:
            why = "standby not ready"
        else:
            return "standby", ""
    return ("spares" if spares else "cold"), why
