"""`jaxpar bench survivors`: do the healthy replica groups keep training through another's failure?

    jaxpar bench survivors [--quick] [--out DIR]

One job of R replica groups x P processes x 2 simulated devices (gpt_tiny), through
`jaxpar launch --groups R` where that launch has it (else `jaxpar launch` of R x P processes,
where a failure restarts every process: the baseline survivors improve on), without faults and
with a random worker SIGKILLed every T seconds, per restart path (the standby group, or the
spares only); then the same with torchft (torch CPU, gloo, its Lighthouse, a GPT of the same
shape: `survivors_peer.py`), whose figures go under `torchft`. Each run's window of `seconds`
starts `warmup_s` after its first step (every group trained, for the peer): a failure's cost is
measured, not the job's start-up, when the groups build their spares and standby groups on the
same cores. What is measured: `survivors_measure.py`; the design: docs/design.md, "Benchmarks".
Written under DIR: survivors.json, the dated record, survivors.png, and survivors-runs/ (each
run's events, metrics, console and worker logs, without checkpoints: the runs are deleted).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from jaxpar.bench import survivors_measure as measure
from jaxpar.bench import survivors_peer as peer
from jaxpar.bench.harness import Bench, table
from jaxpar.bench.recovery import DEVICES, SMALL, _command, _env, _Job, _restart_paths
from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import SupervisorEvent, read_jsonl

FULL = {"groups": 3, "per_group": 2, "seconds": 120.0, "periods": (60.0, 30.0),
        "paths": ("standby", "spares"), "peer": True, "warmup_s": 30.0}  # fmt: skip
# quick: one job of 3 groups x 1 process, its first half without faults
QUICK = {"groups": 3, "per_group": 1, "seconds": 24.0, "periods": (12.0,), "paths": ("standby",),
         "peer": False, "warmup_s": 0.0}  # fmt: skip
PER_PROCESS_BATCH = 8  # examples per process per step (both sides)
PATHS = {"standby": ["--standby"], "spares": []}


def groups_supported() -> bool:
    """Whether this jaxpar's `launch` runs replica groups (`--groups`)."""
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", "launch", "--help"],
                       capture_output=True, text=True, env=_env())  # fmt: skip
    return "--groups" in r.stdout


class JaxparRun:
    """`jaxpar launch` of the job, its trace read from the run directory."""

    def __init__(self, root: str, name: str, p: dict, path: str, groups: bool, recipe: str,
                 overrides: list[str]):  # fmt: skip
        self.p, self.groups = p, groups
        self.nproc = p["groups"] * p["per_group"]
        self.batch = PER_PROCESS_BATCH * self.nproc
        args = [*PATHS[path], "--max-restarts", "1000"]
        if groups:
            args += ["--groups", str(p["groups"])]
        sets = [f"data.global_batch={self.batch}", "ckpt.local_every=1",
                f"run.compile_cache_dir={os.path.join(root, 'compiled')}", *overrides]  # fmt: skip
        self.run_dir = os.path.join(root, name)
        self.job = _Job(self.run_dir, self.nproc, args, _command(recipe, 1_000_000, 50, sets))

    def pids(self) -> dict[int, int]:
        """{process index: pid} from the workers' heartbeats."""
        hb = os.path.join(self.run_dir, runlog.HEARTBEATS)
        out = {}
        for i in range(self.nproc):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                out[i] = int(runlog.read_json_object(os.path.join(hb, f"proc{i}.json"))["pid"])
        return out

    def steps(self) -> list[measure.Step]:
        """Steps from metrics.jsonl: with groups, those of each line's `quorum`, each group's
        life the number of times it had joined by then (a group that rejoins within the step it
        was killed in never sits one out); else all."""
        every = tuple(range(self.p["groups"]))
        per_group = self.batch / self.p["groups"]
        joins: dict[int, list[int]] = {}
        for e in read_jsonl(os.path.join(self.run_dir, runlog.EVENTS)):
            if e.get("event") == SupervisorEvent.GROUP_JOINED:
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    joins.setdefault(int(e["group"]), []).append(int(e["step"]))
        out = []
        for m in read_jsonl(os.path.join(self.run_dir, runlog.METRICS)):
            if "loss" not in m or "time" not in m:
                continue
            if self.groups and isinstance(m.get("quorum"), list):
                q = tuple(int(g) for g in m["quorum"])
                n = int(m["step"])  # steps done: the line of step index n - 1
                lives = {g: sum(first < n for first in joins.get(g, ())) for g in q}
                out.append(measure.Step(float(m["time"]), n, q, per_group * len(q), lives))
            else:
                lives = {g: int(m.get("incarnation", 0)) for g in every}
                out.append(measure.Step(float(m["time"]), int(m["step"]), every, self.batch, lives))
        return out

    def readies(self) -> list[measure.Ready]:
        """When each restarted group was ready: its `group_joined` event less the transfer."""
        out = []
        for e in read_jsonl(os.path.join(self.run_dir, runlog.EVENTS)):
            if e.get("event") == SupervisorEvent.GROUP_JOINED and e.get("transfer"):
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    t = float(e["time"]) - float(e.get("seconds") or 0.0)
                    out.append(measure.Ready(t, int(e["group"])))
        return out

    def paths(self) -> list:
        return _restart_paths(read_jsonl(os.path.join(self.run_dir, runlog.EVENTS)))


