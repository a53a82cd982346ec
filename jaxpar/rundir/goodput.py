"""The goodput ledger of a launched run: summary.json, and the lines `jaxpar launch` prints.

Computed from the run directory by runlog.timeline(), so `jaxpar launch`, summary.json and
`jaxpar report` agree: one incident per supervisor detection, phase by phase, and the wall-clock
split by cause. Design: docs/design.md, "The timeline" and "Recovery time".
"""

from __future__ import annotations

from typing import Any

from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import ENDING_FAULTS, SupervisorEvent, WorkerEvent  # noqa: F401  (ENDING_FAULTS: the supervisor's)
from jaxpar.rundir.writer import RunDir, summarize


def incidents(events: list[dict], metrics: list[dict]) -> list[dict]:
    """The supervisor-detected incidents with their phases in seconds (None where not reached)."""
    if not events and not metrics:
        return []
    return runlog.timeline(events, metrics).ledger()


def time_lost(events: list[dict], metrics: list[dict], incs: list[dict]) -> dict[str, float]:
    """Seconds lost per cause: recovery (cause -> first step) plus recomputed steps, and the
    start-up before the first step and blocking checkpoint time."""
    out: dict[str, float] = {}
    for inc in incs:
        spent = (inc["recovery_s"] or 0.0) + inc["lost_step_time_s"]
        out[inc["cause"]] = out.get(inc["cause"], 0.0) + spent
    steps = [m for m in metrics if "loss" in m and "time" in m]
    begin = next(
        (
            e
            for e in events
            if e.get("event") in (SupervisorEvent.LAUNCH, SupervisorEvent.GROUP_STARTED)
        ),
        None,
    )
    if begin is not None and steps:
        out["startup"] = max(0.0, steps[0]["time"] - begin["time"])
    blocking = [e.get("blocking_s", 0.0) for e in events if e.get("event") == WorkerEvent.SAVE_END]
    if blocking:
        out["checkpoint_blocking"] = float(sum(blocking))
    return out


def summarize_run(
    run_dir: str, wall_s: float, restarts: int, status: str, **extra: Any
) -> dict[str, Any]:
    """Record the job's end (`ended`, with `status`) and return summary.json's contents.

    `wall_s` is the supervisor's own measure (kept as `job_wall_s`); `wall_s` in the summary is the
    timeline's (launch -> end), the denominator of goodput in the summary and the report alike.
    """
    run = RunDir(run_dir)
    events, metrics = runlog.read_run(run.path)
    # the newest incarnation that ran (RunDir counts the starts: the number of the next one)
    starts = [e.get("incarnation") for e in events if e.get("event") == runlog.WorkerEvent.START]
    run.incarnation = max([i for i in starts if type(i) is int] or [0])
    run.event(SupervisorEvent.ENDED, status=status, wall_s=wall_s)
    events, metrics = runlog.read_run(run.path)
    out = summarize(run, wall_s, restarts)
    out.update(job_wall_s=wall_s, status=status, incidents=[])
    lost: dict[str, float] = {}
    try:
        tl = runlog.timeline(events, metrics)
    except ValueError:  # nothing started: no timeline
        tl = None
    if tl is not None:
        out.update(wall_s=tl.wall_s, goodput=tl.goodput, mttr_s=tl.mttr_s, incidents=tl.ledger())
        lost = time_lost(events, metrics, out["incidents"])
        productive = tl.totals["productive"]
        lost["other"] = max(0.0, tl.wall_s - productive - sum(lost.values()))
    out["time_lost_s"] = lost
    out["preemptions"] = sum(1 for i in out["incidents"] if i["cause"] == "preempted")
    out.update(extra)
    return out


def format_phases(i: dict) -> str:
    """An incident's phases, as `jaxpar launch` prints them and report.md tabulates them."""
    return ", ".join(
        f"{k.removesuffix('_s').replace('_', ' ')} {i[k]:.1f}s"
        for k in (*runlog.PHASES, "recovery_s")
        if i.get(k) is not None
    )


def format_summary(s: dict[str, Any]) -> str:
    """A few human lines for the end of `jaxpar launch`."""
    gp = s.get("goodput")
    lines = [
        f"{s['status']}: {s['steps']} steps, final loss {s.get('final_loss')}, "
        f"wall {s['wall_s']:.1f}s, restarts {s['restarts']}, goodput "
        + (f"{gp:.1%}" if gp is not None else "-")
        + (f", mttr {s['mttr_s']:.1f}s" if s.get("mttr_s") is not None else "")
    ]
    for i in s.get("incidents", []):
        lines.append(f"  {i['cause']} (process {i['process']}): " + format_phases(i))
    return "\n".join(lines)


def ledger_of(run_dir: str) -> list[dict]:
    """The incidents of an existing run directory (for reports and benchmarks)."""
    return incidents(*runlog.read_run(run_dir))
