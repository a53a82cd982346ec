"""Mixed precision and rematerialisation through the real sharded train step (8 CPU devices).

bf16 compute keeps float32 parameters, optimizer state and gradient all-reduces, lowers bf16
matmuls, and trains within 2e-2 of float32; rematerialisation changes memory, not values.
Tensor-parallel and pipelined bf16 run in a subprocess: XLA CPU has aborted the whole process
(no Python exception) compiling some bf16 collectives, and such an abort must fail one test,
not end the session. Their float32 runs need none: tensor-parallel float32 is the session's run
of that layout (conftest's `runs`, which test_parity trains too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data import sources as data_lib
from jaxpar.parallel import program as step_lib
from tests.support import helpers

# A layout's bf16 and float32 programs build the same init: compiled once (conftest)
pytestmark = pytest.mark.usefixtures("cache_every_program")

BF16 = ["precision.compute=bfloat16"]
LOSS_RTOL_BF16 = 2e-2
# bf16 runs train 3 steps (two updates in bf16 show in the losses) against the first 3 of the
# session's 5-step float32 runs: with train.steps <= the warmup's 20 the learning-rate schedule,
# the one way a run's length reaches its step (program.decay_horizon), is the same, and so is
# the program, so a 3-step run's losses are a 5-step run's first 3.
BF16_STEPS = 3
REMAT_TOL = 1e-6


def _lowered_text(jp, cfg, layout: str) -> str:
    """StableHLO of the train step as jaxpar asks for it (before the backend's own rewrites:
    XLA CPU turns bf16 dots into float32 ones, a GPU runs them in bf16)."""
    b = jp.build(cfg, layout)
    spec = data_lib.batch_spec(b.source, cfg.data.global_batch)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=b.program.batch_shardings[k])
             for k, v in spec.items()}  # fmt: skip
    return b.program.train_step.lower(b.program.abstract_state, batch).as_text()


def _bf16_dots(text: str) -> int:
    return len(
        re.findall(r"stablehlo\.dot_general[^\n]*\(tensor<[^>]*bf16>, tensor<[^>]*bf16>", text)
    )


@pytest.fixture(scope="module")
def bf16_dp8(jp):
    cfg = apply_overrides(jp.recipe("gpt_tiny", BF16_STEPS), BF16)
    c = jp.compile_layout(cfg, "dp8")
    return c, jp.train(c)


def test_state_and_gradient_reduction_stay_fp32(bf16_dp8):
    c, _ = bf16_dp8
    state = c.program.abstract_state
    for part in ("params", "opt"):
        floats = [
            x.dtype for x in jax.tree.leaves(state[part]) if np.issubdtype(x.dtype, np.floating)
        ]
        assert floats and all(d == np.float32 for d in floats), (part, set(floats))
    reduces = [x for x in c.colls if x.kind == "all-reduce"]
    assert reduces and all(x.dtype == "f32" for x in reduces), [(x.dtype, x.bytes) for x in reduces]


def test_bf16_lowers_bf16_dots_and_fp32_none(jp):
    cfg = jp.recipe("gpt_tiny", steps=1)
    assert _bf16_dots(_lowered_text(jp, cfg, "cpu1")) == 0
    text = _lowered_text(jp, apply_overrides(cfg, BF16), "cpu1")
    # Every weight matmul of every block, forward and backward, plus the head and attention.
    assert _bf16_dots(text) >= 3 * 4 * cfg.model.n_layers


@pytest.mark.parametrize("layout", ["dp8", pytest.param("fsdp8", marks=pytest.mark.slow)])
def test_bf16_losses_within_2e_2_of_fp32(layout, jp, runs, bf16_dp8):
    fp32 = runs("gpt_tiny", layout).losses[:BF16_STEPS]
    if layout == "dp8":
        got = bf16_dp8[1]
    else:
        cfg = apply_overrides(jp.recipe("gpt_tiny", BF16_STEPS), BF16)
        got = jp.train(jp.compile_layout(cfg, layout))
    print(layout, "fp32", fp32, "bf16", got.losses)
    assert len(got.losses) == BF16_STEPS and np.all(np.isfinite(got.losses))
    assert jp.max_rel(got.losses, fp32) <= LOSS_RTOL_BF16


def _deep(jp, remat: str, layers: int, steps: int = 2):
    """gpt_tiny with `layers` blocks, remat `remat`. What the backward keeps shrinks to 10 % of
    it with 2 layers (6 % with 8: the more blocks, the more remat saves), so 2 layers show it."""
    cfg = jp.recipe("gpt_tiny", steps=steps)
    model = dataclasses.replace(cfg.model, n_layers=layers, remat=remat)
    return dataclasses.replace(cfg, model=model)


def test_remat_same_losses_and_gradients_less_memory(jp):
    plain = jp.compile_layout(_deep(jp, "none", 2), "cpu1")
    remat = jp.compile_layout(_deep(jp, "block", 2), "cpu1")
    a, b = jp.train(plain), jp.train(remat)
    assert np.max(np.abs(a.losses - b.losses)) <= REMAT_TOL
    assert jp.max_abs_tree(a.grads, b.grads) <= REMAT_TOL
    spec = data_lib.batch_spec(plain.built.source, plain.built.cfg.data.global_batch)
    saved = [
        step_lib.saved_for_backward_bytes(c.built.cfg, c.program, spec) for c in (plain, remat)
    ]
    # XLA CPU schedules the recomputation right after the forward, so its temporaries do not
    # shrink (a GPU's do); what the backward pass keeps does, on any backend.
    temp = [c.step.memory_analysis().temp_size_in_bytes for c in (plain, remat)]
    print("saved for backward without / with remat", saved, "compiled temp", temp)
    assert saved[1] < 0.2 * saved[0]
    assert temp[1] <= temp[0]


# ---- layouts whose bf16 collectives XLA CPU must compile: in a subprocess ---------------------------

CHILD = """
import json, os, sys
sys.path.insert(0, os.getcwd())
from tests.support import programs
from jaxpar.config import apply_overrides
extra = {"fp32": [], "bf16": ["precision.compute=bfloat16"]}
out = {}
for key, (steps, names, layout, sets) in json.loads(sys.argv[1]).items():
    out[key] = {}
    for name in names:
        cfg = apply_overrides(programs.recipe("gpt_tiny", steps), sets + extra[name])
        c = programs.compile_layout(cfg, layout)
        out[key][name] = programs.train(c).losses.tolist()
        out[key][name + "_collectives"] = sorted({(x.kind, x.dtype) for x in c.colls})
