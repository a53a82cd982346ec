"""`jaxpar report RUN_DIR`: RUN_DIR/report/report.md with loss, step-time and goodput plots (and
a mixture-of-experts run's expert load, jaxpar/tools/experts_report.py).

    jaxpar report runs/gpt_tiny-20250101-120000

Reads only the run-directory contract, for a finished run or one in progress; its time accounting
and incidents are runlog.timeline()'s. Design: docs/design.md, "The timeline".
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import PHASES, Incarnation, Incident, SupervisorEvent
from jaxpar.tools import experts_report

# cause -> (label, colour); the order is the legend's (runlog.CAUSES).
CAUSES: dict[str, tuple[str, str]] = {
    cause: (label, colour)
    for (cause, label), colour in zip(
        runlog.CAUSES.items(),
        ("#2ca02c", "#8c8c8c", "#17becf", "#ff7f0e", "#1f77b4", "#e377c2", "#8b0000", "#d62728",
         "#dddddd"),
        strict=True,
    )
}  # fmt: skip
INC_COLOURS = ("tab:blue", "tab:olive", "tab:purple", "tab:brown", "tab:cyan", "tab:gray")
MARK = {"failure": "crimson", "restore": "seagreen", "shrink": "darkviolet"}


@dataclass
class Analysis:
    run_dir: str
    config: dict
    timeline: runlog.Timeline
    evals: dict[int, dict]
    supervisor: list[dict]

    @property
    def incarnations(self) -> list[Incarnation]:
        return self.timeline.incarnations

    @property
    def per_step(self) -> dict[int, dict]:
        return self.timeline.per_step

    @property
    def intervals(self) -> list[tuple[int, float, float, str]]:
        return self.timeline.intervals

    @property
    def totals(self) -> dict[str, float]:
        return self.timeline.totals

    @property
    def wall_s(self) -> float:
        return self.timeline.wall_s

    @property
    def t0(self) -> float:
        return self.timeline.t0

    @property
    def goodput(self) -> float | None:
        return self.timeline.goodput

    @property
    def status(self) -> str:
        tl = self.timeline
        return f"{tl.status} ({tl.status_detail})" if tl.status_detail else tl.status

    @property
    def restarts(self) -> list[Incident]:
        """Incidents after which an incarnation resumed, in its order (not the extensions)."""
        return [i for i in self.timeline.incidents if i.resumed is not None and not i.extension]

    @property
    def extensions(self) -> list[Incident]:
        """A finished run continued to more steps (`--steps` raised): listed apart."""
        return [i for i in self.timeline.incidents if i.resumed is not None and i.extension]

    @property
    def ledger(self) -> list[dict]:
        """The supervisor-detected incidents (summary.json's `incidents`)."""
        return self.timeline.ledger()


def load(run_dir: str) -> tuple[list[dict], list[dict], dict]:
    """(events, metrics lines, config) of a run directory; ValueError if it is not one."""
    ev_path, m_path = (os.path.join(run_dir, n) for n in (runlog.EVENTS, runlog.METRICS))
    if not (os.path.exists(ev_path) or os.path.exists(m_path)):
        raise ValueError(
            f"{run_dir}: no {runlog.EVENTS} or {runlog.METRICS}; give the directory a run wrote "
            f"(python -m train --run-dir DIR, or jaxpar launch --run-dir DIR)"
        )
    config = {}
    cfg_path = os.path.join(run_dir, runlog.CONFIG)
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            config = json.load(f)
    events = runlog.well_formed(runlog.read_jsonl(ev_path), required=("event", "time"))
    return events, runlog.well_formed(runlog.read_jsonl(m_path)), config


def analyze(run_dir: str) -> Analysis:
    """Everything the report shows, computed from the run directory's files."""
    events, lines, config = load(run_dir)
    try:
        tl = runlog.timeline(events, lines)
    except ValueError as e:
        raise ValueError(f"{run_dir}: {e}") from None
    return Analysis(
        run_dir=os.path.abspath(run_dir),
        config=config,
        timeline=tl,
        evals=runlog.last_per_step(lines, "eval_loss"),
        supervisor=[e for e in events if e.get("event") in SupervisorEvent.ALL],
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
            label = f"restart {r.resumed} (failed @{r.failed_at_step})"
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
    recov = [i.recovery_s for i in a.timeline.incidents if i.recovery_s is not None]
    restores = [
        f"step {r.resumed_from} (incarnation {r.resumed})" for r in a.restarts if r.restored
    ]
    if a.restarts and not restores:
        restores = ["none (no committed checkpoint when restarted)"]
    shrinks = [f"{_shrink(r)} processes (incarnation {r.resumed})" for r in a.restarts if r.shrink]
    return [
        ("status", a.status),
        ("steps completed", f"{steps}" + (f" / {target}" if target else "")),
        ("final loss", final),
        ("final eval loss", final_eval),
        ("wall-clock (launch or first start → end, idle gaps excluded)",
         f"{a.wall_s:.1f} s"),
        ("incarnations / restarts", f"{len(a.incarnations)} / {len(a.restarts)}"),
        ("extensions (a finished run continued)",
         ", ".join(f"from step {r.resumed_from} (incarnation {r.resumed})"
                   for r in a.extensions) or "none"),
        ("restores", ", ".join(restores) or "none"),
        ("shrinks", ", ".join(shrinks) or "none"),
        ("recomputed steps", f"{lost} ({a.totals['recomputed']:.1f} s)"),
        ("goodput (productive step time ÷ wall-clock)", _fmt(a.goodput, ".1%")),
        ("recovery time, mean (MTTR)",
         f"{a.timeline.mttr_s:.1f} s over {len(recov)}" if recov else "n/a"),
        ("median step time", _fmt(_median(v.get("step_time_s") for v in lines)) + " s"),
        (f"median {rate_key.replace('_per_s', '/s')}",
         _fmt(_median(v.get(rate_key) for v in lines), ",.0f")),
        ("median MFU", _fmt(_median(v.get("mfu") for v in lines), ".1%",
                            "n/a (peak FLOP/s of this device unknown)")),
        ("peak device memory in use", f"{max(mem):.2f} GB" if mem else "n/a (not reported)"),
    ]  # fmt: skip


def _shrink(r: Incident) -> str:
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
            f"| {r.resumed} | {r.description} | {failed} | {r.resumed_from} | {_shrink(r)} | {rec} |"
        )
    out += ["", "Recovery time = first metrics line of the new incarnation − the failure's cause "
            "(the `fault_injected` event when injected, else the supervisor's detection minus a "
            "hang's stale time, else the failed incarnation's own record; docs/design.md)."]  # fmt: skip
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
    out += ["", *_time_section(a), "", *_restart_section(a), ""]
    experts = experts_report.section(a.per_step, a.config)
    out += [*experts, ""] if experts else []
    out += ["## Plots", ""]
    out += [f"![{title}]({rel})\n" for title, rel in images.items()]
    return "\n".join(out) + "\n"


def _ledger_table(ledger: list[dict]) -> list[str]:
    """The supervisor's incidents, phase by phase (jaxpar/rundir/goodput.py), in seconds."""
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
    if experts_report.plot(a.per_step, os.path.join(out_dir, "expert_load.png"), _figure):
        images["Expert load"] = "expert_load.png"
    path = os.path.join(out_dir, "report.md")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(markdown(a, images))
    os.replace(tmp, path)
    return path
