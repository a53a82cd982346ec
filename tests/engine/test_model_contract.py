"""A model written the way Flax's guides write one, trained by the engine as is.

The model (below) holds BatchNorm statistics and a Dropout stream, is called as `model(x)`,
annotates its parameters with `nnx.with_partitioning` and names a logical axis jaxpar does not
know (`hidden`), for which the recipe supplies a rule. The recipe also gives its own loss (with
an accuracy metric) and its own optax chain. Checked: the same first-step loss, metrics and
batch statistics on several layouts, state sharded by the rules, exact resume through a
checkpoint, evaluation in eval mode, Flax's eager sharding left as Flax ships it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.config import CkptConfig, DataConfig, LogConfig, TrainConfig, TrainLoopConfig
from jaxpar.engine.model import STATE_KEY
from jaxpar.rundir.runlog import read_jsonl
from jaxpar.worker import training

HIDDEN = 32


class Net(nnx.Module):
    """Flax-style: Linear + BatchNorm + Dropout, `__call__(x)`, streams from the constructor."""

    def __init__(self, rngs: nnx.Rngs, dropout: float):
        part = nnx.with_partitioning
        self.fc1 = nnx.Linear(
            64,
            HIDDEN,
            rngs=rngs,
            kernel_init=part(nnx.initializers.lecun_normal(), (None, "hidden")),
        )
        self.bn = nnx.BatchNorm(HIDDEN, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.fc2 = nnx.Linear(
            HIDDEN,
            10,
            rngs=rngs,
            kernel_init=part(nnx.initializers.lecun_normal(), ("hidden", None)),
        )
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))  # a counter: non-parameter state

    def __call__(self, x):
        self.calls[...] += 1
        h = self.drop(nnx.relu(self.bn(self.fc1(x.reshape(x.shape[0], -1)))))
        return self.fc2(h)


@dataclass(frozen=True)
class NetConfig:
    dropout: float = 0.2

    def build(self, rngs: nnx.Rngs) -> Net:
        return Net(rngs, self.dropout)


def my_loss(model, batch, rngs):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"acc": (logits.argmax(-1) == batch["label"]).mean()}


def my_optimizer(total_steps: int) -> optax.GradientTransformation:
    lr = optax.linear_schedule(0.05, 0.01, total_steps)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(lr, momentum=0.9))


def recipe(steps: int = 3, **changes) -> TrainConfig:
    cfg = TrainConfig(
        model=NetConfig(), name="flax_net",
        data=DataConfig(source="digits", global_batch=32),
        train=TrainLoopConfig(steps=steps, eval_batches=1),
        log=LogConfig(progress=False), ckpt=CkptConfig(every=2, use_async=False),
        loss=my_loss, optimizer=my_optimizer, rules=(("hidden", "tensor"),),
    )  # fmt: skip
    return dataclasses.replace(cfg, **changes)


@pytest.fixture(scope="module")
def one_step(jp):
    """layout -> (built program, state after one step, its metrics, eval metrics)."""
    cache = {}

    def get(layout: str):
        if layout not in cache:
            b = jp.build(recipe(), layout)
            state = b.program.init()
            batch = jp.device_batch(b, 0)
            evals = jax.device_get(b.program.eval_step(state, batch))
            state, metrics = b.program.train_step(state, batch)
            cache[layout] = (b, jax.device_get(state), jax.device_get(metrics), evals)
        return cache[layout]

    return get


def test_flax_default_eager_sharding_is_left_alone():
    import jaxpar.parallel.program  # noqa: F401, PLC0415 - importing the engine must not flip Flax's flag

    assert flax.config.flax_always_shard_variable is True


def test_state_groups_and_shardings(one_step):
    b, state, metrics, _ = one_step("dp2_tp4")
    mstate = state[STATE_KEY]
    assert set(mstate) == {"bn", "calls"}, mstate.keys()
    assert int(mstate["calls"]) == 1  # updated by the step (one call)
    assert not np.allclose(mstate["bn"]["mean"], 0.0)  # batch statistics moved
    # The recipe's rule shards `hidden` over tensor; BatchNorm's unannotated state is replicated.
    assert b.program.state_shardings["params"]["fc1"]["kernel"].spec == jax.P(None, "tensor")
    assert b.program.state_shardings[STATE_KEY]["bn"]["mean"].spec == jax.P()
    # The optax chain's momentum is sharded like its parameter.
    trace = optax.tree_utils.tree_get(b.program.state_shardings["opt"], "trace")
    assert trace["fc2"]["kernel"].spec == jax.P("tensor", None)
    assert set(metrics) == {"loss", "grad_norm", "acc"}  # no lr: the schedule is the recipe's


@pytest.mark.parametrize("layout", ["dp8", "fsdp8", "dp2_tp4"])
def test_layouts_agree_with_one_device(one_step, layout):
    _, ref_state, ref, ref_eval = one_step("cpu1")
    _, state, got, got_eval = one_step(layout)
    for k in ("loss", "acc"):
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_eval[k], ref_eval[k], rtol=1e-5, atol=1e-6)
    for k in ("mean", "var"):
        np.testing.assert_allclose(
            state[STATE_KEY]["bn"][k], ref_state[STATE_KEY]["bn"][k], rtol=1e-5, atol=1e-6
        )


def test_eval_runs_in_eval_mode_and_dropout_is_keyed_by_step(one_step, jp):
    b, _, _, evals = one_step("cpu1")
    state = b.program.init()
    batch = jp.device_batch(b, 0)
    # Eval: running averages, no dropout: deterministic and not the training loss.
    again = jax.device_get(b.program.eval_step(state, batch))
    assert evals["loss"] == again["loss"] and set(evals) == {"loss", "acc"}
    _, m0 = b.program.train_step(b.program.init(), batch)
    _, m0b = b.program.train_step(b.program.init(), batch)
    assert float(m0["loss"]) == float(m0b["loss"])  # same step, same dropout mask
    shifted = b.program.init()
    shifted["step"] = shifted["step"] + 1  # another step: another mask on the same batch
    _, m1 = b.program.train_step(shifted, batch)
    assert float(m1["loss"]) != float(m0["loss"])
    assert float(m0["loss"]) != float(evals["loss"])


# A transformation given as is (its schedule does not follow train.steps, so a run stopped at
# step 2 and extended to 4 trains exactly like one run of 4 steps).
FIXED_TX = optax.chain(
    optax.clip_by_global_norm(1.0), optax.sgd(optax.linear_schedule(0.05, 0.01, 4), momentum=0.9)
)


@pytest.mark.slow
def test_resume_is_exact_and_restores_the_batch_statistics(jp, tmp_path):
    preset = jp.preset("dp2_tp4")
    training.run(recipe(steps=4, optimizer=FIXED_TX), preset, str(tmp_path / "full"))
    part = tmp_path / "part"
    training.run(recipe(steps=2, optimizer=FIXED_TX), preset, str(part))  # saves at step 2
    training.run(recipe(steps=4, optimizer=FIXED_TX), preset, str(part))  # resumes from step 2

    def losses(run_dir):
        return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}

    assert losses(tmp_path / "full")[3] == losses(part)[3]
    assert losses(tmp_path / "full")[4] == losses(part)[4]  # bitwise, not close
    assert "acc" in read_jsonl(part / "metrics.jsonl")[-1]
    b = jp.build(recipe(steps=4, optimizer=FIXED_TX), "dp2_tp4")
    from jaxpar.recovery.checkpoint import Checkpointer  # noqa: PLC0415
    from jaxpar.rundir.writer import RunDir

    states = []
    for run_dir in (tmp_path / "full", part):
        ck = Checkpointer(RunDir(str(run_dir), 0), every=0, keep=3, meta={}, use_async=False)
        state, _ = ck.restore(b.program.abstract_state, which="4", force=True)
        states.append(jax.device_get(state[STATE_KEY]))
        ck.close()
    jax.tree.map(np.testing.assert_array_equal, *states)
    assert int(states[0]["calls"]) == 4


def test_unknown_logical_name_without_a_rule_names_the_fix(jp):
    with pytest.raises(ValueError, match=r"unknown logical axis 'hidden'.*TrainConfig.rules"):
        jp.build(recipe(rules=()), "dp2_tp4")


def test_pipeline_refuses_a_model_with_state(jp):
    with pytest.raises(ValueError, match=r"pipeline > 1 trains models whose variables are all"):
        jp.build(recipe(), "pp2")
