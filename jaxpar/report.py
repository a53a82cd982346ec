"""`jaxpar report RUN_DIR`: RUN_DIR/report/report.md with loss, step-time and goodput plots.

    jaxpar report runs/gpt_tiny-20250101-120000

Reads only the run-directory contract (DESIGN.md): metrics.jsonl, events.jsonl, and config.json
where present. Works for a finished run, a run with restarts, restores and shrinks, and a run still
in progress (its timeline ends at the newest record). Plots use matplotlib's object API (no
pyplot), so rendering never changes the caller's backend.

Time accounting (the goodput timeline). A launched run begins with start-up from the supervisor's
`launch` to the first `start`. Each incarnation runs from its `start` event to its newest worker
record; within it:
  start-up / restore  `start` -> compile began (`compiled` time - its seconds): mesh, program,
                      init, or the restore when the incarnation restored a checkpoint
  compile             the `compiled` event's seconds
  productive          step_time_s of the metrics line that is last for its step
  recomputed          step_time_s of lines a later incarnation logged again (work lost)
  checkpoint          blocking_s of each `save_end`
  other               the rest: input pipeline, evaluation, host work between steps
Between incarnations: `detection` (newest record of the failed incarnation -> the supervisor's
`failure` or `preemption` event) and `restart` (-> the next `start`: teardown, relaunch, imports,
jax.distributed). After a clean `done` the gap is idle and counts nowhere. Goodput = productive /
wall-clock. Launched runs also get the supervisor's recovery phases (jaxpar/goodput.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from jaxpar import goodput
from jaxpar.goodput import ENDING_FAULTS
from jaxpar.metrics import last_per_step, read_jsonl, well_formed

# Written by `jaxpar launch`, not by workers: they never extend an incarnation's span.
SUPERVISOR_EVENTS = (
    "launch", "group_started", "failure", "preemption", "survivors_stopped", "restart", "shrink",
    "gave_up", "stacks_dumped", "straggler",
)  # fmt: skip
DETECTIONS = ("failure", "preemption")  # the supervisor noticed an incarnation ending

# cause -> (label, colour); the order is the legend's.
CAUSES: dict[str, tuple[str, str]] = {
    "productive": ("productive steps", "#2ca02c"),
    "startup": ("start-up (build, init)", "#8c8c8c"),
    "restore": ("restore", "#17becf"),
    "compile": ("compile", "#ff7f0e"),
    "checkpoint": ("checkpoint (blocking)", "#1f77b4"),
    "recomputed": ("recomputed steps", "#e377c2"),
    "detection": ("failure detection", "#8b0000"),
    "restart": ("restart (teardown, relaunch, worker init)", "#d62728"),
    "other": ("other (data, eval, host)", "#dddddd"),
}
INC_COLOURS = ("tab:blue", "tab:olive", "tab:purple", "tab:brown", "tab:cyan", "tab:gray")
MARK = {"failure": "crimson", "restore": "seagreen", "shrink": "darkviolet"}


@dataclass
class Incarnation:
    """One start of the run: its worker events and metrics lines."""

    index: int
    start: float
    end: float = 0.0  # newest worker record
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)

    def first(self, name: str) -> dict | None:
        return next((e for e in self.events if e["event"] == name), None)

    def last(self, name: str) -> dict | None:
        return next((e for e in reversed(self.events) if e["event"] == name), None)

    def ending_fault(self) -> dict | None:
        kinds = [e for e in self.events if e["event"] == "fault_injected"]
        return next((e for e in reversed(kinds) if e.get("kind") in ENDING_FAULTS), None)


@dataclass
class Restart:
    """What ended incarnation `index - 1` and how incarnation `index` resumed."""

    index: int
    cause: str
    failed_at_step: int | None
    resumed_from: int  # restored checkpoint step (0: started over)
    restored: bool
    shrink: dict | None
    recovery_s: float | None  # first metrics line of the new incarnation - the failure's cause


@dataclass
class Analysis:
    run_dir: str
    config: dict
    incarnations: list[Incarnation]
    per_step: dict[int, dict]
    evals: dict[int, dict]
    intervals: list[tuple[int, float, float, str]]  # (row, t0, t1, cause); t relative to t0
    totals: dict[str, float]
    wall_s: float
    t0: float
    restarts: list[Restart]
    status: str
    supervisor: list[dict]
    ledger: list[dict]  # jaxpar.goodput incidents (launched runs): recovery phases

    @property
    def goodput(self) -> float | None:
        return self.totals["productive"] / self.wall_s if self.wall_s > 0 else None


def load(run_dir: str) -> tuple[list[dict], list[dict], dict]:
    """(events, metrics lines, config) of a run directory; ValueError if it is not one."""
    ev_path, m_path = (os.path.join(run_dir, n) for n in ("events.jsonl", "metrics.jsonl"))
    if not (os.path.exists(ev_path) or os.path.exists(m_path)):
        raise ValueError(
            f"{run_dir}: no events.jsonl or metrics.jsonl; give the directory a run wrote "
            f"(python -m train --run-dir DIR, or jaxpar launch --run-dir DIR)"
        )
    config = {}
    cfg_path = os.path.join(run_dir, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            config = json.load(f)
    events = well_formed(read_jsonl(ev_path), required=("event", "time"))
    return events, well_formed(read_jsonl(m_path)), config


def _incarnations(events: list[dict], lines: list[dict]) -> list[Incarnation]:
    incs: dict[int, Incarnation] = {}
    for e in events:
        if e.get("event") == "start" and e.get("incarnation", 0) not in incs:
            incs[e.get("incarnation", 0)] = Incarnation(e.get("incarnation", 0), e["time"])
    for line in lines:  # lines of an incarnation whose start event is missing (older writers)
        k = line.get("incarnation", 0)
        if k not in incs and "time" in line:
            incs[k] = Incarnation(k, line["time"] - line.get("step_time_s", 0.0))
    for e in events:
        inc = incs.get(e.get("incarnation", 0))
        if inc is not None and e.get("event") not in SUPERVISOR_EVENTS:
            inc.events.append(e)
            inc.end = max(inc.end, e["time"])
    for line in lines:
        inc = incs[line.get("incarnation", 0)]
        if "loss" in line:
            inc.train.append(line)
        elif "eval_loss" in line:
            inc.evals.append(line)
        inc.end = max(inc.end, line.get("time", inc.start))
    for inc in incs.values():
        inc.end = max(inc.end, inc.start)
    return [incs[k] for k in sorted(incs)]


def _within(inc: Incarnation, winners: set[int]) -> list[tuple[float, float, str]]:
    out = []
    compiled = inc.first("compiled")
    if compiled:
        began = compiled["time"] - compiled.get("seconds", 0.0)
        out.append((inc.start, began, "restore" if inc.first("restore") else "startup"))
        out.append((began, compiled["time"], "compile"))
    else:  # still building or compiling
        out.append((inc.start, inc.end, "restore" if inc.first("restore") else "startup"))
    for line in inc.train:
        cause = "productive" if id(line) in winners else "recomputed"
        out.append((line["time"] - line.get("step_time_s", 0.0), line["time"], cause))
    for e in inc.events:
        if e["event"] == "save_end" and e.get("blocking_s"):
            out.append((e["time"] - e["blocking_s"], e["time"], "checkpoint"))
    return out


def _gap(prev: Incarnation, nxt_start: float | None, failures: list[dict]):
    """Intervals after `prev`'s newest record: detection and restart, or nothing after `done`."""
    if prev.last("done") and not prev.ending_fault():
        return []
    fail = next((f["time"] for f in failures if prev.start <= f["time"]), None)
    if nxt_start is not None:
        fail = fail if fail is not None and fail < nxt_start else None
    out = []
    if fail is not None and fail > prev.end:
        out.append((prev.end, fail, "detection"))
    begin = max(prev.end, fail) if fail is not None else prev.end
    if nxt_start is not None and nxt_start > begin:
        out.append((begin, nxt_start, "restart"))
    return out