def drive(run, period: float | None, seconds: float, p: dict, seed: int,
          startup_timeout: float = 1800) -> dict:  # fmt: skip
    """Wait for the first step and `p["warmup_s"]`, then SIGKILL on schedule for `seconds` s;
    stop the job."""
    job = run.job
    rng = random.Random(seed)
    kills: list[measure.Kill] = []
    samples: list[tuple[float, dict[int, int]]] = []
    deadline = time.time() + startup_timeout
    try:
        while not run.steps():
            if job.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the job ended or did not step (see {run.run_dir})")
            time.sleep(0.2)
        start = min(s.t for s in run.steps()) + p.get("warmup_s", 0.0)
        while time.time() < start:
            if job.proc.poll() is not None:
                raise RuntimeError(f"the job ended while warming up (see {run.run_dir})")
            time.sleep(0.2)
        due = measure.schedule(start, period, seconds)
        while time.time() < start + seconds:
            samples.append((time.time(), run.pids()))
            if due and time.time() >= due[0]:
                due.pop(0)
                slots = p["groups"] * p["per_group"]
                kills.append(measure.kill_random(rng, slots, p["per_group"], run.pids,
                                         lambda: [job.proc.pid]))  # fmt: skip
            if job.proc.poll() is not None:
                raise RuntimeError(f"the job ended during the measurement (see {run.run_dir})")
            time.sleep(0.2)
        samples.append((time.time(), run.pids()))
    finally:
        job.close()
    return {"steps": run.steps(), "kills": kills, "samples": samples, "start": start,
            "readies": run.readies()}  # fmt: skip


def figures(trace: dict, p: dict, seconds: float) -> dict:
    return measure.summarize(trace["steps"], trace["kills"], trace["samples"], p["per_group"],
                             trace["start"], seconds, trace.get("readies", []))  # fmt: skip


def _kept(runs: list[dict], base: dict) -> None:
    for r in runs:
        r["throughput_kept"] = r["throughput"] / base["throughput"] if base["throughput"] else None


def quick_split(trace: dict, seconds: float) -> tuple[dict, dict, float]:
    """--quick runs one job with one kill halfway: its first half (no fault) is the baseline, its
    second half the fault run; (baseline trace, fault trace, each half's seconds)."""
    half = seconds / 2
    mid = trace["start"] + half
    base = {**trace, "kills": [], "samples": [s for s in trace["samples"] if s[0] <= mid]}
    return base, {**trace, "start": mid}, half