print("RESULT " + json.dumps(out))
"""

# id: (layout, sets, precisions the child trains). pp2 with remat: one block per stage (the
# remat and the stages' hand-over are per block), a variant no other test trains: both
# precisions in the child. dp2_tp4's float32 is the session's run of the layout (test_parity's:
# the same xdist group).
CHILD_RUNS = {
    "dp2_tp4": ("dp2_tp4", (), ("bf16",)),
    "pp2_remat": ("pp2", ("model.remat=block", "model.n_layers=2"), ("fp32", "bf16")),
}


@pytest.fixture(scope="module")
def child_runs(jp) -> dict:
    """Every CHILD_RUNS variant, BF16_STEPS steps each, in one subprocess (one interpreter and
    jax start for all): an abort there fails the tests that read it, not the session."""
    todo = {k: (BF16_STEPS, names, layout, list(sets)) for k, (layout, sets, names) in
            CHILD_RUNS.items()}  # fmt: skip
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {helpers.XLA_TEST_FLAGS}"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(todo)], cwd=jp.REPO, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    tail = (proc.stdout[-2000:] + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, f"the bf16 child exited {proc.returncode}:\n{tail}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(CHILD_RUNS))
def test_bf16_tensor_and_pipeline_parallel_in_a_subprocess(jp, runs, child_runs, variant):
    got = dict(child_runs[variant])
    if "fp32" not in got:  # the session's float32 run of the layout, its first BF16_STEPS
        got["fp32"] = runs("gpt_tiny", CHILD_RUNS[variant][0]).losses[:BF16_STEPS].tolist()
    print(got)
    assert len(got["bf16"]) == BF16_STEPS and np.all(np.isfinite(got["bf16"]))
    assert jp.max_rel(got["bf16"], got["fp32"]) <= LOSS_RTOL_BF16