def _timeline(incs: list[Incarnation], per_step: dict, events: list[dict]):
    winners = {id(v) for v in per_step.values()}
    failures = [e for e in events if e.get("event") in DETECTIONS]
    intervals, totals, wall = [], dict.fromkeys(CAUSES, 0.0), 0.0
    launch = next((e for e in events if e.get("event") == "launch"), None)
    t0 = incs[0].start
    if launch and launch["time"] < t0:  # spawn, imports and jax.distributed before the 1st start
        t0 = launch["time"]
        intervals.append((incs[0].index, 0.0, incs[0].start - t0, "startup"))
        totals["startup"] = wall = incs[0].start - t0
    for i, inc in enumerate(incs):
        own = _within(inc, winners)
        span = inc.end - inc.start
        nxt = incs[i + 1].start if i + 1 < len(incs) else None
        gap = _gap(inc, nxt, failures)
        for a, b, cause in own + gap:
            b = max(a, b)
            intervals.append((inc.index, a - t0, b - t0, cause))
            totals[cause] += b - a
        wall += span + sum(b - a for a, b, _ in gap)
        totals["other"] += max(0.0, span - sum(b - a for a, b, _ in own))
    return intervals, totals, wall, t0


def _cause(prev: Incarnation, failures: list[dict]) -> tuple[str, float | None]:
    """Why `prev` ended, and the time of that cause (DESIGN.md's recovery-time start)."""
    fault = prev.ending_fault()
    if fault:
        where = f"process {fault.get('process', 0)}, step {fault.get('step')}"
        return f"injected {fault.get('spec', fault.get('kind'))} ({where})", fault["time"]
    fail = next((f for f in failures if f["time"] >= prev.start), None)
    if fail:
        what = f"{fail.get('cause', fail['event'])} of process {fail.get('process', '?')}"
        if fail.get("code") is not None:
            what += f" (code {fail['code']})"
        return f"failure: {what}", fail["time"]
    for name in ("preempted", "nonfinite", "replica_mismatch", "wall_time_limit"):
        e = prev.last(name)
        if e:
            return f"{name} at step {e.get('step')}", e["time"]
    if prev.last("done"):
        return "rerun after a finished run", None
    return "rerun (no failure recorded)", None