def jaxpar_side(p: dict, quick: bool, groups: bool, recipe: str, overrides: list[str],
                root: str) -> tuple[dict, list[dict], dict]:  # fmt: skip
    """(figures of the run without faults, of each run with faults, the traces by run name)."""
    if quick:
        path = p["paths"][0]
        run = JaxparRun(root, "quick", p, path, groups, recipe, overrides)
        trace = drive(run, p["periods"][0], p["seconds"], p, seed=0, startup_timeout=600)
        base_t, fault_t, half = quick_split(trace, p["seconds"])
        base = {"path": "none", "period_s": None, **figures(base_t, p, half)}
        fig = figures(fault_t, p, half)
        runs = [{"path": path, "period_s": p["periods"][0], **fig, "restarted_by": run.paths()}]
        _kept(runs, base)
        return base, runs, {"baseline": base_t, f"{path}-quick": fault_t}
    runs, traces = [], {}
    base_run = JaxparRun(root, "baseline", p, "spares", groups, recipe, overrides)
    traces["baseline"] = drive(base_run, None, p["seconds"], p, seed=0)
    base = {"path": "none", "period_s": None, **figures(traces["baseline"], p, p["seconds"])}
    for path in p["paths"]:
        for period in p["periods"]:
            name = f"{path}-{int(period)}s"
            run = JaxparRun(root, name, p, path, groups, recipe, overrides)
            traces[name] = drive(run, period, p["seconds"], p, seed=int(period))
            fig = figures(traces[name], p, p["seconds"])
            runs.append({"path": path, "period_s": period, **fig, "restarted_by": run.paths()})
    _kept(runs, base)
    return base, runs, traces


