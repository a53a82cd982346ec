"""`jaxpar bench recovery`: how long a restart takes, and how much work survives repeated failures.

    jaxpar bench recovery [--quick] [--recipe gpt_tiny] [--paths standby,standby-hang]

Real `jaxpar launch` jobs and real SIGKILLs, one job per restart path. The paths, and how
recovery and goodput are measured: docs/design.md, "Benchmarks" (measured runs: docs/benchmarks/).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from jaxpar.bench import recovery_peer
from jaxpar.bench.harness import Bench, table
from jaxpar.rundir import runlog
from jaxpar.rundir.goodput import ledger_of
from jaxpar.rundir.runlog import PHASES, SupervisorEvent, WorkerEvent, read_jsonl
from jaxpar.worker import standby as standby_lib

DEVICES = 2  # CPU devices per process
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The hang path's timeout: above SLOW_S plus a step slowed by a standby group being built on the
# same cores (a worker waiting for a `slow` peer makes no progress either).
HANG_TIMEOUT_S = 12
# the default recipe made smaller for the quick version (each cold incarnation compiles in seconds).
SMALL = ["model.n_layers=1", "model.d_model=64", "model.d_mlp=128"]
# quick: 2 processes instead of 4 (the same paths, half the processes on a small machine)
FULL = {
    "kills": (8, 14, 20, 26),
    "steps": 30,
    "every": 5,
    "periods": (30.0, 60.0),
    "goodput_paths": ("local", "standby"),
    "cycles": 4,
    "nproc": 4,
    "standby_slow_s": 5.0,
    "peer": True,  # the same kills in a torchrun + DDP + DCP job (recovery_peer.py)
}
# quick: one kill after a period of 3 s (a standby or spares restart of the small model takes
# 1-2 s), then another period: the workers train all through it, most of the goodput job's CPU
QUICK = {"kills": (6,), "steps": 8, "every": 3, "periods": (3.0,), "goodput_paths": ("standby",),
         "cycles": 1, "nproc": 2, "standby_slow_s": 20.0, "peer": False}  # fmt: skip
MODES = {
    "cold": (["--no-spares"], ["run.compile_cache=false", "ckpt.local_every=0"]),
    "persistent": ([], ["ckpt.local_every=0"]),
    "local": ([], ["ckpt.local_every=1"]),
    "standby": (["--standby"], ["ckpt.local_every=1"]),
    "standby-hang": (["--standby", "--hang-timeout", str(HANG_TIMEOUT_S)], ["ckpt.local_every=1"]),
}
FAULT = {"standby-hang": "hang"}  # the injected failure: a SIGSTOP-like hang, else "kill"
# The standby jobs: time for their standby group to get ready. The hang path's sleep is bounded
# by its hang timeout (and the detection itself gives the standby time); the kill path's is
# p["standby_slow_s"]: --quick runs where the machine is busiest (the test suite, several jobs on
# two cores), where a standby group of 2 processes has needed more than 5 s to get ready. Below
# 30 s: a peer waiting 30 s in a collective for the sleeper failed with a collective error.
SLOW_STEPS, SLOW_S = 5, 5.0


def _command(recipe: str, steps: int, every: int, overrides: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "jaxpar.train", "--recipe", recipe, "--steps", str(steps)]
    cmd += ["--no-progress", "--set", f"ckpt.every={every}"]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAR_")}
    # the supervisor gives each worker its devices (and threads, unless XLA_FLAGS sets them);
    # the user's other XLA flags reach the workers
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    # jax's own persistent cache off in both paths (it serves process 0 only): a fair baseline
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return env


class _Job:
    """`jaxpar launch` in the background, in its own session (killed whole on exit)."""

    def __init__(self, run_dir: str, nproc: int, args: list[str], command: list[str]):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.log = open(os.path.join(run_dir, "launch.log"), "wb")
        cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--run-dir", run_dir]
        cmd += ["--nproc", str(nproc), "--devices-per-proc", str(DEVICES), *args, "--", *command]
        self.proc = subprocess.Popen(
            cmd, env=_env(), stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"jaxpar launch did not finish in {timeout:.0f}s") from None
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
        self.log.close()

    def summary(self) -> dict:
        with open(os.path.join(self.run_dir, runlog.SUMMARY)) as f:
            return json.load(f)

    def stepping(self) -> bool:
        return any("loss" in m for m in read_jsonl(os.path.join(self.run_dir, runlog.METRICS)))

    def worker_pids(self) -> list[int]:
        """PIDs of the current group's workers, from their progress heartbeats."""
        hb = os.path.join(self.run_dir, runlog.HEARTBEATS)
        events = read_jsonl(os.path.join(self.run_dir, runlog.EVENTS))
        inc = max(
            (e["incarnation"] for e in events if e.get("event") == WorkerEvent.START), default=None
        )
        pids = []
        for name in sorted(os.listdir(hb)) if os.path.isdir(hb) else []:
            try:
                with open(os.path.join(hb, name)) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if rec.get("incarnation") == inc:
                pids.append(int(rec["pid"]))
        return pids