def _restarts(incs: list[Incarnation], events: list[dict]) -> list[Restart]:
    failures = [e for e in events if e.get("event") in DETECTIONS]
    shrinks = [e for e in events if e.get("event") == "shrink"]
    out = []
    for prev, inc in zip(incs, incs[1:], strict=False):
        cause, t_cause = _cause(prev, [f for f in failures if f["time"] <= inc.start])
        fault = prev.ending_fault()
        steps = [int(x["step"]) for x in prev.train]
        failed_at = fault.get("step") if fault else (max(steps) + 1 if steps else None)
        restore = inc.first("restore")
        shrink = next((s for s in shrinks if prev.start <= s["time"] <= inc.start), None)
        first = inc.train[0]["time"] if inc.train else None
        rec = first - t_cause if first is not None and t_cause is not None else None
        resumed = int(restore["step"]) if restore else 0
        out.append(Restart(inc.index, cause, failed_at, resumed, bool(restore), shrink, rec))
    return out


def _status(incs: list[Incarnation], events: list[dict]) -> str:
    gave_up = [e for e in events if e.get("event") == "gave_up"]
    if gave_up:
        return f"gave up ({gave_up[-1].get('reason', '?')})"
    last = incs[-1]
    if last.last("done"):
        return "finished"
    age = time.time() - last.end
    return f"in progress, or stopped without finishing (newest record {age:.0f} s ago)"


