"""Run-directory writers, last-line-per-step, summary, MFU table, progress lines, TensorBoard.

Fast: no mesh, no compilation.
"""

from __future__ import annotations

import io
import json
import os

import pytest

from jaxpar.rundir import writer
from jaxpar.rundir.runlog import append_line, last_per_step, read_jsonl, write_json
from jaxpar.rundir.writer import Progress, RunDir, TensorBoardWriter, read_tensorboard, summarize


def _line(step, loss, inc=0, t=None, dt=0.5):
    return {"step": step, "loss": loss, "step_time_s": dt, "tokens_per_s": 100.0 * step,
            "mfu": None, "time": 1000.0 + step if t is None else t, "incarnation": inc}  # fmt: skip


def test_append_and_read_jsonl_skip_torn_last_line(tmp_path):
    path = str(tmp_path / "m.jsonl")
    assert read_jsonl(path) == []
    append_line(path, {"a": 1, "x": float("nan")})
    append_line(path, {"a": 2})
    with open(path, "a") as f:
        f.write('{"a": 3, "b"')  # a writer killed mid-line
    got = read_jsonl(path)
    assert [g["a"] for g in got] == [1, 2]
    assert got[0]["x"] is None  # strict JSON: a non-finite value is written as null


def test_write_json_is_atomic_and_round_trips(tmp_path):
    path = str(tmp_path / "s.json")
    import numpy as np

    write_json(path, {"steps": np.int64(3), "loss": np.float32(1.5)})
    write_json(path, {"steps": 4})
    assert json.load(open(path)) == {"steps": 4}
    assert os.listdir(tmp_path) == ["s.json"]  # no temp files left behind


def test_rundir_incarnation_events_and_metrics(tmp_path):
    run = RunDir(str(tmp_path))
    assert run.incarnation == 0
    run.event("start", nproc=1, mesh="data=8")
    run.metrics({"step": 1, "loss": 2.0})
    run.write_incarnation()
    (ev,) = run.events()
    assert ev["event"] == "start" and ev["incarnation"] == 0 and ev["time"] > 0
    assert read_jsonl(run.file("metrics.jsonl")) == [{"step": 1, "loss": 2.0, "incarnation": 0}]
    assert open(run.file("incarnation")).read().strip() == "0"

    again = RunDir(str(tmp_path))  # a rerun counts the earlier start
    assert again.incarnation == 1
    other = RunDir(str(tmp_path), process_index=1)
    other.event("ignored")
    other.metrics({"step": 1, "loss": 9.0})
    other.event("fault_injected", all_processes=True, kind="kill")
    evs = other.events()
    assert [e["event"] for e in evs] == ["start", "fault_injected"]
    assert evs[-1]["process"] == 1
    assert len(read_jsonl(run.file("metrics.jsonl"))) == 1


def test_last_per_step_takes_the_rerun_line():
    lines = [_line(1, 5.0), _line(2, 4.0), _line(3, 3.9), {"step": 2, "eval_loss": 4.2}]
    lines += [_line(2, 4.0, inc=1), _line(3, 3.8, inc=1)]
    got = last_per_step(lines)
    assert list(got) == [1, 2, 3]
    assert got[3]["loss"] == 3.8 and got[3]["incarnation"] == 1
    assert list(last_per_step(lines, "eval_loss")) == [2]


def test_summarize_counts_lost_steps(tmp_path):
    run = RunDir(str(tmp_path))
    for line in [_line(1, 5.0), _line(2, 4.0), _line(3, 3.9)]:
        append_line(run.file("metrics.jsonl"), line)
    append_line(run.file("metrics.jsonl"), {"step": 2, "eval_loss": 4.5, "time": 1.0})
    for line in [_line(2, 4.0, inc=1), _line(3, 3.7, inc=1), _line(4, 3.5, inc=1)]:
        append_line(run.file("metrics.jsonl"), line)
    s = summarize(run, wall_s=10.0, restarts=1)
    assert s["steps"] == 4 and s["final_loss"] == 3.5 and s["restarts"] == 1
    assert s["lost_steps"] == 2
    assert s["goodput"] == pytest.approx(4 * 0.5 / 10.0)
    assert s["median_tokens_per_s"] == pytest.approx(250.0)
    assert summarize(RunDir(str(tmp_path / "empty")), wall_s=1.0)["steps"] == 0


def test_the_ended_event_carries_the_newest_incarnation_that_ran(tmp_path):
    """A killed-and-restarted job ran incarnations 0 and 1: `ended` is of incarnation 1 (not 2,
    the number of starts)."""
    from jaxpar.rundir import goodput

    for inc in (0, 1):
        RunDir(str(tmp_path), incarnation=inc).event("start", nproc=1, mesh="data=8")
        append_line(str(tmp_path / "metrics.jsonl"), _line(1 + inc, 4.0, inc=inc))
    goodput.summarize_run(str(tmp_path), wall_s=3.0, restarts=1, status="completed")
    ended = [e for e in read_jsonl(str(tmp_path / "events.jsonl")) if e["event"] == "ended"]
    assert [e["incarnation"] for e in ended] == [1]


