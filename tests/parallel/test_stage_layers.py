"""Uneven pipeline stages (pipeline.stage_layers): parity with the unpipelined model, layer
counts the stages do not divide, the layout round trip, inspect's per-stage counts, and one line
for each bad split.

XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/parallel/test_stage_layers.py
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxpar.config import PipelineConfig, stage_split, validate
from jaxpar.parallel import pipeline
from tests.api.test_bad_input_cli import one_line_refusal
from tests.parallel.test_pipeline import (  # noqa: F401 - reference: a fixture
    check_parity,
    reference,
    tiny,
)


def test_uneven_layout_round_trips():
    a = np.arange(6 * 2).reshape(6, 2)  # 6 layers as 2,1,1,2: k = 2, two padded slots
    sm = np.asarray(pipeline.to_uneven_stages(a, (2, 1, 1, 2)))
    assert sm.shape == (4, 1, 2, 2)
    assert sm[:, 0, :, 0].tolist() == [[0, 2], [4, 4], [6, 6], [8, 10]]  # padded: a repeat
    np.testing.assert_array_equal(pipeline.from_uneven_stages(sm, (2, 1, 1, 2)), a)
    sched = pipeline.make_schedule(PipelineConfig("1f1b", 4, stage_layers="3,2"), 2, 5)
    assert sched.split == (3, 2) and sched.group_size(5) == 3
    assert [sched.stage_of(i, 5) for i in range(5)] == [0, 0, 0, 1, 1]
    # An even split given explicitly runs as the even layout.
    assert pipeline.make_schedule(PipelineConfig(stage_layers="2,2"), 2, 4).split == ()


def _layers_axis(c) -> set:
    """The mesh axis (or None) the blocks' layers dimension is sharded over."""
    blocks = c.program.state_shardings["params"]["blocks"]
    return {(s.spec[0] if len(s.spec) else None) for s in jax.tree.leaves(blocks)}


def test_uneven_1f1b_parity_on_two_stages(jp, reference):  # noqa: F811
    """6 layers as 4,2 on pipeline=2: the `layers` rule still shards them (3 per stage); the
    step moves the rows each stage needs."""
    c = check_parity(jp, reference, "pp2", "1f1b", 2, 1, 6, split="4,2").compiled
    assert _layers_axis(c) == {"pipeline"}


def test_uneven_zero_bubble_parity_on_four_stages(jp, reference):  # noqa: F811
    """6 layers as 2,1,1,2 on pipeline=4, which does not divide them: the layers stay whole on
    every stage, each slices its own (zero_bubble: the split backward, W on padded slots)."""
    c = check_parity(jp, reference, "pp4", "zero_bubble", 4, 1, 6, split="2,1,1,2").compiled
    assert _layers_axis(c) == {None}
    text = "\n".join(pipeline.inspect_lines(c.built.cfg, c.program))
    assert "layers per stage 2,1,1,2 (pipeline.stage_layers)" in text
    assert "block -> stage: 0->0, 1->0, 2->1, 3->2, 4->3, 5->3" in text
    assert "| 1 | 1 | [2] |" in text


@pytest.mark.parametrize(
    "stage_layers, mesh, message",
    [
        (
            "3,2,2",
            "dp4_pp2",
            "3 entries but the mesh has pipeline=2: give one layer count per stage",
        ),
        ("3,0", "dp4_pp2", "give whole layer counts >= 1 per stage"),
        ("3,3", "dp4_pp2", "sums to 6 but the model has 4 layers: make the counts add up to 4"),
        ("2,1", "dp8", "names 2 stages but the mesh has pipeline=1"),
    ],
)
def test_bad_splits_are_one_line(capsys, tmp_path, stage_layers, mesh, message):
    argv = ["train", "--recipe", "gpt_tiny", "--mesh", mesh, "--run-dir", str(tmp_path / "r"),
            "--set", f"pipeline.stage_layers={stage_layers}", "--set", "model.n_layers=4"]  # fmt: skip
    assert message in one_line_refusal(capsys, argv)


def test_repeated_schedules_refuse_a_split():
    cfg = tiny(4, "circular", 2, 2, split="3,1")
    with pytest.raises(ValueError, match="use pipeline.schedule=gpipe, 1f1b or zero_bubble, or d"):
        validate(cfg)
    # The form `jaxpar bench pipeline` prints its recommendation in is accepted too.
    assert stage_split(dataclasses.replace(tiny().pipeline, stage_layers="[3, 1]")) == (3, 1)