def analyze(run_dir: str) -> Analysis:
    """Everything the report shows, computed from the run directory's files."""
    events, lines, config = load(run_dir)
    incs = _incarnations(events, lines)
    if not incs:
        raise ValueError(f"{run_dir}: events.jsonl has no start event and there are no metrics")
    per_step = last_per_step(lines, "loss")
    intervals, totals, wall, t0 = _timeline(incs, per_step, events)
    supervisor = [e for e in events if e.get("event") in SUPERVISOR_EVENTS]
    return Analysis(
        run_dir=os.path.abspath(run_dir),
        config=config,
        incarnations=incs,
        per_step=per_step,
        evals=last_per_step(lines, "eval_loss"),
        intervals=intervals,
        totals=totals,
        wall_s=wall,
        t0=t0,
        restarts=_restarts(incs, events),
        status=_status(incs, events),
        supervisor=supervisor,
        ledger=goodput.incidents(events, lines),
    )


# ---- plots --------------------------------------------------------------------------------------


def _figure(size: tuple[float, float], **kw):
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ValueError("jaxpar report draws with matplotlib: pip install matplotlib") from None

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(**kw)


def _marks(ax, a: Analysis, text: bool = True) -> None:
    """Vertical lines at failures, restores and shrinks (x = step)."""
    for r in a.restarts:
        marks = []
        if r.failed_at_step is not None:
            label = f"restart {r.index} (failed @{r.failed_at_step})"
            marks.append((r.failed_at_step, "failure", "--", label))
        label = f"restore @{r.resumed_from}" if r.restored else "no checkpoint: from step 0"
        marks.append((r.resumed_from, "restore", ":", label))
        if r.shrink:
            label = f"shrink {r.shrink.get('from_nproc')}→{r.shrink.get('to_nproc')}"
            marks.append((r.resumed_from, "shrink", "-.", label))
        for x, kind, style, label in marks:
            ax.axvline(x, color=MARK[kind], ls=style, lw=1.2, label=kind)
            if text:
                where = ax.get_xaxis_transform()
                kw = dict(rotation=90, va="top", ha="right", fontsize=7, color=MARK[kind])
                ax.text(x, 0.98, label, transform=where, **kw)


def _legend(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels, strict=True):
        seen.setdefault(lab, h)
    if seen:
        ax.legend(seen.values(), seen.keys(), fontsize=8, loc="upper right")


def plot_loss(a: Analysis, path: str) -> None:
    """Loss (last line per step) with eval loss and restart marks; below it, the steps each
    incarnation ran, so re-run (recomputed) segments show even where losses coincide."""
    n = len(a.incarnations)
    size, ratios = (9, 5.2 + 0.25 * n), [4, 1 + 0.3 * n]
    fig, (ax, cov) = _figure(size, nrows=2, sharex=True, height_ratios=ratios)
    for r in a.restarts:
        if r.failed_at_step is not None and r.failed_at_step > r.resumed_from:
            style = dict(color=CAUSES["recomputed"][1], alpha=0.15, lw=0, label="recomputed steps")
            ax.axvspan(r.resumed_from, r.failed_at_step, **style)
    for inc in a.incarnations:
        if inc.train and n > 1:
            style = dict(color=_colour(inc), lw=4, alpha=0.4, label=f"incarnation {inc.index}")
            ax.plot([x["step"] for x in inc.train], [x["loss"] for x in inc.train], **style)
    if a.per_step:
        style = dict(color="k", lw=1.3, label="loss (last line per step)")
        ax.plot(list(a.per_step), [v["loss"] for v in a.per_step.values()], **style)
    else:
        ax.text(0.5, 0.5, "no steps logged yet", transform=ax.transAxes, ha="center")
    if a.evals:
        style = dict(color="tab:orange", ms=5, label="eval loss")
        ax.plot(list(a.evals), [v["eval_loss"] for v in a.evals.values()], "s", **style)
    _marks(ax, a)
    ax.set(ylabel="loss", title=f"Loss — {_name(a)}")
    ax.grid(alpha=0.3)
    _legend(ax)
    _coverage(cov, a)
    fig.savefig(path, dpi=110)


