"""Bad values for `jaxpar sample`, `train`, `launch` and `report`: one line naming the fix, exit 2,
nothing written. Each case runs `jaxpar.cli.main` in this process and stops before any training."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from jaxpar import cli
from jaxpar.config import apply_overrides, resolve_recipe, validate
from jaxpar.rundir import runlog
from tests.support.hardening_util import call, snapshot


def one_line_refusal(capsys, argv: list[str]) -> str:
    code = call(cli.main, argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{argv}: exit {code}\n{err[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in err, f"{argv}:\n{err[-2000:]}"
    return lines[0]


# ---- jaxpar sample: checked while parsing, before the run is loaded ---------------------------


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--top-k", "-1", "--top-k: must be >= 0"),
        ("--temperature", "nan", "--temperature: must be a finite number >= 0"),
        ("--temperature", "inf", "--temperature: must be a finite number >= 0"),
        ("--temperature", "-0.5", "--temperature: must be a finite number >= 0"),
        ("--max-new-tokens", "0", "--max-new-tokens: must be >= 1"),
        ("--seed", str(2**64), "--seed: must be in [0, 9,223,372,036,854,775,807]"),
    ],
)
def test_sample_refuses_bad_sampling_values(capsys, tmp_path, option, value, message):
    line = one_line_refusal(capsys, ["sample", str(tmp_path), "--prompt", "x", option, value])
    assert message in line


def test_sample_refuses_a_prompt_that_is_not_utf8(capsys, tmp_path):
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    line = one_line_refusal(capsys, ["sample", str(tmp_path), "--prompt", prompt])
    assert "--prompt: not valid UTF-8 text" in line


# ---- jaxpar train: checked before the run directory is written --------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", str(10**20)], "--steps: must be in [1, 2,147,483,647]"),
        (
            ["--set", "train.steps=100000000000000000000"],
            "train.steps=100000000000000000000 is out",
        ),
        (["--set", "ckpt.local_dir=/proc/x"], "ckpt.local_dir=/proc/x is under /proc"),
        (["--set", f"train.seed={2**64}"], f"train.seed={2**64} is out of range"),
        (["--set", "run.compile_cache_dir=/sys/x"], "run.compile_cache_dir=/sys/x is under /sys"),
        (["--set", "data.seq_len=65"], "data.seq_len=65 but model.seq_len=64"),
        (["--set", "data.seq_len=100000"], "data.seq_len=100000 but model.seq_len=64"),
    ],
)
def test_train_refuses_before_writing(capsys, tmp_path, argv, message):
    for run_dir in (tmp_path / "fresh", tmp_path / "used"):
        if run_dir.name == "used":
            run_dir.mkdir()
            (run_dir / "config.json").write_text("{}\n")
        before = snapshot(run_dir)
        line = one_line_refusal(capsys, ["train", *argv, "--run-dir", str(run_dir)])
        assert message in line
        assert snapshot(run_dir) == before


def test_a_local_dir_below_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    argv = ["--set", f"ckpt.local_dir={tmp_path / 'file' / 'x'}"]
    line = one_line_refusal(capsys, ["train", *argv, "--run-dir", str(tmp_path / "run")])
    assert "is a file, not a folder" in line and not (tmp_path / "run").exists()


def test_seq_len_is_set_for_data_and_model_together():
    """--set data.seq_len=N used to be recorded in config.json and ignored (the model's seq_len
    made the windows): now it is refused unless model.seq_len says the same."""
    cfg = resolve_recipe("gpt_tiny")
    for key in ("data.seq_len", "model.seq_len"):
        with pytest.raises(ValueError, match="set both .*data.seq_len=.* --set model.seq_len="):
            validate(apply_overrides(cfg, [f"{key}=32"]))
    both = validate(apply_overrides(cfg, ["data.seq_len=48", "model.seq_len=48"]))
    assert (both.data.seq_len, both.model.seq_len) == (48, 48)


# ---- jaxpar launch ------------------------------------------------------------------------------


def _launch(tmp_path, *options: str) -> list[str]:
    return ["launch", "--nproc", "1", "--run-dir", str(tmp_path / "run"), *options, "--",
            sys.executable, "-c", "pass"]  # fmt: skip


@pytest.mark.parametrize(
    "options, message",
    [
        (["--nnodes", "0"], "--nnodes: must be >= 1, got 0"),
        (["--fault", "kill@2:process=99"], "process=99 but the job has 1 process(es)"),
        (["--fault", "losthost@2:node=3"], "node=3 but the job has 1 node(s)"),
        (["--token-file", "/proc/self/environ"], "--token-file /proc/self/environ is under /proc"),
    ],
)
def test_launch_refuses_before_starting(capsys, tmp_path, options, message):
    line = one_line_refusal(capsys, _launch(tmp_path, *options))
    assert message in line
    assert not (tmp_path / "run").exists()


def test_launch_refuses_a_token_file_readable_by_others(capsys, tmp_path):
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4 + "\n")
    token.chmod(0o644)
    line = one_line_refusal(capsys, _launch(tmp_path, "--token-file", str(token)))
    assert f"chmod 600 {token}" in line


# ---- jaxpar report ------------------------------------------------------------------------------


def test_report_skips_a_line_with_a_non_finite_time_and_says_so(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    t0 = 1_700_000_000.0
    events = [{"event": "start", "time": t0, "incarnation": 0, "step": 0}]
    lines = [{"step": s, "loss": 5.0 - s / 10, "time": t0 + s, "step_time_s": 1.0,
              "incarnation": 0} for s in range(1, 6)]  # fmt: skip
    (run / runlog.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))
    with open(run / runlog.METRICS, "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines[:3]))
        f.write('{"step": 4, "loss": 4.6, "time": 1e999, "step_time_s": 1.0, "incarnation": 0}\n')
        f.write("".join(json.dumps(line) + "\n" for line in lines[3:]))
    assert call(cli.main, ["report", str(run)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == os.path.join(str(run), "report", "report.md")
    assert "skipped 1 line(s) of metrics.jsonl" in err and "Traceback" not in err
    assert os.path.getsize(run / "report" / "report.md") > 0
    shutil.rmtree(run / "report")
