"""What the library API records in the run directory for a loop of one's own (docs/api.md): the
`restore` event of `CheckpointManager.restore`, a job's incarnation (`start`, `restore` with its
tier, `compiled`, `done`) and its local snapshots, and `lr` with a recipe's own optimizer."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar.recovery.checkpoint import CheckpointMismatch
from jaxpar.rundir.runlog import read_jsonl
from jaxpar.train.recipes import digits_mlp
from jaxpar.worker import bootstrap, training

MESH = "data=2,tensor=4"
SCHEDULE = optax.linear_schedule(0.01, 0.001, 10)


def _cfg(steps: int, tmp_path, **changes) -> jaxpar.TrainConfig:
    cfg = jaxpar.apply_overrides(
        digits_mlp(),
        [f"train.steps={steps}", "model.hidden=32", "ckpt.every=2", "ckpt.use_async=false",
         f"ckpt.local_dir={tmp_path / 'ram'}", "log.progress=false", "train.eval_every=0"],
    )  # fmt: skip
    return dataclasses.replace(cfg, **changes)


def _events(run_dir, name: str | None = None) -> list[dict]:
    events = read_jsonl(str(run_dir / "events.jsonl"))
    return [e for e in events if name is None or e["event"] == name]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return jaxpar.build(_cfg(6, tmp_path_factory.mktemp("cfg")), MESH)


def test_restore_writes_a_restore_event(job, tmp_path):
    run_dir = tmp_path / "run"
    state = job.init()
    with jaxpar.CheckpointManager(str(run_dir), config=job.cfg, use_async=False) as ckpt:
        ckpt.save(2, state)
    with jaxpar.CheckpointManager(str(run_dir), config=job.cfg) as ckpt:
        assert ckpt.restore(job.abstract_state) is not None
    (restore,) = _events(run_dir, "restore")
    assert restore["step"] == 2 and restore["tier"] == "persistent"
    assert restore["to_mesh"] == "data=2,fsdp=1,tensor=4,pipeline=1" and restore["to_nproc"] == 1


def _steps(ckpt, job, state, upto: int) -> dict:
    for step in range(int(state["step"]), upto):
        state = ckpt.before_step(step, state)
        state, metrics = job.train_step(state, job.batch(step))
        line = job.metrics_line(step + 1, jax.device_get(metrics), 0.01, state)
        ckpt.run.metrics(line)
        ckpt.after_step(step + 1, state)
    return state


def test_a_job_records_its_incarnations_and_restores_its_local_snapshot(job, tmp_path):
    run_dir = tmp_path / "run"
    with jaxpar.CheckpointManager(str(run_dir), job=job, local=True) as ckpt:
        state = ckpt.restore_or_init()
        _steps(ckpt, job, state, 3)  # stops short of train.steps (6): snapshot 3, checkpoint 2
    names = [e["event"] for e in _events(run_dir)]
    assert [n for n in names if n in ("start", "restore", "compiled", "done")] == [
        "start", "compiled", "done"
    ]  # fmt: skip
    done = _events(run_dir, "done")[0]
    assert (done["step"], done["complete"]) == (3, False)
    assert (run_dir / "config.json").is_file() and (run_dir / "checkpoints" / "2").is_dir()

    with jaxpar.CheckpointManager(str(run_dir), job=job, local=True) as ckpt:
        state = ckpt.restore_or_init()
        assert int(state["step"]) == 3
        _steps(ckpt, job, state, 6)
    restore = _events(run_dir, "restore")[-1]
    assert (restore["incarnation"], restore["step"], restore["tier"]) == (1, 3, "local")
    compiled = _events(run_dir, "compiled")
    assert compiled[-1]["incarnation"] == 1 and compiled[-1]["hits"] >= 1  # RUN_DIR/compiled
    assert _events(run_dir, "done")[-1]["complete"] is True
    summary = (run_dir / "summary.json").read_text()  # not under jaxpar launch
    assert '"steps": 6' in summary


def test_a_refused_run_writes_nothing(job, tmp_path):
    run_dir = tmp_path / "run"
    with jaxpar.CheckpointManager(str(run_dir), config=job.cfg, use_async=False) as ckpt:
        ckpt.save(2, job.init())
    before = sorted(os.listdir(run_dir)), (run_dir / "events.jsonl").read_bytes()
    other = jaxpar.build(dataclasses.replace(job.cfg, optim=dataclasses.replace(
        job.cfg.optim, lr=0.5)), MESH)  # fmt: skip
    with pytest.raises(CheckpointMismatch, match="another model/optimizer/data config"):
        jaxpar.CheckpointManager(str(run_dir), job=other)
    assert (sorted(os.listdir(run_dir)), (run_dir / "events.jsonl").read_bytes()) == before


def test_build_takes_the_layout_of_a_shrunk_job(monkeypatch, tmp_path):
    monkeypatch.setenv(bootstrap.ENV_MESH, "data=2,tensor=2")  # what jaxpar launch sets
    monkeypatch.setenv(bootstrap.ENV_MICROBATCHES, "2")
    job = jaxpar.build(_cfg(2, tmp_path), MESH, devices=jax.devices()[:4])
    assert dict(job.mesh.shape) == {
        "data": 2, "fsdp": 1, "tensor": 2, "pipeline": 1, "context": 1, "expert": 1
    }  # fmt: skip
    assert job.cfg.train.microbatches == 2


def test_a_manager_without_a_job_has_no_local_tier(tmp_path):
    with pytest.raises(ValueError, match=r"job=jaxpar.build\(cfg, mesh\), local=True"):
        jaxpar.CheckpointManager(str(tmp_path / "run"), local=True)


def test_lr_of_a_recipe_optimizer_is_recorded(tmp_path):
    """A recipe's own optax optimizer: jaxpar has no schedule of its own, so the step returns no
    `lr`; an `inject_hyperparams` optimizer state holds it, and the metrics line takes it there."""
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE)
    cfg = _cfg(3, tmp_path, optimizer=tx)
    job = jaxpar.build(cfg, MESH)
    state = job.init()
    state, metrics = job.train_step(state, job.batch(0))
    assert "lr" not in metrics
    line = job.metrics_line(1, jax.device_get(metrics), 0.01, state)
    assert line["lr"] == pytest.approx(float(SCHEDULE(0)))

    training.run(cfg, jaxpar.preset(MESH), str(tmp_path / "train"))  # `jaxpar train`'s loop
    lines = [m for m in read_jsonl(str(tmp_path / "train" / "metrics.jsonl")) if "loss" in m]
    want = [float(SCHEDULE(i)) for i in range(3)]
    np.testing.assert_allclose([m["lr"] for m in lines], want, rtol=1e-6)
