"""docs/model_contract.md's "Pipeline parts" example runs as written: the model is taken from the
document, trained one step on two pipeline stages (pp2) and on one device, with the same loss,
gradient norm and updated parameters."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.config import DataConfig, LogConfig, TrainConfig, TrainLoopConfig
from jaxpar.parallel import pipeline

DOC = Path(__file__).parents[2] / "docs" / "model_contract.md"


def example_module() -> types.ModuleType:
    """The first python block of the document's "Pipeline parts" section, as a module."""
    text = DOC.read_text()
    section = text[text.index("## Pipeline parts") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    name = "jaxpar_contract_example"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their class's module up
    exec(compile(code, str(DOC), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def one_step(jp):
    """layout -> (built program, metrics and parameters after one step)."""
    ex = example_module()
    cfg = TrainConfig(
        name="contract_example", model=ex.TinyLMConfig(),
        data=DataConfig(source="stdlib_text", seq_len=64, global_batch=8),
        train=TrainLoopConfig(steps=1), log=LogConfig(progress=False),
    )  # fmt: skip
    cache = {}

    def get(layout: str):
        if layout not in cache:
            b = jp.build(cfg, layout)
            state, metrics = b.program.train_step(b.program.init(), jp.device_batch(b, 0))
            cache[layout] = (b, jax.device_get(metrics), jax.device_get(state["params"]))
        return cache[layout]

    return get


def test_the_documented_example_trains_on_two_pipeline_stages(one_step):
    b, metrics, params = one_step("pp2")
    _, ref, ref_params = one_step("cpu1")
    parts = pipeline.model_parts(b.program.graphdef, b.program.param_template)
    assert parts.num_layers == 4 and parts.path == ("blocks",)
    sched = pipeline.make_schedule(b.cfg.pipeline, 2, parts.num_layers)
    assert [sched.stage_of(i, 4) for i in range(4)] == [0, 0, 1, 1]
    # The stacked blocks are split over the stages: [L, ...] sharded over `pipeline`.
    assert b.program.state_shardings["params"]["blocks"]["w_q"].spec[0] == "pipeline"
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics[k], ref[k], rtol=1e-5)
    for a, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6)
