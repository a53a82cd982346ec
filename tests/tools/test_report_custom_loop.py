"""The time accounting of a run whose loop writes only some of the records `jaxpar train` writes
(a training loop of one's own): the wall-clock is launch -> end, whatever is missing."""

from __future__ import annotations

import pytest

from jaxpar.tools import report
from tests.tools.test_report import _ev, _steps


def _loop_without_compiled(run: str) -> None:
    """A launched loop killed once that records `start` and metrics but no `compiled` event."""
    _ev(run, "launch", 95.0, 0, nproc=2)
    _ev(run, "group_started", 95.5, 0, nproc=2)
    _ev(run, "start", 100.0, 0, nproc=2)
    _steps(run, 0, range(1, 11), t_first=105.0)  # steps 1..10 end at 105..114
    _ev(run, "failure", 115.0, 0, cause="signal", process=1, code=-9)
    _ev(run, "survivors_stopped", 116.0, 0, seconds=1.0)
    _ev(run, "restart", 116.0, 0, attempt=1, nproc=2)
    _ev(run, "group_started", 116.5, 1, nproc=2)
    _ev(run, "start", 120.0, 1, nproc=2)
    _steps(run, 1, range(1, 21), t_first=125.0)  # no checkpoint: steps 1..20 end at 125..144
    _ev(run, "done", 145.0, 1, step=20)
    _ev(run, "ended", 146.0, 1, status="completed")


def test_a_loop_without_a_compiled_event_is_not_counted_twice(tmp_path):
    run = str(tmp_path)
    _loop_without_compiled(run)
    a = report.analyze(run)
    assert a.wall_s == pytest.approx(146.0 - 95.0)  # not the incarnations' spans on top of it
    assert sum(a.totals.values()) == pytest.approx(a.wall_s)
    # the compile ends where the first step begins (a step's line is written at its end)
    assert a.totals["compile"] == pytest.approx((104.0 - 100.0) + (124.0 - 120.0))
    assert a.totals["productive"] == pytest.approx(20.0)
    assert a.goodput == pytest.approx(20.0 / 51.0)