def _colour(inc: Incarnation) -> str:
    return INC_COLOURS[inc.index % len(INC_COLOURS)]


def _coverage(ax, a: Analysis) -> None:
    """One bar per incarnation over the steps it logged (ticks at each logged step)."""
    for inc in a.incarnations:
        xs = [x["step"] for x in inc.train]
        if xs:
            ax.plot([min(xs), max(xs)], [inc.index] * 2, color=_colour(inc), lw=6)
            ax.plot(xs, [inc.index] * len(xs), "|", color="k", ms=6)
    _marks(ax, a, text=False)
    rows = [inc.index for inc in a.incarnations]
    ax.set_yticks(rows, [f"inc {r}" for r in rows], fontsize=8)
    ax.set(xlabel="step", ylim=(max(rows) + 0.7, min(rows) - 0.7))
    ax.set_title("steps run by each incarnation", fontsize=8)


def plot_step_time(a: Analysis, path: str) -> None:
    fig, (ax, ax2) = _figure((9, 5.5), nrows=2, sharex=True)
    rate_key = _rate_key(a)
    for inc in a.incarnations:
        if not inc.train:
            continue
        xs = [x["step"] for x in inc.train]
        style = dict(color=_colour(inc), lw=0.8, ms=3, label=f"incarnation {inc.index}")
        ax.plot(xs, [x.get("step_time_s", np.nan) for x in inc.train], ".-", **style)
        ax2.plot(xs, [x.get(rate_key) or np.nan for x in inc.train], ".-", **style)
    times = [v["step_time_s"] for v in a.per_step.values() if v.get("step_time_s")]
    if times:
        med = float(np.median(times))
        ax.axhline(med, color="k", lw=0.8, ls="--", label=f"median {med:.3g} s")
        if max(times) / max(min(times), 1e-9) > 20:
            ax.set_yscale("log")
    for axis in (ax, ax2):
        _marks(axis, a, text=False)
        axis.grid(alpha=0.3)
    ax.set(ylabel="step time (s)", title=f"Step time — {_name(a)}")
    ax2.set(xlabel="step", ylabel=rate_key.replace("_per_s", "/s"))
    _legend(ax)
    fig.savefig(path, dpi=110)


def _merged(intervals: list[tuple[int, float, float, str]], tol: float):
    """Adjacent intervals of one cause merged (thousands of steps draw as a few bars)."""
    out: list[list] = []
    for row, t0, t1, cause in sorted(intervals, key=lambda x: (x[0], x[3], x[1])):
        if out and out[-1][0] == row and out[-1][3] == cause and t0 - out[-1][2] <= tol:
            out[-1][2] = max(out[-1][2], t1)
        else:
            out.append([row, t0, t1, cause])
    return out


def plot_goodput(a: Analysis, path: str) -> None:
    rows = [inc.index for inc in a.incarnations]
    fig, (ax, ax2) = _figure(
        (10, 1.6 + 0.45 * len(rows) + 1.2), nrows=2, height_ratios=[max(1, len(rows)), 1]
    )
    span = max((t1 for _, _, t1, _ in a.intervals), default=1.0)
    for inc in a.incarnations:  # the incarnation's whole span underneath: "other"
        ax.broken_barh(
            [(inc.start - a.t0, inc.end - inc.start)],
            (inc.index - 0.35, 0.7),
            color=CAUSES["other"][1],
        )
    for row, t0, t1, cause in _merged(a.intervals, tol=span * 1e-3):
        ax.broken_barh([(t0, t1 - t0)], (row - 0.35, 0.7), color=CAUSES[cause][1])
    ax.set_yticks(rows, [f"incarnation {r}" for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="seconds since launch (or the first start)", xlim=(0, span * 1.01))
    good = a.goodput
    ax.set_title(
        f"Goodput timeline — {_name(a)}: productive {good:.1%} of wall-clock"
        if good is not None
        else f"Goodput timeline — {_name(a)}"
    )
    left = 0.0
    for cause, (label, colour) in CAUSES.items():
        v = a.totals[cause]
        if v > 0:
            share = v / a.wall_s if a.wall_s else 0.0
            ax2.barh([0], [v], left=left, color=colour, label=f"{label}: {v:.1f} s ({share:.0%})")
            left += v
    ax2.set(yticks=[], xlim=(0, max(left, 1e-9) * 1.01))
    ax2.set_title("seconds by cause (all incarnations)", fontsize=9)
    ax2.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
    fig.savefig(path, dpi=110)


# ---- markdown -----------------------------------------------------------------------------------


def _name(a: Analysis) -> str:
    return a.config.get("name") or os.path.basename(a.run_dir)


def _rate_key(a: Analysis) -> str:
    any_tokens = any("tokens_per_s" in v for v in a.per_step.values())
    return "tokens_per_s" if any_tokens else "samples_per_s"


def _median(values) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(vals)) if vals else None


