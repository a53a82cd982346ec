"""The strategy interface, and what the strategies share.

A strategy is one way of turning a batch into an optimizer step on the mesh: plain SPMD
(`spmd`), a shard_map manual over `data` that reduces gradients once per step (`manual_data`),
the same with a compressed reduction (`compressed`), the pipeline schedule (`pipeline`) and
DiLoCo (`diloco`). `jaxpar.parallel.plan` picks one from the config and the mesh; `jaxpar.parallel.program`
builds the Program around it. What a strategy provides:

    state_shardings()        shardings of "opt" and of any state entries it adds
    init_state(state)        fills "opt" (and its entries) from {"step", "params", "rng"}
    gradients(params, batch, key, extra) -> (loss, aux, grads, extra)
    step(state, batch, key) -> (state, metrics)   default: gradients + optimizer update
    sync_step / sync_every   an optional state -> state program run every `sync_every` steps
    param_rules(...)         (a classmethod) the parameter rules, when its layout needs its own

`extra` holds the state entries the strategy updates besides params and opt: its own
(`extra_keys`) and the model's non-parameter state (`model_state`, jaxpar/engine/model.py) when the
model has any. Everything a strategy needs of the model and config is in its `Context`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.config import TrainConfig
from jaxpar.engine.mesh import DATA
from jaxpar.engine.model import STATE_KEY, ModelDef
from jaxpar.engine.precision import Policy
from jaxpar.engine.rules import Rules, activation_rules

REP = PartitionSpec()  # replicated over the manual axes of a shard_map
ROWS = PartitionSpec(DATA)  # split over `data`: each replica's rows (or its own copy)


@dataclass(frozen=True)
class Context:
    """What every strategy is built from (abstract: nothing is allocated)."""

    cfg: TrainConfig
    mesh: Mesh
    act_rules: Rules
    model: ModelDef  # the abstract model: graph, params, state, rng streams
    prec: Policy
    tx: optax.GradientTransformation
    schedule: Callable | None  # the learning rate by step, when the optimizer is jaxpar's
    task: str
    custom_loss: bool  # the recipe supplies the loss (TrainConfig.loss)
    # (params, model_state, batch, key) -> ((loss, (aux, model_state)), grads)
    value_and_grad: Callable
    param_shardings: dict  # pure dict of NamedShardings
    abstract_params: dict  # pure dict of ShapeDtypeStructs

    @property
    def graphdef(self) -> Any:
        return self.model.graphdef

    @property
    def template(self) -> nnx.State:
        """The model's abstract parameter state."""
        return self.model.params

    @property
    def microbatches(self) -> int:
        return self.cfg.train.microbatches

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def opt_shardings(self, tx: optax.GradientTransformation) -> Any:
        """Shardings of `tx`'s state: moments like their parameters, the rest replicated."""
        abs_opt = jax.eval_shape(tx.init, self.abstract_params)
        return optax.tree_map_params(
            tx, lambda _, s: s, abs_opt, self.param_shardings,
            transform_non_params=lambda _: self.replicated,
        )  # fmt: skip


class Strategy:
    """Plain gradients of the whole batch (accumulated over train.microbatches), then the update.

    Subclasses override `gradients` (and, for extra state, `state_shardings`/`init_state`), or
    `step` itself when the update is theirs too (DiLoCo).
    """

    name = "spmd"
    extra_keys: tuple[str, ...] = ()  # state entries this strategy adds and updates
    metrics_replicated = True  # False: metrics keep a per-replica dimension (no sharding forced)
    sync_every = 0
    sync_step: Callable[[dict], dict] | None = None

    def __init__(self, ctx: Context):
        self.ctx = ctx

    @classmethod
    def param_rules(cls, cfg: TrainConfig, mesh: Mesh, graphdef: Any, template: nnx.State,
                    rules: Rules) -> Rules:  # fmt: skip
        """The parameter rules this strategy trains under (before shardings are built): the
        layout's own, unless its layout of the parameters needs another (the pipeline's uneven
        stages)."""
        return rules

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Entries handed to `gradients` as `extra`: the strategy's and the model's state."""
        return self.extra_keys + ((STATE_KEY,) if self.ctx.model.has_state else ())

    def state_shardings(self) -> dict:
        return {"opt": self.ctx.opt_shardings(self.ctx.tx)}

    def init_state(self, state: dict) -> dict:
        return {**state, "opt": self.ctx.tx.init(state["params"])}

    def gradients(self, params: dict, batch: dict, key: jax.Array, extra: dict):
        loss, aux, grads, mstate = accumulate(
            self.ctx.value_and_grad, params, model_state(extra), batch, key, self.ctx.microbatches
        )
        return loss, aux, grads, with_model_state(extra, mstate)

    def step(self, state: dict, batch: dict, key: jax.Array):
        return self.update(state, *self.state_gradients(state, batch, key))

    def state_gradients(self, state: dict, batch: dict, key: jax.Array):
        """(loss, aux, grads, extra) of `batch` at `state`: the first half of `step`."""
        extra = {k: state[k] for k in self.state_keys}
        with activation_rules(self.ctx.mesh, self.ctx.act_rules):
            return self.gradients(state["params"], batch, key, extra)

    def update(self, state: dict, loss, aux, grads, extra: dict):
        """The optimizer update of `state` by `grads`, and the step's metrics: the second half of
        `step` (replica groups average loss and gradients across groups in between)."""
        ctx = self.ctx
        updates, opt = ctx.tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if ctx.schedule is not None:
            metrics["lr"] = ctx.schedule(state["step"])
        new = {**state, "step": state["step"] + 1, "params": params, "opt": opt, **extra}
        return new, {**metrics, **aux}


def model_state(extra: dict) -> dict:
    """The model's non-parameter state among a strategy's `extra` entries ({} without any)."""
    return extra.get(STATE_KEY, {})


def with_model_state(extra: dict, mstate: dict) -> dict:
    return {**extra, STATE_KEY: mstate} if STATE_KEY in extra else extra


# ---- microbatches --------------------------------------------------------------------------------


def split_microbatches(tree: Any, m: int) -> Any:
    """[B, ...] -> [m, B/m, ...] per leaf. Microbatch i takes every m-th row, so each device keeps
    an equal share of every microbatch (rows are sharded in contiguous blocks): no data moves."""

    def split(x):
        return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, tree)


def join_microbatches(tree: Any) -> Any:
    """Inverse of split_microbatches: [m, B/m, ...] -> [B, ...] per leaf."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def accumulate(value_and_grad: Callable, params: dict, mstate: dict, batch: dict, key, m: int):
    """Mean loss, aux and gradients over m microbatches (a scan: one microbatch live at a time),
    and the model state after the last (each microbatch updates it in turn)."""
    if m == 1:
        (loss, (aux, mstate)), grads = value_and_grad(params, mstate, batch, key)
        return loss, aux, grads, mstate
    mbs = split_microbatches(batch, m)

    def body(carry, i):
        total, mstate = carry
        mb = jax.tree.map(lambda x: x[i], mbs)
        (loss, (aux, mstate)), grads = value_and_grad(
            params, mstate, mb, jax.random.fold_in(key, i)
        )
        return (jax.tree.map(jnp.add, total, (loss, aux, grads)), mstate), None

    mb0 = jax.tree.map(lambda x: x[0], mbs)
    (loss, (aux, _)), g0 = jax.eval_shape(value_and_grad, params, mstate, mb0, key)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss, aux, g0))
    (total, mstate), _ = jax.lax.scan(body, (zeros, mstate), jnp.arange(m))
    return (*jax.tree.map(lambda x: x / m, total), mstate)


