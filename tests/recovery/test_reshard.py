"""Resharded restore: a checkpoint saved on dp8 restores onto data=2,tensor=2 (4 devices), fsdp8
and one device with parameters and optimizer state bitwise equal, and training continues with
the losses of the run that never left dp8 (fp32 tolerance: the reductions differ by layout).
The model is gpt_tiny made small (helpers.SMALL, as in the command-line test below): the point is
the layouts a checkpoint moves between, not the model (sharded by the same rules: its weights
still split over tensor and fsdp).

    python -m pytest tests/recovery/test_reshard.py -m slow
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.recovery.checkpoint import Checkpointer
from jaxpar.rundir.writer import RunDir
from tests.support.helpers import SMALL, cpu_env, losses, ok, run, train_cmd

pytestmark = pytest.mark.slow

SAVED_AT, MORE = 10, 5
TARGETS = ("data=2,tensor=2", "fsdp8", "cpu1")


def host(tree) -> dict:
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def saved_on_dp8(jp, tmp_path_factory):
    """Train dp8 for 10 steps, save, train 5 more: (run dir, host state at 10, losses 11-15)."""
    cfg = apply_overrides(jp.recipe("gpt_tiny", steps=30), list(SMALL[1::2]))
    dp8 = jp.build(cfg, "dp8")
    state, _ = jp.train_steps(dp8, dp8.program.init(), 0, SAVED_AT)
    saved = host(state)
    run = RunDir(str(tmp_path_factory.mktemp("reshard") / "run"))
    ckpt = Checkpointer(run, every=SAVED_AT, keep=2, meta={"config_hash": "gpt_tiny"})
    ckpt.save(SAVED_AT, state)
    ckpt.close()
    _, losses = jp.train_steps(dp8, state, SAVED_AT, MORE)
    return run, saved, losses, cfg


@pytest.mark.parametrize("target", TARGETS)
def test_restore_onto_another_layout_is_bitwise_and_trains_on(jp, saved_on_dp8, target):
    run, saved, dp8_losses, cfg = saved_on_dp8
    built = jp.build(cfg, target)
    assert built.mesh.devices.size == {"data=2,tensor=2": 4, "fsdp8": 8, "cpu1": 1}[target]
    ckpt = Checkpointer(RunDir(run.path), every=0, keep=2, meta={"config_hash": "gpt_tiny"})
    state, meta = ckpt.restore(built.program.abstract_state)
    ckpt.close()
    assert meta["step"] == SAVED_AT and meta["skipped"] == []
    targets = jax.tree.leaves(built.program.abstract_state)
    for got, want in zip(jax.tree.leaves(state), targets, strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    restored = host(state)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(saved), strict=True
    ):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
    _, losses = jp.train_steps(built, state, SAVED_AT, MORE)
    np.testing.assert_allclose(losses, dp8_losses, rtol=2e-5, atol=0)


# ---- the same through `python -m train`, the mesh changing between two runs of one run dir -----


def test_cli_run_dir_resumes_on_another_mesh(ckpt_reference, tmp_path):
    ref = losses(ckpt_reference)  # dp8, 30 steps, saves every 10 (conftest)
    run_dir = tmp_path / "run"
    shutil.copytree(ckpt_reference, run_dir)
    args = (
        "--set",
        "ckpt.every=10",
        *SMALL,
        "--mesh",
        "data=2,tensor=2",
        "--set",
        "ckpt.restore=10",
    )
    ok(run(train_cmd(run_dir, *args, steps=30), cpu_env(devices=4)))
    events = RunDir(str(run_dir)).events()
    (restore,) = [e for e in events if e["event"] == "restore"]
    assert restore["step"] == 10
    assert restore["from_mesh"] == "data=8,fsdp=1,tensor=1,pipeline=1"
    assert restore["to_mesh"] == "data=2,fsdp=1,tensor=2,pipeline=1"
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 31))
    later = range(11, 31)
    np.testing.assert_allclose([got[s] for s in later], [ref[s] for s in later], rtol=1e-4)