class _StandbyMemory:
    """Samples, once a second, the resident memory of the job's waiting standby workers (their
    output still goes to the standby directory: they have not been told to go) and of the
    running group's workers; keeps the peaks (MB, summed over processes; a forked worker's RSS
    counts the pages it shares with its spare pool)."""

    def __init__(self, job: _Job):
        self.job, self.standby_mb, self.group_mb = job, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):  # processes come and go while sampled
                self._sample()

    def _sample(self) -> None:
        workers = set(self.job.worker_pids())
        standby = group = 0
        # a waiting standby worker writes to its standby directory (its environment in /proc is
        # its spare pool's when it was forked from one)
        waiting = os.sep + standby_lib.dir_prefix(self.job.run_dir)
        for p in psutil.Process(self.job.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error, OSError):
                rss = p.memory_info().rss
                if waiting in os.readlink(f"/proc/{p.pid}/fd/1"):
                    standby += rss
                elif p.pid in workers:
                    group += rss
        self.standby_mb = max(self.standby_mb, standby / 2**20)
        self.group_mb = max(self.group_mb, group / 2**20)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        return {"standby_peak_rss_mb": self.standby_mb, "group_peak_rss_mb": self.group_mb}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def measure_recovery(mode: str, recipe: str, p: dict, overrides: list[str], root: str) -> dict:
    """One job with len(p["kills"]) injected SIGKILLs; medians of the ledger's phases."""
    launch_args, extra = MODES[mode]
    faults = []
    for i, step in enumerate(p["kills"]):
        kind = FAULT.get(mode, "kill")
        faults += ["--fault", f"{kind}@{step}:process={1 + i % (p['nproc'] - 1)}"]
        if mode.startswith("standby"):
            slow = SLOW_S if mode == "standby-hang" else p["standby_slow_s"]
            faults += ["--fault", f"slow@{step - SLOW_STEPS}:process=0:seconds={slow}"]
    run_dir = os.path.join(root, f"recovery-{mode}")
    args = [*launch_args, *faults, "--max-restarts", str(len(p["kills"]) + 1)]
    job = _Job(
        run_dir, p["nproc"], args, _command(recipe, p["steps"], p["every"], overrides + extra)
    )
    memory = _StandbyMemory(job) if "--standby" in MODES[mode][0] else None
    code = job.wait(timeout=3600)
    rss = memory.stop() if memory is not None else {}
    incidents = ledger_of(run_dir)
    events = read_jsonl(os.path.join(run_dir, runlog.EVENTS))
    restarted = [e for e in events if e.get("incarnation", 0) > 0]
    lost = _lost_steps(run_dir, events)
    metrics = [m for m in read_jsonl(os.path.join(run_dir, runlog.METRICS)) if "loss" in m]
    firsts = {}  # each incarnation's first step: not a steady one
    for m in metrics:
        firsts.setdefault(m.get("incarnation", 0), m["step"])
    steady = [m["step_time_s"] for m in metrics if firsts[m.get("incarnation", 0)] != m["step"]]
    out = {
        "mode": mode,
        "exit_code": code,
        "incidents": len(incidents),
        # how the restarted groups came up: from spares, and with compiled programs loaded
        "warm_starts": sum(
            1 for e in restarted if e.get("event") == WorkerEvent.START and e.get("warm")
        ),
        # how each restarted group was started: standby | spares | cold
        "paths": _restart_paths(events),
        "cache_hits": sum(
            e.get("hits", 0) for e in restarted if e.get("event") == WorkerEvent.COMPILED
        ),
        "causes": [e.get("cause") for e in events if e.get("event") == SupervisorEvent.FAILURE],
        "recovery_s": _median([i["recovery_s"] for i in incidents]),
        "recoveries_s": [i["recovery_s"] for i in incidents],
        "restore_tiers": [
            e.get("tier") for e in restarted if e.get("event") == WorkerEvent.RESTORE
        ],
        "lost_steps": _median(lost),
        "lost_steps_each": lost,
        "steady_step_s": _median(steady),
        **rss,  # standby paths: the waiting standby group's and the running group's peak RSS
    }
    for phase in PHASES:
        out[phase] = _median([i[phase] for i in incidents])
    return out


