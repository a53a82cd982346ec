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
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import TrainConfig
from jaxpar.engine.mesh import DATA
from jaxpar.engine.model import STATE_KEY
from jaxpar.parallel.base import (
    REP,
    ROWS,
    Context,
    Strategy,
    over_data,
    replica_gradients,
)


def outer_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    mom = cfg.comm.outer_momentum
    return optax.sgd(cfg.comm.outer_lr, momentum=mom or None, nesterov=bool(mom))


class DiLoCo(Strategy):
    """Per-replica inner steps (its own update), and the outer step as `sync_step`."""

    name = "diloco"
    metrics_replicated = False  # metrics keep their leading replica dimension (sharded over data)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.n = ctx.mesh.shape[DATA]
        self.sync_every = ctx.cfg.comm.diloco_inner_steps
        self.outer_tx = outer_optimizer(ctx.cfg)
        self._inner = self._inner_step()

    def state_shardings(self) -> dict:
        ctx, mesh = self.ctx, self.ctx.mesh
        stacked = jax.tree.map(
            lambda sh: NamedSharding(mesh, PartitionSpec(DATA, *sh.spec)), ctx.param_shardings
        )

        def non_param(x):
            return NamedSharding(mesh, PartitionSpec(DATA)) if x.ndim else ctx.replicated

        abs_stacked = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), ctx.abstract_params
        )
        abs_opt = jax.eval_shape(jax.vmap(ctx.tx.init), abs_stacked)
        opt = optax.tree_map_params(
            ctx.tx, lambda _, s: s, abs_opt, stacked, transform_non_params=non_param
        )
        return {"opt": opt, "outer": ctx.opt_shardings(self.outer_tx), "replicas": stacked}

    def init_state(self, state: dict) -> dict:
        params = state["params"]
        replicas = jax.tree.map(lambda p: jnp.broadcast_to(p, (self.n, *p.shape)), params)
        return {
            **state, "opt": jax.vmap(self.ctx.tx.init)(replicas),
            "outer": self.outer_tx.init(params), "replicas": replicas,
        }  # fmt: skip

    def step(self, state, batch, key):
        mstate = state.get(STATE_KEY, {})
        replicas, opt, mstate, metrics = self._inner(
            state["replicas"], state["opt"], mstate, batch, key
        )
        if self.ctx.schedule is not None:
            metrics["lr"] = self.ctx.schedule(state["step"])
        new = {**state, "step": state["step"] + 1, "replicas": replicas, "opt": opt}
        if STATE_KEY in state:  # the model's state is shared: averaged over replicas each step
            new[STATE_KEY] = mstate
        return new, metrics

    def sync_step(self, state: dict) -> dict:
        """Average the replicas, an outer step on the anchor, every replica reset to it."""
        return self.outer_step(state, self.replica_mean(state))

    def replica_mean(self, state: dict) -> dict:
        """The replicas' mean parameters (replica groups average it across groups too)."""
        return jax.tree.map(lambda r: jnp.mean(r, axis=0), state["replicas"])

    def outer_step(self, state: dict, mean: dict) -> dict:
        """The outer step from the replicas' `mean`; every replica reset to the new anchor."""
        delta = jax.tree.map(jnp.subtract, state["params"], mean)  # the outer "gradient"
        updates, outer = self.outer_tx.update(delta, state["outer"], state["params"])
        anchor = optax.apply_updates(state["params"], updates)
        replicas = jax.tree.map(lambda p: jnp.broadcast_to(p, (self.n, *p.shape)), anchor)
        return {**state, "params": anchor, "outer": outer, "replicas": replicas}

    def _inner_step(self):
        """One optimizer step on every replica's own rows; no collective crosses `data`."""
        ctx = self.ctx

        def local(replicas, opt, mstate, batch, key):
            params = jax.tree.map(lambda r: r[0], replicas)
            opt = jax.tree.map(lambda o: o[0] if o.ndim else o, opt)
            loss, aux, grads, mstate = replica_gradients(ctx, params, mstate, batch, key)
            updates, opt = ctx.tx.update(grads, opt, params)
            params = optax.apply_updates(params, updates)
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
            add = lambda x: x[None]  # noqa: E731
            return (
                jax.tree.map(add, params), jax.tree.map(add, opt), mstate,
                jax.tree.map(add, metrics),
            )  # fmt: skip

        return over_data(ctx, local, (ROWS, ROWS, REP, ROWS, REP), (ROWS, ROWS, REP, ROWS))
