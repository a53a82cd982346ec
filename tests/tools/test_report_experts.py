"""`jaxpar report` on a mixture-of-experts run: the expert-load plot and the collapse verdict."""

from __future__ import annotations

import json
import os

from jaxpar.rundir.runlog import append_line
from jaxpar.tools import experts_report, report

PNG = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, loads, top_k=2):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "config.json", "w") as f:
        json.dump({"name": "gpt_moe", "model": {"top_k": top_k}}, f)
    for step, load in enumerate(loads, start=1):
        line = {"step": step, "loss": 5.0 - 0.1 * step, "step_time_s": 1.0, "tokens_per_s": 100.0,
                "time": 100.0 + step, "incarnation": 0, "moe_aux_loss": 1.2,
                "moe_dropped_frac": 0.05, "moe_expert_load": load}  # fmt: skip
        append_line(os.path.join(run, "metrics.jsonl"), line)
    return str(run)


def test_balanced_experts_are_plotted_and_not_called_collapsed(tmp_path):
    even = [0.25, 0.25, 0.25, 0.25]  # top-2 of 4: every expert takes 50% of the tokens
    run = _run(tmp_path, [even, [0.4, 0.2, 0.2, 0.2], even])
    text = open(report.write_report(run)).read()
    assert "## Experts" in text and "4 experts, top-2 routing" in text
    # every expert's load in one unit, the share of the tokens (the old text gave the even load
    # in assignments, 25%, beside the busiest expert's tokens, 50%)
    assert "an even load has each expert chosen by 50.0% of the tokens. At step 3 the busiest " \
        "expert was chosen by 50.0% of the tokens and the idlest by 50.0%." in text  # fmt: skip
    assert "No collapse" in text and "the busiest: 80% of them at step 2" in text
    assert "dropped over capacity: 5.00% of the assignments (median" in text
    assert "![Expert load](expert_load.png)" in text
    with open(os.path.join(run, "report", "expert_load.png"), "rb") as f:
        assert f.read(8) == PNG


def test_a_collapse_is_reported_with_its_first_step(tmp_path):
    even, taken = [0.25] * 4, [0.1, 0.1, 0.7, 0.1]
    # top-1: expert 2 chosen by 70% of the tokens from step 3 on; malformed lines are skipped
    run = _run(tmp_path, [even, even, taken, "garbage", [0.5, 0.5], taken], top_k=1)
    a = report.analyze(run)
    text = "\n".join(experts_report.section(a.per_step, a.config))
    assert "**The experts collapsed**: from step 3 expert 2 was chosen by 70%" in text
    assert "at 2 of 4 logged steps; still at step 6" in text


def test_a_run_without_experts_has_no_experts_section(tmp_path):
    run = _run(tmp_path, [None, None])
    a = report.analyze(run)
    assert "## Experts" not in report.markdown(a, {})
    assert not experts_report.plot(a.per_step, str(tmp_path / "x.png"), None)
    assert experts_report.top_k({"model": {"top_k": True}}) == 1