def torchft_side(p: dict, root: str) -> tuple[dict, dict]:
    """The peer's figures ({"status": "ok", ...} or {"status": "unavailable", "reason": ...})
    and its traces; never raises: the jaxpar side stands without it."""
    if not p["peer"]:
        return {"status": "skipped", "reason": "--quick runs jaxpar only"}, {}
    try:
        venv, info = peer.ensure()
    except (peer.PeerUnavailable, OSError) as e:
        return {"status": "unavailable", "reason": str(e)}, {}
    batch = PER_PROCESS_BATCH * p["groups"] * p["per_group"]
    kw = {"groups": p["groups"], "per_group": p["per_group"], "batch": batch // p["groups"],
          "min_groups": p["groups"] // 2 + 1, "warmup_s": p.get("warmup_s", 0.0)}  # fmt: skip
    traces, runs = {}, []
    try:
        traces["baseline"] = peer.run(venv, os.path.join(root, "torchft-baseline"), None,
                                      p["seconds"], **kw)  # fmt: skip
        base = {"path": "torchft", "period_s": None, **figures(traces["baseline"], p, p["seconds"])}
        for period in p["periods"]:
            name = f"torchft-{int(period)}s"
            traces[name] = peer.run(venv, os.path.join(root, name), period, p["seconds"],
                                    seed=int(period), **kw)  # fmt: skip
            runs.append({"path": "torchft", "period_s": period,
                         **figures(traces[name], p, p["seconds"])})  # fmt: skip
    except (RuntimeError, OSError) as e:
        return {"status": "failed", "reason": str(e), **info}, traces
    _kept(runs, base)
    return {"status": "ok", **info, "baseline": base, "runs": runs}, traces


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _rows(side: str, base: dict, runs: list[dict]) -> list[list]:
    rows = []
    for r in [base, *runs]:
        every = "no faults" if r["period_s"] is None else f"{r['period_s']:.0f} s"
        kept = "100 %" if r is base else _f(r.get("throughput_kept"), "{:.1%}")
        ready = f"{_f(r.get('ready_to_step_s'))} / {_f(r.get('step_s'))}"
        rows.append([side, r["path"], every, r["kills"], _f(r["throughput"]), kept,
                     r["healthy_restarts"], r["steps_rewound"], _f(r["rejoin_s"]), ready])  # fmt: skip
    return rows


def _table(base: dict, runs: list[dict], tf: dict) -> str:
    header = ["framework", "restart path", "failure every", "kills", "examples/s",
              "throughput kept", "healthy restarts", "steps rewound", "rejoin s (median)",
              "ready to step s / step s"]  # fmt: skip
    rows = _rows("jaxpar", base, runs)
    if tf.get("status") == "ok":
        rows += _rows("torchft", tf["baseline"], tf["runs"])
    text = table(header, rows, "---|---|---:|---:|---:|---:|---:|---:|---:|---:")
    if tf.get("status") != "ok":
        text += f"\n\ntorchft: {tf['status']}: {tf['reason']}"
    return text


def plot(traces: dict, tf_traces: dict, seconds: float, path: str) -> str | None:
    """Examples per second over the window (5 s bins), kills marked; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sides = [(n, t) for n, t in (("jaxpar", traces), ("torchft", tf_traces)) if t]
    fig, axes = plt.subplots(len(sides), 1, figsize=(9, 3.2 * len(sides)), squeeze=False)
    bin_s = max(1.0, seconds / 24)
    for ax, (side, runs) in zip(axes[:, 0], sides, strict=True):
        for name, tr in runs.items():
            rate = measure.rate_series(tr["steps"], tr["start"], seconds, bin_s)
            xs = [bin_s * (i + 0.5) for i in range(len(rate))]
            (line,) = ax.plot(xs, rate, label=name)
            for k in tr["kills"]:
                ax.axvline(k.t - tr["start"], color=line.get_color(), alpha=0.35, ls=":")
        ax.set_title(f"{side}: examples/s ({bin_s:.0f} s bins; dotted: a worker SIGKILLed)")
        ax.set_xlabel("seconds from the window's start (warm-up after the first step)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(b: Bench) -> dict:
    p = QUICK if b.quick else FULL
    groups = groups_supported()
    quick = SMALL if b.quick and b.default_recipe else []
    overrides = list(b.overrides) + quick
    root = tempfile.mkdtemp(prefix="jaxpar-bench-survivors-")
    try:
        base, runs, traces = jaxpar_side(p, b.quick, groups, b.recipe, overrides, root)
        tf, tf_traces = torchft_side(p, root)
        png = plot(traces, tf_traces, p["seconds"] / (2 if b.quick else 1),
                   b.path("survivors.png"))  # fmt: skip
    finally:
        kept = keep_records(root, b.path("survivors-runs"))
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "suite": "survivors",
        "quick": b.quick,
        "recipe": b.recipe,
        "overrides": overrides,
        "launch": f"--groups {p['groups']}"
        if groups
        else "no --groups (every failure restarts all)",
        "groups": p["groups"],
        "nproc": p["groups"] * p["per_group"],
        "devices_per_proc": DEVICES,
        "global_batch": PER_PROCESS_BATCH * p["groups"] * p["per_group"],
        "window_s": p["seconds"],
        "warmup_s": p.get("warmup_s", 0.0),
        "baseline": base,
        "runs": runs,
        "torchft": tf,
        "plot": png,
        "records": kept,
    }
    return b.write("survivors", result, _table(base, runs, tf))


# what a run directory holds that says what happened, kept under OUT: not the checkpoints, the
# compiled programs or the heartbeats (their bytes say nothing a reader of the run needs)
_NOT_KEPT = ("checkpoints", "compiled", "heartbeats", "*.bin")
KEPT_FILE_MAX = 64 << 20  # a larger file is not a record


def _not_kept(folder: str, names: list[str]) -> set[str]:
    out = set(shutil.ignore_patterns(*_NOT_KEPT)(folder, names))
    for n in names:
        path = os.path.join(folder, n)
        if os.path.isfile(path) and os.path.getsize(path) > KEPT_FILE_MAX:
            out.add(n)
    return out


def keep_records(root: str, dest: str) -> str | None:
    """Copy the records of every run under `root` (events, metrics, summaries, the console and
    workers' logs) to `dest`, one folder per run, before the runs are deleted; `dest`, or None
    when there was nothing to keep. A failure to copy is said, never raised: the figures stand."""
    names = os.listdir(root) if os.path.isdir(root) else []
    names = sorted({n for n in names if os.path.isdir(os.path.join(root, n))}
                   - _not_kept(root, names))  # fmt: skip
    if not names:
        return None
    try:
        shutil.rmtree(dest, ignore_errors=True)  # a rerun's records replace the last run's
        for name in names:
            shutil.copytree(os.path.join(root, name), os.path.join(dest, name),
                            ignore=_not_kept, symlinks=True)  # fmt: skip
    except OSError as e:
        print(f"the runs' records were not all kept under {dest}: {e}", flush=True)
    return dest
