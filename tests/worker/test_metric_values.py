"""Metrics-line values (jaxpar/worker/training.py): scalars as floats, per-expert loads as lists."""

from __future__ import annotations

import numpy as np

from jaxpar.worker import training


def test_vector_metrics_are_lists_and_the_rest_floats():
    assert training.metric_value("grad_norm", np.float32(2.5)) == 2.5
    assert training.metric_value("accuracy", np.array([0.5, 1.0])) == 0.75  # per replica
    load = np.array([0.5, 0.25, 0.25], np.float32)
    assert training.metric_value("moe_expert_load", load) == [0.5, 0.25, 0.25]
    # a per-replica dimension (DiLoCo) is averaged, the expert dimension kept
    per_replica = np.array([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5]])
    assert training.metric_value("moe_expert_load", per_replica) == [0.5, 0.25, 0.25]


def test_progress_line_shows_scalars_only():
    line = {"step": 3, "loss": 1.0, "moe_aux_loss": 1.1, "moe_expert_load": [0.5, 0.5]}
    assert training.loss_metrics(line) == {"moe_aux_loss": 1.1}
