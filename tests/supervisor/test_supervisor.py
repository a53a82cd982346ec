"""`jaxpar launch` under real failures: 2 worker processes x 4 CPU devices of (a smaller) gpt_tiny,
real jax.distributed over gloo on 127.0.0.1, real signals. Several failures share one run where
each needs only its own incarnation (a fault spec fires once per run directory), so the suite
starts fewer jobs. Every run is compared with one uninterrupted supervised run: losses identical
(==) per step (last metrics line per step), or within fp32 tolerance after an elastic shrink
(more microbatches change the summation order).

    python -m pytest tests/supervisor/test_supervisor.py -m slow
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.launch_util import Launch, losses, train_cmd  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, EVERY = 10, 4
# two processes: each failure is one process's, its peer the survivor (a job of 4 workers under
# two agents: tests/supervisor/test_multinode.py); every process start counts, 5 incarnations here
NPROC = ["--nproc", "2", "--devices-per-proc", "4"]
HANG_TIMEOUT = 15.0
WAIT = 600  # seconds a whole supervised run may take on a loaded 2-core machine


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The uninterrupted run; process 1 sleeps 1 s per step from step 3 (a straggler, which
    changes no number)."""
    run = Launch(tmp_path_factory.mktemp("sup") / "ref", [*NPROC, "--fault",
                 "slow@3:process=1:seconds=1.0"], train_cmd(STEPS, EVERY))  # fmt: skip
    try:
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    ref = losses(run.run_dir)
    assert sorted(ref) == list(range(1, STEPS + 1))
    return run.run_dir, ref


def _launch(tmp_path, *args, steps=STEPS, every=EVERY) -> Launch:
    return Launch(tmp_path / "run", [*NPROC, *args], train_cmd(steps, every))


def test_straggler_reported_without_restart(reference):
    run_dir, _ = reference
    run = Launch.__new__(Launch)
    run.run_dir = run_dir
    (s,) = run.events("straggler")
    # the lag when first reported depends on timing; the factor is the detection criterion
    assert s["process"] == 1 and s["lag_s"] > 0
    assert s["factor"] is None or s["factor"] >= 2.0  # None: the others took no time (infinite)
    assert run.events("restart") == [] and run.summary()["restarts"] == 0


def test_kill_hang_sigterm_nan_in_one_run_each_restarts_exact(tmp_path, reference):
    """Four failures of one supervised run, one per incarnation (a spec fires once per run
    directory): SIGKILL of process 1 (counted restart), a hang of process 1 (detected at the
    hang timeout, stacks dumped, counted), a preemption notice to process 1 (coordinated save,
    exit 42, restart not counted), NaN (rolled back, counted). Losses equal the reference's."""
    faults = ["kill@3:process=1", "hang@5:process=1", "sigterm@6:process=1", "nan@8"]
    args = ["--hang-timeout", str(HANG_TIMEOUT), "--max-restarts", "5"]
    run = _launch(tmp_path, *args, *[a for f in faults for a in ("--fault", f)])
    try:
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    fired = run.events("fault_injected")
    assert [f["kind"] for f in fired] == ["kill", "hang", "sigterm", "nan"]
    kill, hang, nan = run.events("failure")
    # SIGKILL: the signal and the process are named; the survivor left on its own (collective
    # error -> exit 43) or was stopped; none remain
    assert (kill["cause"], kill["process"], kill["code"]) == ("signal", 1, -9)
    assert run.events("survivors_stopped")[0]["killed"] <= 1
    # hang: the clock runs from the hung process's last heartbeat
    assert (hang["cause"], hang["process"], hang["step"]) == ("hang", 1, 5)
    assert "injected fault hang@5:process=1" in run.output()  # the console says it was injected
    latency = hang["time"] - fired[1]["time"]
    assert latency < HANG_TIMEOUT + 10, latency
    (dump,) = run.events("stacks_dumped")
    assert len(dump["files"]) == 2
    hung = (run.run_dir / next(p for p in dump["files"] if p.endswith("proc1.txt"))).read_text()
    assert "in before_step" in hung and "faults.py" in hung  # the frame that hangs
    # preemption: not a failure, the workers' coordinated save, an uncounted restart
    (p,) = run.events("preemption")
    assert p["code"] == 42 and run.events("preempted")
    # NaN: rolled back to a checkpoint before the poisoned step
    assert (nan["cause"], nan["step"]) == ("nan", 8)
    assert run.events("restore")[-1]["step"] < 8
    assert [r["counted"] for r in run.events("restart")] == [True, True, False, True]
    s = run.summary()
    assert s["status"] == "completed" and s["restarts"] == 4 and s["counted_restarts"] == 3
    assert s["preemptions"] == 1 and s["lost_steps"] >= 0
    assert all(i["recovery_s"] > 0 for i in s["incidents"]) and s["mttr_s"] > 0
    assert losses(run.run_dir) == reference[1]


def test_restart_budget_exhausted_keeps_checkpoints(tmp_path):
    # the reference's layout: its programs, compiled once (nothing is compared with its losses)
    # killed at 6: step 2's save has committed (the save of step 4 waited for it), step 4's may not
    args = ["--max-restarts", "1", "--fault", "kill@6:process=1:repeat"]
    run = Launch(tmp_path / "run", [*NPROC, *args], train_cmd(STEPS, 2))
    try:
        rc = run.wait(WAIT)
    finally:
        run.close()
    assert rc != 0
    assert "restart budget spent" in run.output()
    (g,) = run.events("gave_up")
    assert "restart budget" in g["reason"]
    assert len(run.events("failure")) == 2
    saved = {e["step"] for e in run.events("save_end")}
    ckpts = run.run_dir / "checkpoints"
    committed = {int(d) for d in os.listdir(ckpts) if d.isdigit()}
    # nothing half-written kept, nothing committed removed (`save_end` is the end of a save's
    # blocking part: an asynchronous save commits later, and one killed before is not kept)
    assert 2 in committed and committed <= saved, (committed, saved)
    assert run.summary()["status"] == "gave_up"


def test_permanent_loss_shrinks_2_to_1(tmp_path, reference):
    # step 4's checkpoint saved synchronously: committed before the kill at step 6 whatever the
    # machine's load (an asynchronous commit still in flight is rightly not restored)
    run = Launch(tmp_path / "run", [*NPROC, "--min-nproc", "1", "--fault",
                 "kill@6:process=1:permanent"],
                 train_cmd(STEPS, EVERY, "--set", "ckpt.use_async=false"))  # fmt: skip
    try:
        assert run.wait(WAIT) == 0, run.output()
    finally:
        run.close()
    (sh,) = run.events("shrink")
    assert (sh["from_nproc"], sh["to_nproc"], sh["lost"]) == (2, 1, [1])
    assert sh["mesh"].startswith("data=4") and sh["microbatches"] == 2
    starts = run.events("start")
    assert [s["nproc"] for s in starts] == [2, 1]
    restore = run.events("restore")[-1]
    assert (restore["from_nproc"], restore["to_nproc"]) == (2, 1)
    got, ref = losses(run.run_dir), reference[1]
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-5), step
