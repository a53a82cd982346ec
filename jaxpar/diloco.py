"""DiLoCo / local SGD: data-parallel replicas train independently and synchronise every H steps.

Each replica along the `data` mesh axis holds its own parameters and inner optimizer state
(stacked on a leading replica dimension, sharded over `data`) and takes H inner steps on its own
rows of the batch with no cross-replica communication. Every H steps the sync step averages the
replicas, treats `anchor - mean` as the outer gradient, applies the outer optimizer (SGD with
Nesterov momentum, as in DiLoCo) to the anchor, and resets every replica to it. fsdp and tensor
sharding apply inside each replica as usual.

    python -m train --set comm.diloco_inner_steps=4

State: {"step", "params" (the anchor), "opt" (inner, per replica), "outer", "replicas", "rng"}.
With H = 1, inner SGD and outer SGD at learning rate 1 without momentum, this is synchronous
data-parallel SGD.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.config import TrainConfig
from jaxpar.precision import policy
from jaxpar.rules import Rules, activation_rules
from jaxpar.step import (
    Program,
    _accumulate,
    _pure,
    abstract_model,
    batch_shardings,
    check_batch,
    finish_program,
    make_eval_step,
    make_optimizer,
    make_value_and_grad,
    param_shardings,
)


def outer_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    mom = cfg.comm.outer_momentum
    return optax.sgd(cfg.comm.outer_lr, momentum=mom or None, nesterov=bool(mom))


def _check(cfg: TrainConfig, mesh: Mesh) -> int:
    if mesh.shape["data"] < 2:
        raise ValueError(
            "comm.diloco_inner_steps needs replicas: a mesh with data >= 2 (e.g. --mesh data=4,fsdp=2)"
        )
    if mesh.shape["pipeline"] > 1 or cfg.comm.compress != "none":
        raise ValueError("DiLoCo does not combine with pipeline parallelism or comm.compress")
    if mesh.shape["fsdp"] > 1 and mesh.shape["tensor"] > 1:
        raise ValueError(
            "DiLoCo runs each replica in a shard_map manual over `data`, which XLA cannot compile "
            "with both fsdp and tensor automatic; use fsdp=1 or tensor=1 inside each replica"
        )
    return mesh.shape["data"]


def _shardings(tx, abs_params, p_sh, mesh: Mesh):
    replicated = NamedSharding(mesh, PartitionSpec())
    stacked = jax.tree.map(lambda sh: NamedSharding(mesh, PartitionSpec("data", *sh.spec)), p_sh)

    def non_param(x):
        return NamedSharding(mesh, PartitionSpec("data")) if x.ndim else replicated

    abs_stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), abs_params)
    abs_opt = jax.eval_shape(jax.vmap(tx.init), abs_stacked)
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, abs_opt, stacked, transform_non_params=non_param
    )
    return stacked, opt_sh


def build_program(
    cfg: TrainConfig, mesh: Mesh, param_rules: Rules, act_rules: Rules, batch_spec: dict, task: str
) -> Program:
    """Init, inner train step, sync step and eval step of DiLoCo on `mesh`."""
    n = _check(cfg, mesh)
    seed, m, h = cfg.train.seed, cfg.train.microbatches, cfg.comm.diloco_inner_steps
    check_batch(cfg.data.global_batch, m, mesh)
    graphdef, template = abstract_model(cfg)
    prec = policy(cfg.precision)
    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps)
    outer_tx = outer_optimizer(cfg)
    replicated = NamedSharding(mesh, PartitionSpec())
    p_sh = param_shardings(template, param_rules, mesh)
    abs_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), _pure(template))
    stacked_sh, opt_sh = _shardings(tx, abs_params, p_sh, mesh)
    outer_sh = optax.tree_map_params(
        outer_tx, lambda _, s: s, jax.eval_shape(outer_tx.init, abs_params), p_sh,
        transform_non_params=lambda _: replicated,
    )  # fmt: skip
    state_sh = {
        "step": replicated, "params": p_sh, "opt": opt_sh, "outer": outer_sh,
        "replicas": stacked_sh, "rng": replicated,
    }  # fmt: skip
    b_sh = batch_shardings(batch_spec, act_rules, mesh)

    def init():
        params = _pure(nnx.state(cfg.model.build(nnx.Rngs(params=seed)), nnx.Param))
        replicas = jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), params)
        rng = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 0x5EED))
        return {
            "step": jnp.zeros((), jnp.int32), "params": params, "opt": jax.vmap(tx.init)(replicas),
            "outer": outer_tx.init(params), "replicas": replicas, "rng": rng,
        }  # fmt: skip

    value_and_grad = make_value_and_grad(graphdef, template, task, prec)
    inner = _inner_step(value_and_grad, tx, mesh, act_rules, m)

    def train_step(state, batch, poison):
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        replicas, opt, metrics = inner(state["replicas"], state["opt"], batch, key, poison)
        metrics["lr"] = schedule(state["step"])
        return {**state, "step": state["step"] + 1, "replicas": replicas, "opt": opt}, metrics

    def sync_step(state):
        mean = jax.tree.map(lambda r: jnp.mean(r, axis=0), state["replicas"])
        delta = jax.tree.map(jnp.subtract, state["params"], mean)  # the outer "gradient"
        updates, outer = outer_tx.update(delta, state["outer"], state["params"])
        anchor = optax.apply_updates(state["params"], updates)
        replicas = jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), anchor)
        return {**state, "params": anchor, "outer": outer, "replicas": replicas}

    sync = jax.jit(sync_step, in_shardings=(state_sh,), out_shardings=state_sh, donate_argnums=0)
    # Metrics keep their leading replica dimension (sharded over `data`): no sharding forced.
    return finish_program(
        mesh, graphdef, template, state_sh, b_sh, init, train_step,
        make_eval_step(graphdef, template, mesh, act_rules, task, prec), schedule, task,
        metrics_sharding=None, sync_step=sync, sync_every=h,
    )  # fmt: skip


def _inner_step(value_and_grad, tx, mesh: Mesh, act_rules: Rules, m: int):
    """One optimizer step on every replica's own rows; no collective crosses `data`."""

    def local(replicas, opt, batch, key, poison):
        params = jax.tree.map(lambda r: r[0], replicas)
        opt = jax.tree.map(lambda o: o[0] if o.ndim else o, opt)
        key = jax.random.fold_in(key, jax.lax.axis_index("data"))
        with activation_rules(mesh, act_rules, manual=("data",)):
            loss, aux, grads = _accumulate(value_and_grad, params, batch, key, m)
        loss, grads = loss * poison, jax.tree.map(lambda g: g * poison, grads)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        add = lambda x: x[None]  # noqa: E731
        return jax.tree.map(add, params), jax.tree.map(add, opt), jax.tree.map(add, metrics)

    data, rep = PartitionSpec("data"), PartitionSpec()
    return jax.shard_map(
        local, mesh=mesh, in_specs=(data, data, data, rep, rep), out_specs=(data, data, data),
        axis_names={"data"}, check_vma=False,
    )  # fmt: skip