def _lost_steps(run_dir: str, events: list[dict]) -> list[int]:
    """Per restart: the newest step logged by the failed incarnation minus the step restored."""
    newest: dict[int, int] = {}
    for m in read_jsonl(os.path.join(run_dir, runlog.METRICS)):
        if "loss" in m:
            inc = m.get("incarnation", 0)
            newest[inc] = max(newest.get(inc, 0), int(m["step"]))
    out = []
    for e in events:
        if e.get("event") == WorkerEvent.RESTORE and e.get("incarnation", 0) > 0:
            out.append(newest.get(e["incarnation"] - 1, 0) - int(e["step"]))
    return out


def measure_goodput(
    mode: str, period: float, p: dict, recipe: str, overrides: list[str], root: str
) -> dict:
    """The job (restart path `mode`: local or standby) for `cycles` + 1 periods after its first
    step, a SIGKILL at the end of each of the first `cycles` periods; stopped (SIGTERM) once the
    last period is over."""
    launch_args, extra = MODES[mode]
    run_dir = os.path.join(root, f"goodput-{mode}-{int(period)}s")
    cycles = p["cycles"]
    job = _Job(run_dir, p["nproc"], [*launch_args, "--max-restarts", str(cycles + 2)],
               _command(recipe, 1_000_000, 10, overrides + extra))  # fmt: skip
    rng = random.Random(0)
    kills = 0
    try:
        deadline = time.time() + 1800
        while not job.stepping():
            if job.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"goodput job ended before its first step (see {run_dir})")
            time.sleep(0.2)
        t_first = time.time()
        for _ in range(cycles):
            time.sleep(period)
            pids = job.worker_pids()
            while not pids and job.proc.poll() is None:  # a group starting: kill it once it runs
                time.sleep(0.2)
                pids = job.worker_pids()
            if job.proc.poll() is None:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills += 1
        time.sleep(period)  # one more period, so the last failure's recovery is inside the run
        while not job.worker_pids() and job.proc.poll() is None:
            time.sleep(0.2)
        os.kill(job.proc.pid, signal.SIGTERM)  # preemption notice: workers save and exit
        job.wait(timeout=600)
    finally:
        job.close()
    s = job.summary()
    events = read_jsonl(os.path.join(run_dir, runlog.EVENTS))
    t_launch = next(e["time"] for e in events if e.get("event") == SupervisorEvent.LAUNCH)
    startup = t_first - t_launch
    productive = (s["goodput"] or 0.0) * s["wall_s"]
    return {
        "mode": mode,
        "period_s": period,
        # how each restarted group came up (a standby not ready in time: the spares)
        "paths": _restart_paths(events),
        "kills": kills,
        "wall_s": s["wall_s"],
        "steps": s["steps"],
        "restarts": s["restarts"],
        "goodput": s["goodput"],
        "goodput_steady": productive / max(s["wall_s"] - startup, 1e-9),
        "first_startup_s": startup,
        "mttr_s": s.get("mttr_s"),
        "lost_steps": s["lost_steps"],
        "time_lost_s": s.get("time_lost_s", {}),  # by cause: where the rest of the wall went
    }


