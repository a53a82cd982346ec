"""The goodput ledger: incidents, recovery times and time lost per cause, from a run directory.

Everything here is a pure function of events.jsonl and metrics.jsonl, so the ledger of any run
directory can be recomputed after the fact. One incident per group restart (or per give-up):

    cause        `fault_injected` (when injected), else the supervisor's `failure`/`preemption`
    detected     `failure` / `preemption` (written by the supervisor when it noticed)
    stopped      `survivors_stopped`
    new group    `group_started`
    initialised  `start`         (worker: jax.distributed up, mesh and program built)
    restored     `restore`
    compiled     `compiled`
    first step   the first metrics line of the new group

Recovery time = first step - cause (DESIGN.md); `mttr_s` is its mean over incidents.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxpar.metrics import RunDir, read_jsonl, summarize

# Injected faults that end an incarnation (slow, diverge and corrupt do not, by themselves).
ENDING_FAULTS = ("kill", "hang", "sigterm", "nan", "killsave")
INCIDENT_EVENTS = ("failure", "preemption")


def _first_after(events: list[dict], name: str, t: float, until: float | None) -> dict | None:
    for e in events:
        if e.get("event") == name and e["time"] >= t and (until is None or e["time"] < until):
            return e
    return None


def _cause_time(events: list[dict], incident: dict, since: float) -> tuple[float, str]:
    """When the incident began: the fault that caused it if injected, else its detection."""
    faults = [
        e
        for e in events
        if e.get("event") == "fault_injected"
        and e.get("kind") in ENDING_FAULTS
        and since <= e["time"] <= incident["time"]
    ]
    if faults:
        return faults[-1]["time"], f"fault_injected {faults[-1].get('spec')}"
    return incident["time"], incident["event"]


def _gap(later: dict | None, earlier: float | None) -> float | None:
    if later is None or earlier is None:
        return None
    return later["time"] - earlier


def incidents(events: list[dict], metrics: list[dict]) -> list[dict]:
    """The timeline of every incident, with its phases in seconds (None where not reached)."""
    marks = [e for e in events if e.get("event") in INCIDENT_EVENTS]
    steps = [m for m in metrics if "loss" in m and "time" in m]
    superseded = _superseded(steps)
    out = []
    prev_t = events[0]["time"] if events else 0.0
    for i, inc in enumerate(marks):
        t_detect = inc["time"]
        until = marks[i + 1]["time"] if i + 1 < len(marks) else None
        t_cause, cause_from = _cause_time(events, inc, prev_t)
        stopped = _first_after(events, "survivors_stopped", t_detect, until)
        group = _first_after(events, "group_started", t_detect, until)
        t_group = group["time"] if group else None
        start = _first_after(events, "start", t_group, until) if group else None
        restore = _first_after(events, "restore", t_group, until) if group else None
        compiled = _first_after(events, "compiled", t_group, until) if group else None
        first = next((m for m in steps if group and m["time"] >= t_group), None)
        if first is not None and until is not None and first["time"] >= until:
            first = None
        lost = [m for m in superseded if prev_t <= m["time"] <= t_detect]
        cause = inc.get("cause", "preempted") if inc["event"] == "failure" else "preempted"
        out.append(
            {
                "cause": cause,
                "process": inc.get("process"),
                "code": inc.get("code"),
                "step": inc.get("step"),
                "incarnation": inc.get("incarnation"),
                "cause_from": cause_from,
                # with no injected cause, a hang's detection took its time without progress
                "detect_s": inc.get("stale_s", 0.0)
                if cause_from == "failure"
                else t_detect - t_cause,
                "stop_s": _gap(stopped, t_detect),
                "restart_s": _gap(group, stopped["time"] if stopped else t_detect),
                "init_s": _gap(start, t_group),
                "restore_s": _gap(restore, start["time"] if start else None),
                "compile_s": _gap(compiled, (restore or start or {}).get("time")),
                "first_step_s": _gap(first, compiled["time"] if compiled else None),
                "recovery_s": first["time"] - t_cause if first else None,
                "lost_steps": len(lost),
                "lost_step_time_s": float(sum(m.get("step_time_s", 0.0) for m in lost)),
            }
        )
        prev_t = t_detect
    return out


def _superseded(steps: list[dict]) -> list[dict]:
    """Metrics lines whose step was logged again later (recomputed after a restore)."""
    last: dict[int, int] = {}
    for i, m in enumerate(steps):
        last[int(m["step"])] = i
    return [m for i, m in enumerate(steps) if last[int(m["step"])] != i]


def time_lost(events: list[dict], metrics: list[dict], incs: list[dict]) -> dict[str, float]:
    """Seconds lost per cause: recovery (cause -> first step) plus recomputed steps, and the
    start-up before the first step and blocking checkpoint time."""
    out: dict[str, float] = {}
    for inc in incs:
        spent = (inc["recovery_s"] or 0.0) + inc["lost_step_time_s"]
        out[inc["cause"]] = out.get(inc["cause"], 0.0) + spent
    steps = [m for m in metrics if "loss" in m and "time" in m]
    begin = next((e for e in events if e.get("event") in ("launch", "group_started")), None)
    if begin is not None and steps:
        out["startup"] = max(0.0, steps[0]["time"] - begin["time"])
    blocking = [e.get("blocking_s", 0.0) for e in events if e.get("event") == "save_end"]
    if blocking:
        out["checkpoint_blocking"] = float(sum(blocking))
    return out


def summarize_run(
    run_dir: str, wall_s: float, restarts: int, status: str, **extra: Any
) -> dict[str, Any]:
    """summary.json for a launched run: DESIGN.md's fields plus the ledger."""
    run = RunDir(run_dir)
    events = read_jsonl(run.file("events.jsonl"))
    metrics = read_jsonl(run.file("metrics.jsonl"))
    out = summarize(run, wall_s, restarts)
    incs = incidents(events, metrics)
    recoveries = [i["recovery_s"] for i in incs if i["recovery_s"] is not None]
    out["mttr_s"] = float(np.mean(recoveries)) if recoveries else None
    out["status"] = status
    out["incidents"] = incs
    lost = time_lost(events, metrics, incs)
    productive = (out["goodput"] or 0.0) * wall_s
    lost["other"] = max(0.0, wall_s - productive - sum(lost.values()))
    out["time_lost_s"] = lost
    out["preemptions"] = sum(1 for i in incs if i["cause"] == "preempted")
    out.update(extra)
    return out


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
        parts = [
            f"{k.removesuffix('_s')} {i[k]:.1f}s"
            for k in ("detect_s", "stop_s", "restart_s", "init_s", "restore_s", "compile_s")
            + ("first_step_s", "recovery_s")
            if i.get(k) is not None
        ]
        lines.append(f"  {i['cause']} (process {i['process']}): " + ", ".join(parts))
    return "\n".join(lines)


def ledger_of(run_dir: str) -> list[dict]:
    """The incidents of an existing run directory (for reports and benchmarks)."""
    path = os.path.abspath(run_dir)
    return incidents(
        read_jsonl(os.path.join(path, "events.jsonl")),
        read_jsonl(os.path.join(path, "metrics.jsonl")),
    )
