"""Building and running train programs in a test process: recipes with fewer steps, presets,
compiled steps with their collective audit, short training runs, first-step gradients, and
re-running a test with another device count. Conftest's fixtures (`jp`, `compiled`, `runs`)
hand these to test modules; a child process imports this module directly."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
import pytest

from jaxpar.config import TrainConfig, resolve_recipe
from jaxpar.data import sources as data_lib
from jaxpar.engine import collectives
from jaxpar.engine.mesh import make_mesh
from jaxpar.engine.rules import Preset
from jaxpar.parallel import program as program_lib
from jaxpar.worker import training
from tests.support import helpers

jax.config.update("jax_threefry_partitionable", True)  # random bits independent of sharding

REPO = str(helpers.REPO)
PARITY_STEPS = 5


def recipe(name: str, steps: int = PARITY_STEPS, **train) -> TrainConfig:
    """A recipe's config with `steps` (and other train.* fields) replaced."""
    cfg = resolve_recipe(name)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps, **train))


def preset(name: str) -> Preset:
    from jaxpar import meshes

    return meshes.resolve(name)


@dataclass
class Built:
    cfg: TrainConfig
    preset: Preset
    mesh: jax.sharding.Mesh
    source: data_lib.Source
    program: program_lib.Program


def build(cfg: TrainConfig, layout: str) -> Built:
    """Program for `cfg` on a preset; 1-device presets use the first device only."""
    p = preset(layout)
    devices = jax.devices()[: p.mesh.size] if p.mesh.size > 0 else None
    mesh = make_mesh(p.mesh, devices)
    source = training.make_source(cfg)
    spec = data_lib.batch_spec(source, cfg.data.global_batch)
    program = program_lib.build_program(cfg, mesh, p.params, p.acts, spec, source.kind)
    return Built(cfg, p, mesh, source, program)


def device_batch(b: Built, step: int) -> dict:
    rows = data_lib.global_batch(
        b.source, step=step, global_batch=b.cfg.data.global_batch, seed=b.cfg.data.seed
    )
    return data_lib.to_device(rows, b.program.batch_shardings, b.cfg.data.global_batch)


def train_steps(b: Built, state: dict, start: int, n: int) -> tuple[dict, list[float]]:
    """Run b's train step for steps start .. start+n-1 eagerly: (state, losses)."""
    losses = []
    for step in range(start, start + n):
        state, m = b.program.train_step(state, device_batch(b, step))
        losses.append(float(m["loss"]))
    return state, losses


def compile_train_step(b: Built):
    """The AOT-compiled train step (what the trainer runs; audits read its HLO)."""
    spec = data_lib.batch_spec(b.source, b.cfg.data.global_batch)
    abs_batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=b.program.batch_shardings[k])
        for k, v in spec.items()
    }
    lowered = b.program.train_step.lower(b.program.abstract_state, abs_batch)
    return lowered.compile()


@dataclass
class Compiled:
    built: Built
    step: Any  # jax.stages.Compiled train step
    colls: list  # its collective audit

    @property
    def mesh(self):
        return self.built.mesh

    @property
    def program(self):
        return self.built.program


def compile_layout(cfg: TrainConfig, layout: str) -> Compiled:
    b = build(cfg, layout)
    step = compile_train_step(b)
    return Compiled(b, step, collectives.audit(step, b.mesh))


def first_step_grads(cfg: TrainConfig, state_after_one_step: dict, grad_norm: float) -> dict:
    """The raw gradients of step 1, read back from Adam's first moment (numpy pure dict).

    After one step from zero moments mu = (1 - b1) * clip(g), and clipping scaled g by
    min(1, clip_norm / |g|). This is the gradient the real train step computed, through its
    own sharding and (for microbatches > 1) its accumulation, at no extra compile.
    """
    opt = cfg.optim
    assert opt.name == "adamw", "gradients are read from Adam's first moment"
    mu = optax.tree_utils.tree_get(state_after_one_step["opt"], "mu")
    unclip = max(1.0, grad_norm / opt.clip_norm) if opt.clip_norm > 0 else 1.0
    return jax.tree.map(lambda m: np.asarray(m, np.float64) / (1.0 - opt.b1) * unclip, mu)


@dataclass
class RunResult:
    losses: np.ndarray  # per step
    grad_norms: np.ndarray  # per step (train_step metric, before clipping)
    grads: dict  # first-step gradients (numpy pure dict)


# Host copies of initial states, one per model, seed, optimizer and state shapes: the init is
# independent of the layout (jax's threefry is partitionable), so the first program of a config
# computes it and every later layout starts from a copy. With the tests' unoptimised CPU code
# one init of gpt_tiny costs ~0.8 CPU-s on 8 devices (each replica generates every parameter)
# plus its compile. test_parity's test_initial_state_is_the_same_on_every_layout checks the
# premise against the program's own init on a tensor-parallel and a pipelined layout.
_INITS: dict[tuple, Any] = {}


def initial_state(b: Built) -> dict:
    """b's initial state, on b's devices (fresh buffers: the train step donates them)."""
    abstract = b.program.abstract_state
    cfg = b.cfg
    key = (
        repr(cfg.model), cfg.train.seed, repr(cfg.optim), repr(cfg.comm), repr(cfg.precision),
        repr(cfg.loss), repr(cfg.optimizer), repr(jax.tree.structure(abstract)),
        repr([(a.shape, str(a.dtype)) for a in jax.tree.leaves(abstract)]),
    )  # fmt: skip
    if key not in _INITS:
        _INITS[key] = jax.device_get(b.program.init())
    return jax.tree.map(lambda h, a: jax.device_put(h, a.sharding), _INITS[key], abstract)


def train(c: Compiled, init=None) -> RunResult:
    """Run the compiled step for cfg.train.steps steps from `init()` (default: the config's
    initial state, `initial_state`)."""
    b = c.built
    state = init() if init else initial_state(b)
    losses, norms, grads = [], [], None
    for step in range(b.cfg.train.steps):
        state, metrics = c.step(state, device_batch(b, step))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        if step == 0:  # before the next step donates this state
            grads = first_step_grads(b.cfg, state, norms[0])
    return RunResult(np.array(losses), np.array(norms), grads)


def max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def max_abs_tree(a: dict, b: dict) -> float:
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)
    return max(jax.tree.leaves(diffs))


def rerun_with_devices(request: pytest.FixtureRequest, devices: int, timeout: float = 300) -> bool:
    """Re-run the calling test in a subprocess with `devices` CPU devices.

    Returns True in the parent (which should then return: the child did the work and passed) and
    False in the child (which carries on with the test body).

        def test_x(request):
            if rerun_with_devices(request, 4):
                return
            assert jax.device_count() == 4
    """
    if jax.device_count() == devices:
        return False
    env = dict(os.environ, JAXPAR_TEST_DEVICES=str(devices))
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={devices}", *flags])
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-n",
        "0",  # pyproject.toml's addopts (run in the checkout) keep hypothesis' plugin out
        helpers.plain_nodeid(request.node),
    ]
    proc = subprocess.run(
        cmd, cwd=str(request.config.rootpath), env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{request.node.nodeid} with {devices} devices failed (rc {proc.returncode}):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return True