def _restart_paths(events: list[dict]) -> list:
    """standby | spares | cold for each restarted group (after the first start)."""
    return [e.get("path") for e in events
            if e.get("event") == SupervisorEvent.GROUP_STARTED and e.get("incarnation", 0) > 0]  # fmt: skip


def _paths(paths: list) -> str:
    """How the restarted groups came up, e.g. "standby x3, spares x1"."""
    counts: dict[str, int] = {}
    for p in paths:
        counts[str(p)] = counts.get(str(p), 0) + 1
    return ", ".join(f"{p} x{n}" for p, n in counts.items()) or "-"


def _table(rec: list[dict], good: list[dict]) -> str:
    def f(x):
        return "-" if x is None else f"{x:.1f}"

    header = ["restart path", "incidents", "recovery s (median)", "steps lost",
              *(p.removesuffix("_s") for p in PHASES)]  # fmt: skip
    rows = [[r["mode"], r["incidents"], f(r["recovery_s"]), f(r["lost_steps"]),
             *(f(r[p]) for p in PHASES)] for r in rec]  # fmt: skip
    header2 = ["restart path", "failure every", "kills", "restarts by", "wall s", "goodput",
               "goodput after first start", "mttr s"]  # fmt: skip
    rows2 = [[g["mode"], f"{g['period_s']:.0f} s", g["kills"], _paths(g["paths"]),
              f"{g['wall_s']:.0f}", f"{g['goodput']:.1%}", f"{g['goodput_steady']:.1%}",
              f(g["mttr_s"])] for g in good]  # fmt: skip
    return "\n\n".join([
        table(header, rows, "---|---:|---:|---:" + "|---:" * len(PHASES)),
        table(header2, rows2, "---|" + "|".join(["---:"] * 7)),
    ])  # fmt: skip


def _peer_text(t: dict, local: dict) -> str:
    """The torchrun job's row (its own phases), and the local path against it."""
    if t["status"] != "ok":
        return f"torchrun + DDP + DCP: {t['status']} ({t.get('reason', '')})"

    def f(x):
        return "-" if x is None else f"{x:.2f}"

    header = ["job", "kills", "recovery s (median)", "steps lost", "to start", "init", "restore",
              "first step", "steady step"]  # fmt: skip
    row = ["torchrun + DDP + DCP", t["kills"], f(t["recovery_s"]), f(t["lost_steps"]),
           f(t["to_start_s"]), f(t["init_s"]), f(t["restore_s"]), f(t["first_step_s"]),
           f(t["steady_step_s"])]  # fmt: skip
    text = table(header, [row], "---|" + "|".join(["---:"] * 8))
    text += f"\n\ntorch {t.get('torch')}; every recovery (s): " + ", ".join(
        f"{e['recovery_s']:.2f}" for e in t["recoveries"]
    )
    if local.get("recovery_s") and t.get("recovery_s"):
        text += (f"\n\nlocal (spares + RAM snapshots) / torchrun: {local['recovery_s']:.2f} s / "
                 f"{t['recovery_s']:.2f} s = {local['recovery_s'] / t['recovery_s']:.2f}; "
                 f"jaxpar's steady step {f(local.get('steady_step_s'))} s")  # fmt: skip
    return text


