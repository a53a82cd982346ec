"""Bad mixture-of-experts settings for `jaxpar train`: one line naming the fix, exit 2, nothing
written (the router's settings when the config is read, the expert axis and a pipeline with the
auxiliary losses on when the program is built)."""

from __future__ import annotations

import pytest

from tests.api.test_bad_input_cli import one_line_refusal
from tests.support.hardening_util import snapshot


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--recipe", "gpt_moe", "--set", "model.top_k=9"],
            "model.top_k=9 is more than model.n_experts=8",
        ),
        (
            ["--recipe", "gpt_moe", "--set", "model.n_experts=1"],
            "model.top_k=2 is more than model.n_experts=1",
        ),
        (
            ["--recipe", "gpt_moe", "--set", "model.capacity_factor=0"],
            "model.capacity_factor=0.0: it must be > 0",
        ),
        (
            ["--recipe", "gpt_moe", "--set", "model.n_experts=6", "--mesh", "data=2,expert=4"],
            "model.n_experts=6 is not divisible by the expert mesh axis (4)",
        ),
        (
            ["--recipe", "gpt_tiny", "--mesh", "data=2,expert=4"],
            "the mesh has expert=4 but the model has no experts",
        ),
        (  # the stage's block is traced abstractly as the program is built, not at compile
            ["--recipe", "gpt_moe", "--mesh", "data=2,expert=2,pipeline=2"],
            "a pipeline computes the loss stage by stage and cannot add the MoE auxiliary losses",
        ),
    ],
)
def test_moe_settings_are_refused_before_writing(capsys, tmp_path, argv, message):
    run_dir = tmp_path / "run"
    line = one_line_refusal(capsys, ["train", *argv, "--run-dir", str(run_dir)])
    assert message in line
    assert snapshot(run_dir) is None