@pytest.mark.parametrize(
    "kind, peak",
    [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12), ("TPU v4", 275e12),
     ("TPU v5 lite", 197e12), ("TPU v5p", 459e12), ("TPU v6 lite", 918e12), ("cpu", None)],
)  # fmt: skip
def test_peak_flops_table(kind, peak):
    assert writer.peak_flops(kind) == peak


def test_mfu():
    assert writer.mfu(1e12, 0.5, devices=4, peak=1e12) == pytest.approx(0.5)
    assert writer.mfu(1e12, 0.5, devices=4, peak=None) is None
    assert writer.mfu(None, 0.5, devices=4, peak=1e12) is None


def test_progress_plain_lines_when_not_a_terminal():
    out = io.StringIO()  # not a tty: periodic plain lines, no carriage returns
    bar = Progress(total=10, start=0, stream=out)
    for step in range(1, 11):
        bar.update(step, 5.0 - step * 0.1, 1234.0, "tok")
    bar.message("step 10: eval_loss 3.9")
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("[") and "step 1/10" in lines[0] and "1,234 tok/s" in lines[0]
    assert "eta" in lines[0]
    assert "step 10/10" in lines[-2] and "loss 4.0000" in lines[-2]
    assert lines[-1] == "step 10: eval_loss 3.9"
    assert len(lines) < 10  # periodic, not one per step

    quiet = io.StringIO()
    off = Progress(total=10, stream=quiet, enabled=False)
    off.update(1, 1.0, None, "tok")
    off.message("x")
    assert quiet.getvalue() == ""


def test_tensorboard_writer_round_trip(tmp_path):
    run = RunDir(str(tmp_path))
    tb = TensorBoardWriter(run)
    tb.write({**_line(1, 5.0), "lr": 1e-3, "grad_norm": 2.0, "mem_gb": None})
    tb.write({**_line(2, 4.5), "mfu": 0.25})
    tb.write({"step": 2, "eval_loss": 4.7, "time": 1003.0})
    tb.close()
    got = read_tensorboard(run.file("tensorboard"))
    assert got["train/loss"] == [(1, 5.0), (2, 4.5)]
    assert got["eval/loss"] == [(2, pytest.approx(4.7))]
    assert got["perf/mfu"] == [(2, 0.25)]  # None values are skipped
    assert got["perf/tokens_per_s"] == [(1, 100.0), (2, 200.0)]
    assert {"train/lr", "train/grad_norm", "perf/step_time_s"} <= set(got)
    assert "perf/mem_gb" not in got

    other = RunDir(str(tmp_path / "p1"), process_index=1)
    TensorBoardWriter(other).close()  # only process 0 writes
    assert not os.path.exists(other.file("tensorboard"))


def test_read_tensorboard_rejects_corruption(tmp_path):
    run = RunDir(str(tmp_path))
    tb = TensorBoardWriter(run)
    tb.write(_line(1, 5.0))
    tb.close()
    (name,) = os.listdir(run.file("tensorboard"))
    path = os.path.join(run.file("tensorboard"), name)
    blob = bytearray(open(path, "rb").read())
    blob[-6] ^= 0xFF  # inside the last record's data
    open(path, "wb").write(bytes(blob))
    with pytest.raises(ValueError, match="corrupt"):
        read_tensorboard(run.file("tensorboard"))


# ---- the run-log schema and the design doc --------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_event_names_are_unique_and_documented():
    from jaxpar.rundir.runlog import SupervisorEvent, WorkerEvent

    assert not WorkerEvent.ALL & SupervisorEvent.ALL  # one writer per event name
    for cls in (WorkerEvent, SupervisorEvent):  # ALL holds every constant of the class
        names = {v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)}
        assert names == cls.ALL
    design = open(os.path.join(REPO, "docs", "design.md")).read()
    missing = [e for e in WorkerEvent.ALL | SupervisorEvent.ALL if f"`{e}`" not in design]
    assert not missing, f"docs/design.md does not describe {missing}"


def test_design_doc_references_resolve():
    """Every repository path docs/design.md names exists (no references outside the repo)."""
    import glob
    import re

    design = open(os.path.join(REPO, "docs", "design.md")).read()
    paths = set(re.findall(r"`((?:jaxpar|tests|docs|train|models|meshes|deploy)/[^`\s]*)`", design))
    assert len(paths) > 10
    missing = [p for p in sorted(paths) if not glob.glob(os.path.join(REPO, p.rstrip("/")))]
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"
    assert "DESIGN.md" not in design
