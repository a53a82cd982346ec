"""gpt_moe on expert-parallel layouts: the losses of the dense reference (dp8) within 1e-5 when no
token is dropped, composed with a pipeline, and checkpoints resharded between expert layouts.
(fsdp and tensor with the expert axis: tests/engine/test_experts.py, at the layer.)

    python -m pytest tests/parallel/test_moe.py -m slow -s
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.recovery.checkpoint import Checkpointer
from jaxpar.rundir.writer import RunDir

pytestmark = pytest.mark.slow

STEPS = 3
# gpt_moe made small; a capacity of every token (no token dropped) for the parity runs.
SMALL = ("model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.d_mlp=64",
         "model.seq_len=32", "data.seq_len=32", "data.global_batch=16",
         "model.capacity_factor=4.0")  # fmt: skip
NO_AUX = ("model.moe_aux_weight=0", "model.router_z_weight=0")


def config(jp, *extra: str):
    return apply_overrides(jp.recipe("gpt_moe", steps=STEPS), [*SMALL, *extra])


@pytest.fixture(scope="module")
def dense_reference(jp):
    c = jp.compile_layout(config(jp), "dp8")
    return jp.train(c)


@pytest.fixture(scope="module")
def expert4(jp):
    return jp.compile_layout(config(jp), "data=2,expert=4")


def test_expert_parallel_matches_dense_reference(jp, dense_reference, expert4):
    kinds = {(x.kind, x.mesh_axes) for x in expert4.colls}
    assert ("all-to-all", ("expert",)) in kinds, kinds
    got = jp.train(expert4)
    print(f"\n[moe] data=2,expert=4 {got.losses} dp8 {dense_reference.losses}")
    assert jp.max_rel(got.losses, dense_reference.losses) <= 1e-5
    assert jp.max_abs_tree(got.grads, dense_reference.grads) <= 2e-6


def test_pipeline_refuses_auxiliary_losses_it_cannot_add(jp):
    """The MoE layers run inside a pipeline's stages (tests/engine/test_experts.py runs them in
    a shard_map manual over data and pipeline), but the pipeline computes the loss itself."""
    with pytest.raises(ValueError, match=r"cannot add the MoE auxiliary losses.*pipeline=1"):
        jp.build(config(jp), "data=2,expert=2,pipeline=2")  # as the program is built


def _steps(jp, built, train_step, state, start: int, n: int):
    losses = []
    for step in range(start, start + n):
        state, m = train_step(state, jp.device_batch(built, step))
        losses.append(float(m["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def saved_on_expert4(jp, expert4, tmp_path_factory):
    """data=2,expert=4: two steps, a checkpoint, one more step (its loss is the reference). From
    the config's initial state (the dense reference's, copied: no init program of its own)."""
    built, cfg = expert4.built, expert4.built.cfg
    state, _ = _steps(jp, built, expert4.step, jp.initial_state(built), 0, 2)
    run = RunDir(str(tmp_path_factory.mktemp("moe-reshard") / "run"))
    ckpt = Checkpointer(run, every=2, keep=1, meta={"config_hash": "gpt_moe"})
    ckpt.save(2, state)
    ckpt.close()
    _, losses = _steps(jp, built, expert4.step, state, 2, 1)
    return run, cfg, losses


@pytest.mark.parametrize("target", ["data=4,expert=2", "fsdp8"])
def test_checkpoint_reshards_between_expert_layouts(jp, saved_on_expert4, target):
    run, cfg, ref = saved_on_expert4
    built = jp.build(cfg, target)
    ckpt = Checkpointer(RunDir(run.path), every=0, keep=1, meta={"config_hash": "gpt_moe"})
    state, meta = ckpt.restore(built.program.abstract_state)
    ckpt.close()
    assert meta["step"] == 2
    w_in = state["params"]["blocks"]["moe"]["w_in"]  # [layers, E, D, F]
    want = built.program.abstract_state["params"]["blocks"]["moe"]["w_in"].sharding
    assert w_in.sharding.is_equivalent_to(want, w_in.ndim)
    _, losses = _steps(jp, built, built.program.train_step, state, 2, 1)
    print(f"\n[moe] restored on {target}: {losses} saved layout {ref}")
    np.testing.assert_allclose(losses, ref, rtol=1e-6, atol=0)
    assert jax.tree.structure(state) == jax.tree.structure(built.program.abstract_state)
