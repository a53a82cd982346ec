"""A user's own project (tests/api/userproj/my_project: a BatchNorm + dropout model with a
`__call__(x)` signature, a logical name jaxpar does not know plus its rule, its own loss with an
accuracy metric and its own optax chain) trained the two documented ways:

- `jaxpar train --recipe my_project.recipes:digits_bn`, run from a directory outside the checkout;
- its own entrypoint (`python -m my_project.train`, the library API) under `jaxpar launch`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.rundir.runlog import read_jsonl
from tests.support.helpers import cpu_env, losses
from tests.support.launch_util import clean_env, kill_workers

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))  # my_project, for the in-process checks

from my_project.recipes import digits_bn  # noqa: E402

JAXPAR = Path(sys.executable).with_name("jaxpar")  # the console script of this interpreter
STEPS = 10
MESH = "dp2_tp4"
TIMEOUT_S = 600


def _config(steps: int = STEPS) -> jaxpar.TrainConfig:
    cfg = digits_bn()
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of the user project in a directory outside the checkout (its current directory)."""
    where = tmp_path_factory.mktemp("userproj")
    shutil.copytree(HERE / "my_project", where / "my_project",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    return where


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = TIMEOUT_S, run_dir=None):
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} timed out:\n{out[-4000:]}") from None
    finally:
        if run_dir is not None:
            kill_workers(run_dir)
    return proc.returncode, out


def _train(project: Path, run_dir: Path, *args: str) -> tuple[int, str]:
    assert JAXPAR.is_file(), f"no jaxpar console script beside {sys.executable}: pip install -e ."
    cmd = [str(JAXPAR), "train", "--recipe", "my_project.recipes:digits_bn", "--mesh", MESH,
           "--steps", str(STEPS), "--run-dir", str(run_dir), "--no-progress", *args]  # fmt: skip
    return _run(cmd, project, cpu_env())


@pytest.fixture(scope="module")
def reference(project) -> Path:
    """An uninterrupted `jaxpar train` run of the user recipe (saves every 5 steps)."""
    run_dir = project / "reference"
    rc, out = _train(project, run_dir)
    assert rc == 0, out[-4000:]
    return run_dir


def _restore(run_dir: Path, step: int) -> dict:
    job = jaxpar.build(_config(), MESH)
    with jaxpar.CheckpointManager(str(run_dir), config=job.cfg) as ckpt:
        state = ckpt.restore(job.abstract_state, step)
    assert state is not None, f"no checkpoint {step} in {run_dir}"
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in
            jax.tree_util.tree_leaves_with_path(state)}  # fmt: skip


@pytest.mark.slow
def test_jaxpar_train_runs_the_user_recipe_from_outside_the_checkout(reference):
    lines = read_jsonl(str(reference / "metrics.jsonl"))
    train = [m for m in lines if "loss" in m]
    assert [m["step"] for m in train] == list(range(1, STEPS + 1))
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in train)  # the user loss's own metric
    evals = [m for m in lines if "eval_loss" in m]
    assert [m["step"] for m in evals] == [10] and 0.0 <= evals[0]["eval_accuracy"] <= 1.0
    assert train[-1]["loss"] < train[0]["loss"]
    cfg = json.loads((reference / "config.json").read_text())
    assert cfg["loss"] == "my_project.recipes:loss"
    assert cfg["optimizer"] == "my_project.recipes:optimizer"
    assert cfg["rules"] == [["hidden", "tensor"]]


@pytest.mark.slow
def test_kill_and_resume_is_bitwise_identical_and_batch_stats_restore(project, reference):
    run_dir = project / "killed"
    rc, out = _train(project, run_dir, "--fault", "kill@7")
    assert rc == -signal.SIGKILL, out[-3000:]
    rc, out = _train(project, run_dir)
    assert rc == 0, out[-4000:]
    assert losses(run_dir) == losses(reference)  # every step, floats compared exactly
    # the runs' own restores, read before the test's restores below add events of their own
    restores = [e for e in read_jsonl(str(run_dir / "events.jsonl")) if e["event"] == "restore"]
    assert len(restores) == 1 and 5 <= restores[0]["step"] < 7, restores  # before the kill

    # The resumed run restored step 5 (batch statistics included) and its final state, restored
    # onto the mesh again, equals the uninterrupted run's bit for bit.
    want, got = _restore(reference, STEPS), _restore(run_dir, STEPS)
    assert sorted(got) == sorted(want)
    stats = [k for k in want if "norm" in k and ("mean" in k or "var" in k)]
    assert len(stats) == 2, f"BatchNorm statistics not in the state: {sorted(want)}"
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert np.any(want[stats[0]] != 0), "batch statistics were never updated"


@pytest.mark.slow
def test_first_step_losses_agree_across_layouts(devices8):
    cfg = _config(steps=1)
    out = {}
    for layout in ("dp8", "fsdp8", "dp2_tp4"):
        job = jaxpar.build(cfg, layout)
        state = job.init()
        _, metrics = job.train_step(state, job.batch(0))
        out[layout] = float(metrics["loss"])
        if layout == "dp2_tp4":  # the user's rule put `hidden` on `tensor`
            w = job.abstract_state["params"]["fc1"]["kernel"]
            assert "tensor" in str(w.sharding.spec), w.sharding
    ref = out["dp8"]
    for loss in out.values():
        assert abs(loss - ref) <= 1e-5 * abs(ref), out


@pytest.mark.slow
def test_own_entrypoint_under_jaxpar_launch(project, reference):
    run_dir = project / "launched"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(project)) if p)
    cmd = [sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", "2", "--devices-per-proc",
           "4", "--no-spares", "--run-dir", str(run_dir), "--", sys.executable, "-m", "my_project.train",
           "--mesh", "data=2,tensor=4", "--steps", "4"]  # fmt: skip
    rc, out = _run(cmd, project, env, timeout=900, run_dir=run_dir)
    assert rc == 0, out[-4000:]
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == [1, 2, 3, 4]
    assert abs(got[1] - want[1]) <= 1e-5 * abs(want[1]), (got, want)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["restarts"] == 0
