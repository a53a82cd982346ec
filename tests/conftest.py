# ruff: noqa: E402  (XLA_FLAGS must be set before jax creates its CPU backend)
"""Shared test set-up: 8 simulated CPU devices, cached compiled steps and reference runs.

Tiers: `python -m pytest -m "not slow"` is the fast tier; `slow` marks multi-layout parity,
subprocess and end-to-end tests. A test needing another device count calls
`rerun_with_devices(request, n)`, which re-runs that one test in a subprocess.

Every test checks (autouse fixture) that the process has exactly the devices it expects, so a
multi-device test can never silently run on one device. Command lines run as subprocesses through
tests/helpers.py, which share one persistent compilation cache per pytest session.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = int(os.environ.get("JAXPAR_TEST_DEVICES", "8"))


if REPO not in sys.path:
    sys.path.insert(0, REPO)  # jaxpar (models/, meshes/, train/ as jaxpar.*) from the checkout

from tests import helpers  # imports jax but creates no backend


def _xla_flags(existing: str, devices: int) -> str:
    """XLA_FLAGS for the tests: the device count and helpers.XLA_TEST_FLAGS, each unless
    `existing` sets that flag already."""
    flags = existing.split()
    wanted = [f"--xla_force_host_platform_device_count={devices}", *helpers.XLA_TEST_FLAGS.split()]
    for flag in wanted:
        if not any(f.split("=")[0] == flag.split("=")[0] for f in flags):
            flags.append(flag)
    return " ".join(flags)


# Must happen before jax creates its CPU backend (the first jax.devices() call).
os.environ["XLA_FLAGS"] = _xla_flags(os.environ.get("XLA_FLAGS", ""), DEVICES)

import dataclasses
import subprocess
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
import pytest

jax.config.update("jax_threefry_partitionable", True)  # random bits independent of sharding


from jaxpar.config import TrainConfig, resolve_recipe
from jaxpar.data import sources as data_lib
from jaxpar.engine import collectives
from jaxpar.engine.mesh import make_mesh
from jaxpar.engine.rules import Preset
from jaxpar.parallel import program as step_lib
from jaxpar.worker import training


def pytest_configure(config):
    """Compile the checkout's modules once, before the workers start: the suite starts ~600
    Python processes, and where PYTHONDONTWRITEBYTECODE is set each would compile jaxpar's own
    modules again (~0.1 s of CPU apiece)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall

    for name in ("jaxpar", "models", "train", "meshes", "tests", "docs"):
        compileall.compile_dir(os.path.join(REPO, name), quiet=2)


PARITY_STEPS = 5
IN_PROCESS_CACHE_MIN_S = 2.0  # compile time from which a test process's program is cached


# ---- parallel runs (pytest-xdist, `--dist loadgroup` in pyproject.toml) -------------------------

# The cluster tests share one worker: they start one SLURM cluster and namespace hosts with fixed
# addresses (never two at once). Every other module is a group of its own (module fixtures built
# once), unless a test names its group (`pytest.mark.xdist_group`). The longest groups start
# first so that no worker is left with a long tail: seconds per group from `pytest
# --durations=0` on a 2-core machine (4 workers), rounded (a wrong figure only changes the order).
CLUSTER = "cluster"
# test_pipeline.py's tests that run in child processes form a group of their own (the module's
# two halves run on two workers).
PIPELINE_CHILDREN = "sharding/test_pipeline.py:children"
LONGEST_FIRST = {
    "e2e/test_bench_recovery.py": 750,
    "faults/test_checkpoint_faults.py": 550,
    CLUSTER: 470,
    "e2e/test_bench_quick.py": 330,
    "e2e/test_notebook.py": 300,
    "sharding/test_precision.py": 300,
    "multiprocess/test_resume_2proc.py": 280,
    "sharding/test_parity.py": 270,
    "faults/test_supervisor.py": 270,
    "sharding/test_pipeline.py": 240,
    "data/test_data_e2e.py": 240,
    PIPELINE_CHILDREN: 230,
    "recovery/test_local_resume_2proc.py": 210,
    "sharding/test_reshard.py": 110,
    "userproj/test_userproj.py": 110,
    "recovery/test_standby_teardown.py": 100,
    "sharding/test_comm.py": 100,
    "e2e/test_install.py": 100,
    "e2e/test_train_cli.py": 60,
    "hardening/test_hardening_process.py": 60,
}


def _group(item: pytest.Item) -> str:
    """The test's xdist group: its own `xdist_group` marker, else its module (or the cluster)."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return marker.args[0] if marker.args else marker.kwargs["name"]
    rel = os.path.relpath(str(item.path), os.path.join(REPO, "tests")).split(os.sep)
    return CLUSTER if rel[0] == CLUSTER else "/".join(rel)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """One xdist group per test module (or the cluster folder), the longest groups first."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike; xdist hands out groups
        items.sort(key=lambda item: -LONGEST_FIRST.get(_group(item), 0))  # stable: file order


@pytest.fixture(autouse=True, scope="session")
def _device_count():
    got = jax.device_count()
    assert got == DEVICES, (
        f"tests expect {DEVICES} devices, jax sees {got}: XLA_FLAGS must be set before jax starts "
        f"(XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})"
    )