def _fmt(v, spec: str = ".4g", none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def _summary_rows(a: Analysis) -> list[tuple[str, str]]:
    target = a.config.get("train", {}).get("steps")
    steps = max(a.per_step) if a.per_step else 0
    final = f"{a.per_step[steps]['loss']:.4f} (step {steps})" if steps else "n/a"
    ev = a.evals[max(a.evals)] if a.evals else None
    final_eval = f"{ev['eval_loss']:.4f} (step {ev['step']})" if ev else "n/a"
    lost = sum(len(i.train) for i in a.incarnations) - len(a.per_step)
    rate_key, lines = _rate_key(a), a.per_step.values()
    mem = [v["mem_gb"] for v in lines if v.get("mem_gb") is not None]
    recov = [r.recovery_s for r in a.restarts if r.recovery_s is not None]
    restores = [f"step {r.resumed_from} (incarnation {r.index})" for r in a.restarts if r.restored]
    if a.restarts and not restores:
        restores = ["none (no committed checkpoint when restarted)"]
    shrinks = [f"{_shrink(r)} processes (incarnation {r.index})" for r in a.restarts if r.shrink]
    return [
        ("status", a.status),
        ("steps completed", f"{steps}" + (f" / {target}" if target else "")),
        ("final loss", final),
        ("final eval loss", final_eval),
        ("wall-clock (launch or first start → newest record, idle gaps excluded)",
         f"{a.wall_s:.1f} s"),
        ("incarnations / restarts", f"{len(a.incarnations)} / {len(a.restarts)}"),
        ("restores", ", ".join(restores) or "none"),
        ("shrinks", ", ".join(shrinks) or "none"),
        ("recomputed steps", f"{lost} ({a.totals['recomputed']:.1f} s)"),
        ("goodput (productive step time ÷ wall-clock)", _fmt(a.goodput, ".1%")),
        ("recovery time, mean (MTTR)",
         f"{np.mean(recov):.1f} s over {len(recov)}" if recov else "n/a"),
        ("median step time", _fmt(_median(v.get("step_time_s") for v in lines)) + " s"),
        (f"median {rate_key.replace('_per_s', '/s')}",
         _fmt(_median(v.get(rate_key) for v in lines), ",.0f")),
        ("median MFU", _fmt(_median(v.get("mfu") for v in lines), ".1%",
                            "n/a (peak FLOP/s of this device unknown)")),
        ("peak device memory in use", f"{max(mem):.2f} GB" if mem else "n/a (not reported)"),
    ]  # fmt: skip


def _shrink(r: Restart) -> str:
    return f"{r.shrink.get('from_nproc')}→{r.shrink.get('to_nproc')}" if r.shrink else ""


def _time_section(a: Analysis) -> list[str]:
    out = [
        "## Where the time went",
        "",
        "| cause | seconds | share of wall-clock |",
        "|---|---:|---:|",
    ]
    for cause, (label, _) in CAUSES.items():
        share = f"{a.totals[cause] / a.wall_s:.1%}" if a.wall_s else "n/a"
        out.append(f"| {label} | {a.totals[cause]:.1f} | {share} |")
    every = a.config.get("log", {}).get("every", 1)
    if every > 1:
        out += ["", f"Metrics were logged every {every} steps: productive time counts those only."]
    return out


def _restart_section(a: Analysis) -> list[str]:
    if not a.restarts:
        return ["## Restarts", "", "No restarts: one incarnation."]
    out = ["## Restarts", "", "| restart | cause | failed at step | resumed from step | shrink | "
           "recovery s |", "|---|---|---:|---:|---|---:|"]  # fmt: skip
    for r in a.restarts:
        failed, rec = _fmt(r.failed_at_step, "d", ""), _fmt(r.recovery_s, ".1f", "")
        out.append(
            f"| {r.index} | {r.cause} | {failed} | {r.resumed_from} | {_shrink(r)} | {rec} |"
        )
    out += ["", "Recovery time = first metrics line of the new incarnation − the failure's cause "
            "(the `fault_injected` event when injected, else the `failure` event)."]  # fmt: skip
    out += _ledger_table(a.ledger)
    if a.supervisor:
        out += ["", "Supervisor events: " + ", ".join(_describe(e) for e in a.supervisor) + "."]
    return out


def markdown(a: Analysis, images: dict[str, str]) -> str:
    """report.md text; `images` maps a title to a PNG path relative to the report."""
    out = [f"# Run report: {_name(a)}", "", f"Run directory: `{a.run_dir}`  ",
           f"Mesh: `{a.config.get('mesh_resolved', '?')}` · generated "
           f"{time.strftime('%Y-%m-%d %H:%M:%S')}", "", "## Summary", "", "| | |", "|---|---|"]  # fmt: skip
    out += [f"| {k} | {v} |" for k, v in _summary_rows(a)]
    out += ["", *_time_section(a), "", *_restart_section(a), "", "## Plots", ""]
    out += [f"![{title}]({rel})\n" for title, rel in images.items()]
    return "\n".join(out) + "\n"


PHASES = ("detect_s", "stop_s", "restart_s", "init_s", "restore_s", "compile_s", "first_step_s")


def _ledger_table(ledger: list[dict]) -> list[str]:
    """The supervisor's incidents, phase by phase (jaxpar/goodput.py), in seconds."""
    if not ledger:
        return []
    names = [p.removesuffix("_s").replace("_", " ") for p in PHASES]
    out = ["", "### Recovery phases (seconds; supervisor ledger)", ""]
    out += ["| cause | process | " + " | ".join(names) + " | recovery | lost steps |"]
    out += ["|---|---|" + "---:|" * (len(PHASES) + 2)]
    for i in ledger:
        cells = [_fmt(i.get(p), ".1f", "") for p in PHASES + ("recovery_s",)]
        row = [str(i.get("cause")), _fmt(i.get("process"), "", ""), *cells, str(i["lost_steps"])]
        out.append("| " + " | ".join(row) + " |")
    return out


def _describe(e: dict) -> str:
    why = e.get("cause") or e.get("reason")
    return e["event"] + (f" ({why})" if why else "")


def write_report(run_dir: str, out_dir: str | None = None) -> str:
    """Write report.md and its PNGs into `out_dir` (default RUN_DIR/report); returns report.md."""
    a = analyze(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    images = {"Loss": "loss.png", "Step time": "step_time.png", "Goodput timeline": "goodput.png"}
    plot_loss(a, os.path.join(out_dir, images["Loss"]))
    plot_step_time(a, os.path.join(out_dir, images["Step time"]))
    plot_goodput(a, os.path.join(out_dir, images["Goodput timeline"]))
    path = os.path.join(out_dir, "report.md")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(markdown(a, images))
    os.replace(tmp, path)
    return path
