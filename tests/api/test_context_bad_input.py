"""Bad input for context parallelism on the command line: one line naming the fix, exit 2,
nothing written (`jaxpar train` stops in its checks, before any training)."""

from __future__ import annotations

import os

import pytest

from tests.api.test_bad_input_cli import one_line_refusal


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipe", "gpt_tiny", "--mesh", "dp2_cp4", "--set", "model.attention=flash"],
         "model.attention='flash': use one of ['ring', 'allgather', 'alltoall']"),
        # These two build the program (tests/engine/test_attention.py has them in the fast tier).
        pytest.param(
            ["--recipe", "gpt_tiny", "--mesh", "dp2_cp4", "--set", "model.seq_len=60", "--set",
             "data.seq_len=60"],
            "seq_len 60 is not divisible by 8, the context ring of 4 (x 2 for the causal balance",
            marks=pytest.mark.slow),
        pytest.param(
            ["--recipe", "digits_mlp", "--mesh", "dp2_cp4"],
            "never calls jaxpar.engine.attention.attention, so it cannot run context-parallel; "
            "use context=1",
            marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_context_refusals_are_one_line(capsys, tmp_path, argv, message):
    run_dir = tmp_path / "run"
    line = one_line_refusal(capsys, ["train", *argv, "--run-dir", str(run_dir)])
    assert message in line, line
    assert not os.path.exists(run_dir) or not os.listdir(run_dir)
