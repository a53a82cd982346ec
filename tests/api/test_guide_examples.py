"""The guide's two Flax models (docs/examples: Flax's MNIST CNN and miniGPT, each a minimal diff
from Flax's text) train on a tensor-parallel mesh through the library API."""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np
import pytest

import jaxpar
from tests.support.helpers import REPO

EXAMPLES = REPO / "docs" / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))


def _one_step(cfg: jaxpar.TrainConfig, layout: str):
    job = jaxpar.build(cfg, layout)
    state = job.init()
    state, metrics = job.train_step(state, job.batch(0))
    return job, state, jax.device_get(metrics)


@pytest.mark.slow
def test_flax_mnist_cnn_trains_with_batch_stats_and_accuracy(devices8):
    import flax_mnist_cnn

    cfg = flax_mnist_cnn.recipe()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2))
    job, state, metrics = _one_step(cfg, "dp2_tp4")
    assert np.isfinite(metrics["loss"]) and 0.0 <= metrics["accuracy"] <= 1.0
    stats = {jax.tree_util.keystr(p): np.asarray(x)
             for p, x in jax.tree_util.tree_leaves_with_path(state["model_state"])}  # fmt: skip
    assert any("batch_norm1" in k and "mean" in k for k in stats), sorted(stats)
    assert any(np.any(v != 0) for k, v in stats.items() if "mean" in k)
    out = job.eval_step(state, job.batch(0, split="eval"))
    assert np.isfinite(float(out["loss"])) and "accuracy" in out


@pytest.mark.slow
def test_flax_minigpt_trains_tensor_parallel(devices8):
    import flax_minigpt

    cfg = flax_minigpt.recipe()
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, global_batch=4, seq_len=32),
        train=dataclasses.replace(cfg.train, steps=2),
    )
    job, state, metrics = _one_step(cfg, "dp2_tp4")
    assert np.isfinite(metrics["loss"])
    assert abs(float(metrics["loss"]) - np.log(256)) < 1.0  # about uniform over the bytes at first
    shardings = {
        jax.tree_util.keystr(p): x.sharding.spec
        for p, x in jax.tree_util.tree_leaves_with_path(job.abstract_state["params"])
    }
    tensor = [k for k, spec in shardings.items() if "tensor" in str(spec)]
    assert any("output_layer" in k for k in tensor) and any("mha" in k for k in tensor), shardings