@pytest.fixture(autouse=True, scope="session")
def _session_compilation_cache(tmp_path_factory):
    """One persistent compilation cache for the session's processes (subprocesses through
    tests.helpers.cpu_env); a child pytest (rerun_with_devices) keeps its parent's."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one for all workers
    cache = os.environ.setdefault(helpers.CACHE_ENV, str(shared / "jax-cache"))
    # The test processes share it too: a test that builds a program another test (on any worker)
    # already compiled loads it. Only programs that took seconds go in, so the compiled-program
    # cache's own tests (tiny programs) never see it.
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", IN_PROCESS_CACHE_MIN_S)
    local = os.environ.setdefault(helpers.LOCAL_ENV, str(tmp_path_factory.getbasetemp() / "local"))
    os.environ.setdefault("JAXPAR_LOCAL_DIR", local)  # in-process runs too


@pytest.fixture(scope="session")
def devices8():
    """The 8 simulated devices (asserted, never skipped)."""
    assert jax.device_count() == 8, f"needs 8 devices, have {jax.device_count()}"
    return jax.devices()


# ---- building and running programs -------------------------------------------------------------


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
    program: step_lib.Program


def build(cfg: TrainConfig, layout: str) -> Built:
    """Program for `cfg` on a preset; 1-device presets use the first device only."""
    p = preset(layout)
    devices = jax.devices()[: p.mesh.size] if p.mesh.size > 0 else None
    mesh = make_mesh(p.mesh, devices)
    source = training.make_source(cfg)
    spec = data_lib.batch_spec(source, cfg.data.global_batch)
    program = step_lib.build_program(cfg, mesh, p.params, p.acts, spec, source.kind)
    return Built(cfg, p, mesh, source, program)


def device_batch(b: Built, step: int) -> dict:
    rows = data_lib.global_batch(
        b.source, step=step, global_batch=b.cfg.data.global_batch, seed=b.cfg.data.seed
    )
    return data_lib.to_device(rows, b.program.batch_shardings, b.cfg.data.global_batch)


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


def train(c: Compiled, init=None) -> RunResult:
    """Run the compiled step for cfg.train.steps steps from `init()` (default: the program's)."""
    b = c.built
    state = (init or b.program.init)()
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


@pytest.fixture(scope="session")
def jp():
    """The helpers above, for test modules (conftest is not importable as a module)."""
    import types

    return types.SimpleNamespace(
        recipe=recipe, preset=preset, build=build, device_batch=device_batch,
        compile_train_step=compile_train_step, compile_layout=compile_layout, train=train,
        first_step_grads=first_step_grads, max_rel=max_rel, max_abs_tree=max_abs_tree, REPO=REPO,
    )  # fmt: skip


@pytest.fixture(scope="session")
def compiled():
    """Session cache of compiled train steps: compiled(recipe, layout, microbatches=1, steps=5)."""
    cache: dict[tuple, Compiled] = {}

    def get(name: str, layout: str, microbatches: int = 1, steps: int = PARITY_STEPS) -> Compiled:
        key = (name, layout, microbatches, steps)
        if key not in cache:
            cache[key] = compile_layout(recipe(name, steps, microbatches=microbatches), layout)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def runs(compiled):
    """Session cache of training runs: runs(recipe, layout, microbatches=1, steps=5)."""
    cache: dict[tuple, RunResult] = {}

    def get(name: str, layout: str, microbatches: int = 1, steps: int = PARITY_STEPS):
        key = (name, layout, microbatches, steps)
        if key not in cache:
            # Microbatching does not change the initial state: reuse the compiled init.
            init = compiled(name, layout, 1, steps).program.init if microbatches > 1 else None
            cache[key] = train(compiled(*key), init)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def reference_run(runs):
    """gpt_tiny on one device: 5-step losses and first-step gradients (shared by all tests)."""
    return runs("gpt_tiny", "cpu1")


# ---- other device counts ------------------------------------------------------------------------


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
        "0",
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


@pytest.fixture
def rerun(request):
    """rerun(n): see rerun_with_devices."""
    return lambda devices, timeout=300: rerun_with_devices(request, devices, timeout)


# ---- subprocess runs (tests/helpers.py) ---------------------------------------------------------

CKPT_STEPS, CKPT_EVERY = 30, 10


@pytest.fixture(scope="session")
def ckpt_reference(tmp_path_factory):
    """An uninterrupted `python -m train` run dir: gpt_tiny made small (helpers.SMALL), 30 steps,
    a save every 10, 8 devices.

    The reference of the checkpoint-fault, local-tier, reshard and run-directory tests, which copy
    it or compare with it (their runs pass helpers.SMALL too: the same config and program).
    """
    run_dir = tmp_path_factory.mktemp("ckpt-reference") / "run"
    every = f"ckpt.every={CKPT_EVERY}"
    cmd = helpers.train_cmd(run_dir, "--set", every, *helpers.SMALL, steps=CKPT_STEPS)
    helpers.ok(helpers.run(cmd))
    return run_dir


@pytest.fixture(scope="session")
def tokens_corpus(tmp_path_factory) -> str:
    """A folder prepared by `jaxpar data prepare` (tests/data/corpus.py), once per session."""
    from tests.data.corpus import prepare_corpus

    return prepare_corpus(tmp_path_factory.mktemp("tokens") / "corpus")
