"""Mixed precision and rematerialisation through the real sharded train step (8 CPU devices).

bf16 compute keeps float32 parameters, optimizer state and gradient all-reduces, lowers bf16
matmuls, and trains within 2e-2 of float32; rematerialisation changes memory, not values.
Tensor-parallel and pipelined bf16 run in a subprocess: XLA CPU has aborted the whole process
(no Python exception) compiling some bf16 collectives, and such an abort must fail one test,
not end the session. bf16 against float32 on gpt_tiny made small (SMALL).
"""

from __future__ import annotations

import dataclasses
import json
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
# bf16 runs train 3 steps (two updates in bf16 show in the losses) against float32 runs of the
# same config and layout.
BF16_STEPS = 3
# Both on gpt_tiny made small (helpers.SMALL's width, sequences and batch; two blocks): how close
# bf16 trains to float32, and which dtypes the state and the gradients' reduction keep, do not
# depend on size, and XLA CPU's bf16 steps are slow (~1.6 CPU-s a step of the full gpt_tiny on
# dp8, ~2 on dp2_tp4, against ~0.1 small).
SMALL = ("model.n_layers=2", "model.d_model=64", "model.d_mlp=128", "model.seq_len=32",
         "data.seq_len=32", "data.global_batch=16")  # fmt: skip
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
def small_runs(jp):
    """small_runs(layout, bf16): the small gpt_tiny compiled on `layout` in bf16 or float32 and
    trained BF16_STEPS steps, (compiled, run), once per module."""
    cache = {}

    def get(layout: str, bf16: bool):
        if (layout, bf16) not in cache:
            sets = [*SMALL, *(BF16 if bf16 else [])]
            cfg = apply_overrides(jp.recipe("gpt_tiny", BF16_STEPS), sets)
            c = jp.compile_layout(cfg, layout)
            cache[layout, bf16] = c, jp.train(c)
        return cache[layout, bf16]

    return get


def test_state_and_gradient_reduction_stay_fp32(small_runs):
    c, _ = small_runs("dp8", bf16=True)
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
def test_bf16_losses_within_2e_2_of_fp32(layout, jp, small_runs):
    fp32 = small_runs(layout, bf16=False)[1].losses
    got = small_runs(layout, bf16=True)[1]
    print(layout, "fp32", fp32, "bf16", got.losses)
    assert len(got.losses) == BF16_STEPS and np.all(np.isfinite(got.losses))
    assert jp.max_rel(got.losses, fp32) <= LOSS_RTOL_BF16


def _deep(jp, remat: str, layers: int, steps: int = 1):
    """gpt_tiny with `layers` blocks, remat `remat`. What the backward keeps shrinks to 10 % of
    it with 2 layers (6 % with 8: the more blocks, the more remat saves), so 2 layers show it.
    One step: its loss and gradients are what remat could change (the warmup's first learning
    rate is 0, so a second step's loss would be the same parameters' on another batch)."""
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

# id: (layout, sets, precisions the child trains), the small gpt_tiny. pp2 with remat: one block
# per stage (the remat and the stages' hand-over are per block), a variant no other test trains.
CHILD_RUNS = {
    "dp2_tp4": ("dp2_tp4", SMALL, ("fp32", "bf16")),
    "pp2_remat": ("pp2", (*SMALL, "model.remat=block"), ("fp32", "bf16")),
}


@pytest.fixture(scope="module")
def child_runs(jp) -> dict:
    """Every CHILD_RUNS variant, BF16_STEPS steps each, in one subprocess (one interpreter and
    jax start for all): an abort there fails the tests that read it, not the session."""
    todo = {k: (BF16_STEPS, names, layout, list(sets)) for k, (layout, sets, names) in
            CHILD_RUNS.items()}  # fmt: skip
    # 8 devices, the tests' XLA flags and the session's compilation cache (a layout's float32
    # and bf16 inits are one program: the second loads)
    env = helpers.cpu_env()
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
def test_bf16_tensor_and_pipeline_parallel_in_a_subprocess(jp, child_runs, variant):
    got = child_runs[variant]
    print(got)
    assert len(got["bf16"]) == BF16_STEPS and np.all(np.isfinite(got["bf16"]))
    assert jp.max_rel(got["bf16"], got["fp32"]) <= LOSS_RTOL_BF16