def selected(paths: tuple[str, ...]) -> list[str]:
    """The restart paths to measure (`--paths`), in MODES order; all when none are named."""
    unknown = [m for m in paths if m not in MODES]
    if unknown:
        raise ValueError(f"unknown restart path(s) {', '.join(unknown)} for --paths; "
                         f"use some of {', '.join(MODES)}")  # fmt: skip
    return [m for m in MODES if not paths or m in paths]


def run(b: Bench) -> dict:
    modes = selected(b.paths)
    p = QUICK if b.quick else FULL
    recipe = b.recipe
    # quick: the small model's steps take milliseconds, so an asynchronous save could still be
    # in flight at the kill (a restart from step 0); quick jobs save synchronously.
    quick = [*SMALL, "ckpt.use_async=false"] if b.quick and b.default_recipe else []
    overrides = list(b.overrides) + quick
    root = tempfile.mkdtemp(prefix="jaxpar-bench-recovery-")
    try:
        rec = [measure_recovery(m, recipe, p, overrides, root) for m in modes]
        # the peer right after jaxpar's restart jobs: the nearest the machine's load allows
        torchrun = (recovery_peer.torchrun_side(p, root, batch=32)
                    if p["peer"] and recipe == "gpt_tiny" and not overrides else None)  # fmt: skip
        good = [measure_goodput(m, t, p, recipe, overrides, root)
                for m in p["goodput_paths"] if m in modes for t in p["periods"]]  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    by_mode = {r["mode"]: r for r in rec}
    none = {"recovery_s": None}
    cold, fast = by_mode.get("cold", none), by_mode.get("local", none)
    standby, hang = by_mode.get("standby", none), by_mode.get("standby-hang", none)
    ratio = (
        (cold["recovery_s"] / fast["recovery_s"])
        if cold["recovery_s"] and fast["recovery_s"]
        else None
    )
    result = {
        "suite": "recovery",
        "quick": b.quick,
        "recipe": recipe,
        "overrides": overrides,
        "nproc": p["nproc"],
        "devices_per_proc": DEVICES,
        "xla_flags": _env().get("XLA_FLAGS", ""),
        "paths": modes,
        "recovery": rec,
        "recovery_s": fast["recovery_s"],
        "cold_over_local": ratio,
        "standby_s": standby["recovery_s"],
        "standby_peak_rss_mb": standby.get("standby_peak_rss_mb"),
        "standby_hang_s": hang["recovery_s"],
        "goodput": good,
        "torchrun": torchrun,
        "local_over_torchrun": (
            fast["recovery_s"] / torchrun["recovery_s"]
            if fast["recovery_s"] and torchrun and torchrun.get("recovery_s")
            else None
        ),  # fmt: skip
    }
    text = _table(rec, good)
    if torchrun is not None:
        text += "\n\n" + _peer_text(torchrun, fast)
    said = []
    if ratio:
        said.append(f"{fast['recovery_s']:.1f}s with spares + compile cache + local snapshots, "
                    f"{cold['recovery_s']:.1f}s cold ({ratio:.1f}x)")  # fmt: skip
    if standby["recovery_s"]:
        said.append(f"{standby['recovery_s']:.1f}s from a standby group")
    if hang["recovery_s"]:
        said.append(
            f"a hang (hang timeout {HANG_TIMEOUT_S} s) to first step {hang['recovery_s']:.1f}s"
        )
    if said:
        text += "\n\nrecovery: " + "; ".join(said)
    if standby.get("standby_peak_rss_mb"):
        text += (f"\n\nmemory: a waiting standby group of {p['nproc']} processes peaked at "
                 f"{standby['standby_peak_rss_mb']:,.0f} MB resident, the running group at "
                 f"{standby['group_peak_rss_mb']:,.0f} MB")  # fmt: skip
    return b.write("recovery", result, text)
