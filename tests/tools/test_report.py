"""`jaxpar report`: goodput accounting on synthetic run directories (fast), and a real run directory
with a kill and a restart rendered end to end, TensorBoard events included (slow).
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from jaxpar.rundir import runlog
from jaxpar.rundir.runlog import append_line, last_per_step, read_jsonl
from jaxpar.rundir.writer import read_tensorboard
from jaxpar.tools import report
from tests.support import helpers

PNG = b"\x89PNG\r\n\x1a\n"


# ---- synthetic run directories (fast) -----------------------------------------------------------


def _ev(run, event, t, inc, **kw):
    append_line(
        os.path.join(run, "events.jsonl"), {"event": event, "time": t, "incarnation": inc, **kw}
    )


def _steps(run, inc, steps, t_first, dt=1.0, loss0=5.0):
    for i, step in enumerate(steps):
        line = {"step": step, "loss": loss0 - 0.1 * step, "step_time_s": dt,
                "samples_per_s": 64 / dt, "mfu": None, "time": t_first + i * dt, "incarnation": inc}  # fmt: skip
        append_line(os.path.join(run, "metrics.jsonl"), line)


def _launched_run(run):
    """2 processes; hang injected at step 6 on process 1, detected, restarted on 1 process."""
    _ev(run, "launch", 95.0, 0, nproc=2)  # supervisor: spawn, imports, jax.distributed until 100
    _ev(run, "group_started", 95.5, 0, nproc=2)
    _ev(run, "start", 100.0, 0, nproc=2, mesh="data=8")
    _ev(run, "compiled", 110.0, 0, seconds=8.0)  # compile 100-110 (mesh and init overlap it)
    _steps(run, 0, range(1, 6), t_first=111.0)  # steps 1..5 end at 111..115
    _ev(run, "save_end", 116.0, 0, step=4, blocking_s=0.5)
    _ev(run, "fault_injected", 116.0, 0, kind="hang", spec="hang@6:process=1", process=1, step=6)
    _ev(run, "failure", 130.0, 0, cause="hang", process=1, code=None)
    _ev(run, "survivors_stopped", 131.0, 0, seconds=1.0)
    _ev(run, "shrink", 131.0, 0, from_nproc=2, to_nproc=1)
    _ev(run, "restart", 131.0, 0, attempt=1, nproc=1)
    _ev(run, "group_started", 132.0, 1, nproc=1)
    _ev(run, "start", 134.0, 1, nproc=1, mesh="data=4")
    _ev(run, "restore", 137.0, 1, step=4, from_mesh="data=8", to_mesh="data=4")
    _ev(run, "compiled", 146.0, 1, seconds=8.0)  # restore 134-137, compile 137-146
    _steps(run, 1, range(5, 9), t_first=148.0)  # steps 5..8 end at 148..151
    append_line(os.path.join(run, "metrics.jsonl"),
                {"step": 8, "eval_loss": 4.4, "time": 151.5, "incarnation": 1})  # fmt: skip
    _ev(run, "done", 152.0, 1, step=8)


def test_goodput_accounting_with_hang_shrink_and_restore(tmp_path):
    run = str(tmp_path)
    _launched_run(run)
    a = report.analyze(run)
    assert [i.index for i in a.incarnations] == [0, 1]
    t = a.totals
    assert t["startup"] == pytest.approx(5.0) and t["restore"] == pytest.approx(3.0)
    assert t["compile"] == pytest.approx(10.0 + 9.0)
    assert t["productive"] == pytest.approx(8.0)  # steps 1..4 (inc 0) + 5..8 (inc 1)
    assert t["recomputed"] == pytest.approx(1.0)  # step 5 of incarnation 0
    assert t["checkpoint"] == pytest.approx(0.5)
    assert t["detection"] == pytest.approx(14.0)  # hang noticed at 130
    assert t["restart"] == pytest.approx(4.0)  # 130 -> 134
    assert a.wall_s == pytest.approx(57.0)
    assert sum(t.values()) == pytest.approx(a.wall_s)
    assert a.goodput == pytest.approx(8.0 / 57.0)
    (r,) = a.restarts
    assert r.failed_at_step == 6 and r.resumed_from == 4 and r.restored
    assert r.shrink["to_nproc"] == 1
    assert r.recovery_s == pytest.approx(148.0 - 116.0)  # first new line - fault_injected
    assert a.status == "completed"
    (led,) = a.ledger  # the supervisor's phases of the same incident
    assert (led["detect_s"], led["stop_s"], led["restart_s"], led["init_s"]) == (14, 1, 1, 2)
    assert (led["restore_s"], led["compile_s"], led["first_step_s"]) == (3.0, 9.0, 2.0)
    assert led["recovery_s"] == pytest.approx(r.recovery_s)
    # the accounting splits the wall-clock at the same boundaries as the phases
    assert t["restore"] == led["restore_s"] and t["detection"] == led["detect_s"]
    assert t["restart"] == led["stop_s"] + led["restart_s"] + led["init_s"]

    md = open(report.write_report(run)).read()
    assert "shrink" in md and "2→1" in md and "hang@6:process=1" in md
    assert "restore" in md and "step 4 (incarnation 1)" in md
    assert "| productive steps | 8.0 | 14.0% |" in md
    assert "Recovery phases" in md
    for name in ("loss.png", "step_time.png", "goodput.png"):
        assert name in md
        assert open(os.path.join(run, "report", name), "rb").read(8) == PNG


def test_report_of_a_run_without_restarts(tmp_path):
    run = str(tmp_path)
    _ev(run, "start", 0.0, 0, nproc=1, mesh="data=8")
    _ev(run, "compiled", 5.0, 0, seconds=4.0)
    _steps(run, 0, range(1, 11), t_first=6.0)
    _ev(run, "done", 16.0, 0, step=10)
    a = report.analyze(run)
    assert a.restarts == [] and a.totals["recomputed"] == 0.0
    assert a.totals["productive"] == pytest.approx(10.0) and a.wall_s == pytest.approx(16.0)
    md = open(report.write_report(run)).read()
    assert "No restarts" in md and "| status | completed |" in md


def test_a_finished_run_continued_with_more_steps_is_an_extension_not_a_restart(tmp_path):
    """A run finished at step 4, then run again with --steps 8: listed as an extension."""
    run = str(tmp_path)
    _ev(run, "start", 0.0, 0, nproc=1, mesh="data=8")
    _steps(run, 0, range(1, 5), t_first=2.0)
    _ev(run, "done", 6.0, 0, step=4, complete=True)
    _ev(run, "start", 50.0, 1, nproc=1, mesh="data=8")
    _ev(run, "restore", 51.0, 1, step=4, tier="persistent")
    _steps(run, 1, range(5, 9), t_first=53.0)
    _ev(run, "done", 57.0, 1, step=8, complete=True)
    a = report.analyze(run)
    assert a.restarts == [] and [r.resumed for r in a.extensions] == [1]
    assert a.extensions[0].failed_at_step is None
    md = report.markdown(a, {})  # the text only: no plots drawn
    assert "No restarts" in md and "| incarnations / restarts | 2 / 0 |" in md, md
    assert "| extensions (a finished run continued) | from step 4 (incarnation 1) |" in md, md


def test_report_of_a_run_in_progress(tmp_path):
    run = str(tmp_path)
    _ev(run, "start", 0.0, 0, nproc=1, mesh="data=8")
    _ev(run, "compiled", 5.0, 0, seconds=4.0)
    _steps(run, 0, range(1, 4), t_first=6.0)
    _ev(run, "start", 20.0, 1, nproc=1, mesh="data=8")  # a rerun, still compiling
    a = report.analyze(run)
    assert "in progress" in a.status
    assert a.restarts[0].recovery_s is None and a.restarts[0].description.startswith("rerun")
    md = open(report.write_report(run)).read()
    assert "in progress" in md
    assert os.path.getsize(os.path.join(run, "report", "goodput.png")) > 0


def test_a_second_launch_after_giving_up_counts_no_idle_time(tmp_path):
    """Two `jaxpar launch` jobs in one run directory: the first gave up, the second resumed."""
    run = str(tmp_path)
    _ev(run, "launch", 0.0, 0, nproc=1)
    _ev(run, "start", 1.0, 0, nproc=1, mesh="data=8")
    _ev(run, "compiled", 2.0, 0, seconds=1.0)
    _steps(run, 0, range(1, 3), t_first=3.0)  # steps 1, 2 end at 3, 4
    _ev(run, "fault_injected", 4.5, 0, kind="kill", spec="kill@3", process=0, step=3)
    _ev(run, "failure", 5.0, 0, cause="signal", process=0, code=-9, step=3)
    _ev(run, "gave_up", 5.2, 0, reason="restart budget spent")
    _ev(run, "ended", 5.5, 0, status="gave_up", wall_s=5.5)
    _ev(run, "launch", 100.0, 1, nproc=1)  # an hour later: idle, counted nowhere
    _ev(run, "start", 102.0, 1, nproc=1, mesh="data=8")
    _ev(run, "restore", 103.0, 1, step=2)
    _ev(run, "compiled", 104.0, 1, seconds=1.5)
    _steps(run, 1, range(3, 5), t_first=105.0)  # steps 3, 4 end at 105, 106
    _ev(run, "done", 107.0, 1, step=4)
    _ev(run, "ended", 108.0, 1, status="completed", wall_s=8.0)
    a = report.analyze(run)
    t = a.totals
    assert a.status == "completed"
    assert t["startup"] == pytest.approx(1.0 + 2.0) and t["detection"] == pytest.approx(0.5)
    assert t["restart"] == 0.0 and t["restore"] == pytest.approx(1.0)
    assert t["productive"] == pytest.approx(4.0)
    assert a.wall_s == pytest.approx(5.5 + 8.0) and sum(t.values()) == pytest.approx(a.wall_s)
    (inc,) = a.timeline.incidents  # one failure, resumed by the second job
    assert inc.cause == "signal" and inc.description.startswith("injected kill@3")
    assert inc.phases["detect_s"] == pytest.approx(0.5) and inc.phases["stop_s"] is None
    assert inc.resumed == 1 and inc.recovery_s == pytest.approx(105.0 - 4.5)


def test_report_rejects_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(ValueError, match="events.jsonl or metrics.jsonl"):
        report.analyze(str(tmp_path))


# ---- a real launched run with a kill and a restart (slow) ---------------------------------------


def _printed(text: str, pattern: str) -> str:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text[-3000:]}"
    return m.group(1)


@pytest.mark.slow
def test_launch_summary_and_report_agree_on_a_real_run_with_a_restart(tmp_path):
    """One supervised run killed at step 8: what `jaxpar launch` prints, summary.json and report.md
    give the same status, goodput, wall-clock, recovery phases and MTTR (one timeline builder)."""
    run = str(tmp_path / "run")
    # synchronous saves: step 5 is committed before the kill at step 8, so the restart restores it
    # (the local snapshot tier is off here: it would restore step 7; tests/recovery covers it)
    train = [sys.executable, "-m", "train", "--recipe", "digits_mlp", "--steps", "12",
             "--no-progress", "--set", "ckpt.every=5", "--set", "ckpt.use_async=false",
             "--set", "ckpt.local_every=0",
             "--set", "train.eval_every=6", "--set", "log.tensorboard=true"]  # fmt: skip
    launch = [sys.executable, "-m", "jaxpar.cli", "launch", "--run-dir", run, "--nproc", "1",
              "--devices-per-proc", "2", "--fault", "kill@8", "--", *train]  # fmt: skip
    out = helpers.ok(helpers.run(launch, env=helpers.cpu_env(devices=None), merge=True)).stdout

    rep = helpers.run([sys.executable, "-m", "jaxpar.cli", "report", run], timeout=300, merge=True)
    assert rep.returncode == 0, rep.stdout[-4000:]
    md_path = os.path.join(run, "report", "report.md")
    assert rep.stdout.strip().endswith(md_path)
    md = open(md_path).read()
    assert "restart" in md and "injected kill@8" in md and "step 5 (incarnation 1)" in md

    with open(os.path.join(run, "summary.json")) as f:
        s = json.load(f)
    (inc,) = s["incidents"]
    assert s["status"] == "completed" and s["restarts"] == 1 and inc["cause"] == "signal"
    printed = f"{s['status']}: 12 steps"
    assert printed in out and "| status | completed |" in md
    goodput = f"{s['goodput']:.1%}"
    assert _printed(out, r"goodput ([0-9.]+%)") == goodput
    assert (
        _printed(md, r"\| goodput \(productive step time ÷ wall-clock\) \| ([0-9.]+%) \|")
        == goodput
    )
    wall = f"{s['wall_s']:.1f}"
    assert _printed(out, r"wall ([0-9.]+)s") == wall
    assert _printed(md, r"\| wall-clock [^|]* \| ([0-9.]+) s \|") == wall
    mttr = f"{s['mttr_s']:.1f}"
    assert s["mttr_s"] == inc["recovery_s"] > inc["restore_s"] > 0
    assert _printed(out, r"mttr ([0-9.]+)s") == mttr
    assert _printed(md, r"\| recovery time, mean \(MTTR\) \| ([0-9.]+) s over 1 \|") == mttr
    phases = [f"{inc[p]:.1f}" for p in (*runlog.PHASES, "recovery_s")]
    assert _printed(out, r"restore ([0-9.]+)s") == phases[4]
    row = _printed(md, r"\n\| signal \| 0 \| ([^\n]*) \|\n")
    assert row.split(" | ")[: len(phases)] == phases
    assert _printed(md, r"\| restore \| ([0-9.]+) \|") == phases[4]  # time accounting

    lines = read_jsonl(os.path.join(run, "metrics.jsonl"))
    per_step = last_per_step(lines)
    assert list(per_step) == list(range(1, 13))
    assert all("mem_gb" in v for v in per_step.values())  # None on CPU
    # TensorBoard: both incarnations' files parse; the last value per step matches metrics.jsonl
    tb = read_tensorboard(os.path.join(run, "tensorboard"))
    assert len(os.listdir(os.path.join(run, "tensorboard"))) == 2
    steps = [s for s, _ in tb["train/loss"]]
    cut = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])  # incarnation 1
    # the SIGKILL may take incarnation 0's newest line (step 7) with it
    assert steps[:cut] in (list(range(1, 7)), list(range(1, 8)))
    assert steps[cut:] == list(range(6, 13))
    last = dict(tb["train/loss"])
    assert all(last[s] == pytest.approx(v["loss"], rel=1e-6) for s, v in per_step.items())
    assert {"train/lr", "train/grad_norm", "perf/step_time_s", "perf/samples_per_s"} <= set(tb)
    assert [s for s, _ in tb["eval/loss"]][-2:] == [6, 12]
    assert "perf/mfu" not in tb  # unknown peak FLOP/s on CPU: null, not logged