# ---- a shard_map manual over `data` ------------------------------------------------------------


def replica_gradients(ctx: Context, params: dict, mstate: dict, batch: dict, key: jax.Array):
    """(loss, aux, grads, model state) of this data replica's rows, accumulated over its
    microbatches.

    Called inside `over_data`: the key folds in the replica index and activation constraints
    leave the manual `data` axis alone. Loss, aux and gradients are not reduced across replicas
    here; the model state's floating leaves (e.g. batch statistics, computed on this replica's
    rows) are averaged over `data`, so every replica keeps the same state.
    """
    key = jax.random.fold_in(key, jax.lax.axis_index(DATA))
    with activation_rules(ctx.mesh, ctx.act_rules, manual=(DATA,)):
        loss, aux, grads, mstate = accumulate(
            ctx.value_and_grad, params, mstate, batch, key, ctx.microbatches
        )

    def mean(x):
        return jax.lax.pmean(x, DATA) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return loss, aux, grads, jax.tree.map(mean, mstate)


def over_data(ctx: Context, local: Callable, in_specs: tuple, out_specs: Any) -> Callable:
    """`local` in a shard_map manual over `data` (fsdp, tensor and pipeline stay automatic).

    Specs are REP (the same on every replica) or ROWS (split over `data`). XLA CPU cannot
    compile this with fsdp and tensor both automatic and > 1: the plan (jaxpar.parallel.plan)
    never picks a data-manual strategy for such a mesh.
    """
    return jax.shard_map(
        local, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs, axis_names={DATA},
        check_vma=False,
    )  # fmt: skip


class OverData(Strategy):
    """Gradients in a shard_map manual over `data` (`over_data`): each replica accumulates its
    own rows' gradients (`replica_gradients`), then `reduce` combines them once per step.

    The strategy's own state entries (`extra_keys`) are per replica, [data, ...] split over
    `data`: `reduce` sees and returns this replica's slice of each (a dict of them).
    """

    def __init__(self, ctx: Context):
        super().__init__(ctx)

        def local(params, mstate, batch, key, own):
            loss, aux, grads, mstate = replica_gradients(ctx, params, mstate, batch, key)
            own = jax.tree.map(lambda r: r[0], own)
            loss, aux, grads, own = self.reduce(loss, aux, grads, own)
            return loss, aux, grads, mstate, jax.tree.map(lambda r: r[None], own)

        self._grads = over_data(ctx, local, (REP, REP, ROWS, REP, ROWS), (REP, REP, REP, REP, ROWS))

    def reduce(self, loss: jax.Array, aux: Any, grads: Any, own: dict):
        """(loss, aux, grads, own) of the whole batch from this replica's: by default one mean
        over `data`."""
        return (*jax.lax.pmean((loss, aux, grads), DATA), own)

    def gradients(self, params: dict, batch: dict, key: jax.Array, extra: dict):
        own = {k: extra[k] for k in self.extra_keys}
        loss, aux, grads, mstate, own = self._grads(params, model_state(extra), batch, key, own)
        return loss, aux, grads, with_model_state({**extra, **own}, mstate)


def merge(graphdef: Any, template: nnx.State, pure: dict) -> Any:
    """A (sub)model rebuilt from a pure dict of its parameters (`template` untouched)."""
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)
