"""The sharded train and eval steps: state shardings from the rules, donation, the Program.

One path for every layout: abstract model -> parameter shardings (rules) -> optimizer -> the
strategy that jaxpar/parallel/plan.py picks for the config and mesh -> init, train, eval (and
sync) steps, jitted with explicit shardings.

The training state is a plain pytree, so checkpoints and shardings need nothing model-specific:

    {"step": int32[], "params": {...}, "opt": optax state, "rng": uint32[2], ...strategy's}

`params` is the model's nnx.Param state as a pure dict; `opt` mirrors it (Adam moments shard
like their parameters). The model graph is rebuilt inside the traced step with `nnx.merge`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.config import OptimConfig, TrainConfig
from jaxpar.engine import attention, experts
from jaxpar.engine import model as model_lib
from jaxpar.engine.losses import LossFn, check_output, loss_for
from jaxpar.engine.mesh import BATCH_AXES, batch_parallel_size
from jaxpar.engine.model import STATE_KEY, ModelDef
from jaxpar.engine.precision import FP32, Policy, policy
from jaxpar.engine.rules import (
    Rules,
    activation_rules,
    logical_to_spec,
    named_sharding,
    validate_rules,
)
from jaxpar.parallel import plan
from jaxpar.parallel.base import Context

BATCH_LOGICAL = {
    "inputs": ("batch", "seq"),
    "targets": ("batch", "seq"),
    "image": ("batch", "height", "width", None),
    "label": ("batch",),
}


def optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, Callable | None]:
    """(transformation, learning-rate schedule or None): the recipe's own optax transformation
    (TrainConfig.optimizer: a GradientTransformation, or total_steps -> one), else `optim`'s."""
    custom = cfg.optimizer
    if custom is None:
        return make_optimizer(cfg.optim, cfg.train.steps)
    tx = custom
    if not isinstance(tx, optax.GradientTransformation) and callable(tx):
        tx = tx(cfg.train.steps)
    if not isinstance(tx, optax.GradientTransformation):
        raise ValueError(
            f"TrainConfig.optimizer is a {type(custom).__name__}; give an optax "
            f"GradientTransformation (or a function total_steps -> one), or None for `optim`"
        )
    return tx, None


def decay_horizon(cfg: OptimConfig, total_steps: int) -> int:
    """The step the learning rate's cosine decay ends at: optim.decay_steps, else the run's
    length (the one way a run's length reaches its train step)."""
    return cfg.decay_steps or max(total_steps, cfg.warmup_steps + 1)


def make_optimizer(
    cfg: OptimConfig, total_steps: int
) -> tuple[optax.GradientTransformation, Callable]:
    """optax chain: global-norm clipping, then adamw (or sgd) on a warmup + cosine schedule."""
    decay = decay_horizon(cfg, total_steps)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, decay, end_value=cfg.lr * cfg.min_lr_ratio
    )
    if cfg.name == "adamw":
        # Biases and norm scales (1-D) are not decayed.
        mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
        opt = optax.adamw(schedule, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    elif cfg.name == "sgd":
        opt = optax.sgd(schedule, momentum=cfg.momentum or None)
    else:
        raise ValueError(f"optim.name={cfg.name!r}: use 'adamw' or 'sgd'")
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    return optax.chain(*parts, opt), schedule


@dataclass
class Program:
    """Everything compiled for one (config, mesh): shardings, init, train and eval steps."""

    mesh: Mesh
    graphdef: Any
    param_template: Any  # abstract nnx.State of the model's parameters
    model: ModelDef  # the abstract model: parameters, non-parameter state, rng streams
    loss: LossFn  # loss(model, batch, rngs) -> (loss, metrics): the recipe's or built in
    state_shardings: dict
    batch_shardings: dict
    abstract_state: dict  # ShapeDtypeStructs carrying the target shardings
    param_logical: dict  # pure dict: parameter path -> logical axis names
    init: Callable[[], dict]
    # params -> the state `init` would make around them (its optimizer state, step and rng):
    # a run that starts from given weights (jaxpar.hf); the params are donated
    init_from: Callable[[dict], dict]
    train_step: Callable[[dict, dict], tuple[dict, dict]]
    eval_step: Callable[[dict, dict], dict]
    schedule: Callable | None  # learning rate by step (None: the recipe's own optimizer)
    task: str
    # DiLoCo / local SGD (jaxpar/parallel/diloco.py): state -> state, run after every
    # `sync_every` steps
    sync_step: Callable[[dict], dict] | None = None
    sync_every: int = 0
    strategy: str = "spmd"  # the jaxpar.parallel strategy (plan.STRATEGIES)
    # (impl, ring size) of each attention call, on a mesh that splits the sequence (else ())
    attention: tuple = ()
    # the strategy object: its two halves of a step (state_gradients, update) for replica groups
    parts: Any = None


def _pure(state: nnx.State) -> dict:
    return nnx.to_pure_dict(state)


def param_logical_axes(param_template: nnx.State) -> dict:
    """Pure dict of parameter path -> logical names (None where the model gave none)."""
    logical = jax.tree.map(
        lambda v: v.get_metadata().get("out_sharding"),
        param_template,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    return nnx.to_pure_dict(logical) if isinstance(logical, nnx.State) else logical


def param_shardings(param_template: nnx.State, rules: Rules, mesh: Mesh) -> dict:
    """Validated NamedSharding per variable (pure dict), from its logical names and the rules
    (parameters, and the model's other state alike)."""

    def one(path, v):
        names = v.get_metadata().get("out_sharding")
        return named_sharding(jax.tree_util.keystr(path), v.shape, names, rules, mesh)

    out = jax.tree_util.tree_map_with_path(
        one, param_template, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )
    return nnx.to_pure_dict(out) if isinstance(out, nnx.State) else out


def batch_shardings(example: dict, act_rules: Rules, mesh: Mesh) -> dict:
    out = {}
    for k, v in example.items():
        logical = BATCH_LOGICAL.get(k, ("batch",) + (None,) * (len(v.shape) - 1))
        out[k] = NamedSharding(mesh, logical_to_spec(logical[: len(v.shape)], act_rules, mesh))
    return out


def check_batch(global_batch: int, microbatches: int, mesh: Mesh) -> None:
    ways = batch_parallel_size(mesh)
    if global_batch % ways:
        raise ValueError(
            f"global batch {global_batch} is not divisible by the data-parallel size {ways} "
            f"(mesh axes {BATCH_AXES} = {[mesh.shape[a] for a in BATCH_AXES]}); set "
            f"--set data.global_batch to a multiple of {ways} or change the mesh"
        )
    if microbatches < 1 or global_batch % (ways * microbatches):
        raise ValueError(
            f"train.microbatches={microbatches} must divide the per-replica batch "
            f"{global_batch // ways} (global batch {global_batch} / data-parallel size {ways})"
        )


def build_program(
    cfg: TrainConfig, mesh: Mesh, param_rules: Rules, act_rules: Rules, batch_spec: dict, task: str
) -> Program:
    """Compile-ready init, train, eval (and sync) steps for `cfg` on `mesh`; nothing is allocated.

    The strategy (jaxpar/parallel/plan.py) decides how gradients are computed and applied; this
    function is the same for all of them.
    """
    strategy_cls = plan.choose(cfg, mesh)
    m = cfg.train.microbatches
    check_batch(cfg.data.global_batch, m, mesh)
    seed = cfg.train.seed
    param_rules, act_rules = with_recipe_rules(cfg, param_rules, act_rules)
    mdef = model_lib.abstract(cfg.model, seed)
    template = mdef.params
    param_rules = strategy_cls.param_rules(cfg, mesh, mdef.graphdef, template, param_rules)
    experts.check_mesh(template, mesh.shape)
    prec = policy(cfg.precision)
    tx, schedule = optimizer(cfg)
    loss = loss_for(cfg.loss, task)
    replicated = NamedSharding(mesh, PartitionSpec())
    ctx = Context(
        cfg=cfg, mesh=mesh, act_rules=act_rules, model=mdef, prec=prec, tx=tx,
        schedule=schedule, task=task, custom_loss=cfg.loss is not None,
        value_and_grad=make_value_and_grad(mdef, loss, prec),
        param_shardings=param_shardings(template, param_rules, mesh),
        abstract_params=jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), _pure(template)
        ),
    )  # fmt: skip
    # A mesh that splits the sequence: the model must run its attention through jaxpar's.
    attention_calls = attention.check_model(
        lambda: jax.eval_shape(
            make_loss(mdef, loss, prec), ctx.abstract_params, _pure(mdef.state), batch_spec,
            jax.random.key(0),
        ),
        mesh, act_rules,
    )  # fmt: skip
    strategy = strategy_cls(ctx)
    state_sh = {
        "step": replicated, "params": ctx.param_shardings, "rng": replicated,
        **strategy.state_shardings(),
    }  # fmt: skip
    if mdef.has_state:
        state_sh[STATE_KEY] = param_shardings(mdef.state, param_rules, mesh)
    b_sh = batch_shardings(batch_spec, act_rules, mesh)

    def init_around(params, mstate):
        rng = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 0x5EED))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "rng": rng}
        if mdef.has_state:
            state[STATE_KEY] = mstate
        return strategy.init_state(state)

    def init():
        return init_around(*model_lib.split_values(model_lib.build(cfg.model, seed)))

    def init_from(params):
        # the built model's parameters are not used (XLA drops their computation), its state is
        return init_around(params, model_lib.split_values(model_lib.build(cfg.model, seed))[1])

    def train_step(state, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        return strategy.step(state, batch, key)

    eval_step = make_eval_step(mdef, loss, mesh, act_rules, prec)
    sync = None
    if strategy.sync_every:
        sync = jax.jit(strategy.sync_step, in_shardings=(state_sh,), out_shardings=state_sh,
                       donate_argnums=0)  # fmt: skip
    abs_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(init), state_sh,
    )  # fmt: skip
    # Metrics with a per-replica dimension (DiLoCo) keep their sharding: none is forced.
    metrics_sh = replicated if strategy.metrics_replicated else None
    return Program(
        mesh=mesh, graphdef=mdef.graphdef, param_template=template, model=mdef, loss=loss,
        state_shardings=state_sh,
        batch_shardings=b_sh, abstract_state=abs_state, param_logical=param_logical_axes(template),
        init=jax.jit(init, out_shardings=state_sh),
        init_from=jax.jit(init_from, in_shardings=(ctx.param_shardings,), out_shardings=state_sh,
                          donate_argnums=0),  # fmt: skip
        train_step=jax.jit(
            train_step, in_shardings=(state_sh, b_sh),
            out_shardings=(state_sh, metrics_sh), donate_argnums=0,
        ),
        eval_step=jax.jit(eval_step, in_shardings=(state_sh, b_sh), out_shardings=replicated),
        schedule=schedule, task=task, sync_step=sync, sync_every=strategy.sync_every,
        strategy=strategy.name, parts=strategy, attention=attention_calls,
    )  # fmt: skip


def with_recipe_rules(cfg: TrainConfig, param_rules: Rules, act_rules: Rules) -> tuple:
    """The preset's rules followed by the recipe's own (TrainConfig.rules), which may name
    logical axes outside jaxpar's vocabulary (for the recipe's model); the recipe's
    `param_rules_first` before the preset's parameter rules."""
    extra = tuple(tuple(r) for r in cfg.rules)
    # a rule given with --set is JSON: its mesh axes a list
    first = tuple((n, a if isinstance(a, str) or a is None else tuple(a))
                  for n, a in cfg.param_rules_first)  # fmt: skip
    if not extra and not first:
        return param_rules, act_rules
    validate_rules((*first, *extra), new_names=True)
    return (*first, *param_rules, *extra), (*act_rules, *extra)


def abstract_model(cfg: TrainConfig) -> tuple[Any, nnx.State]:
    """(graphdef, abstract parameter state) of the model, built under eval_shape."""
    mdef = model_lib.abstract(cfg.model, cfg.train.seed)
    return mdef.graphdef, mdef.params


def make_loss(mdef: ModelDef, loss: LossFn, prec: Policy = FP32, *, training: bool = True):
    """(params, model_state, batch, key) -> (loss, (metrics, model_state)) of the model rebuilt
    from `params` and its state, computed in the policy's dtype. Differentiated, the cast is part
    of the function: gradients come back float32, like the parameters (jaxpar/engine/precision.py).

    Training: `model.train()`, rng streams and the loss's `rngs` keyed by `key`. Evaluation
    (`training=False`): `model.eval()`, the built-in tasks get no key (no dropout).
    """
    builtin = loss.__module__ == "jaxpar.engine.losses"

    def loss_fn(params, mstate, batch, key):
        model = model_lib.rebuild(mdef, prec.cast(params), mstate, key)
        model.train() if training else model.eval()
        rngs = nnx.Rngs(key) if key is not None else None if builtin else nnx.Rngs(0)
        value, metrics = check_output(loss(model, prec.cast(batch), rngs), "the loss")
        return value, (metrics, model_lib.new_state(mdef, model) if training else mstate)

    return loss_fn


def make_value_and_grad(mdef: ModelDef, loss: LossFn, prec: Policy = FP32) -> Callable:
    """(params, model_state, batch, key) -> ((loss, (metrics, model_state)), grads) with respect
    to the float32 params."""
    loss_fn = make_loss(mdef, loss, prec)

    def value_and_grad(params, mstate, batch, key):
        return jax.value_and_grad(loss_fn, has_aux=True)(params, mstate, batch, key)

    return value_and_grad


def saved_for_backward_bytes(cfg: TrainConfig, program: Program, batch_spec: dict) -> int:
    """Bytes the backward pass keeps from the forward for one global batch (the residuals of the
    loss's VJP, found abstractly, before XLA fuses anything; weights included). What
    rematerialisation shrinks, on any backend."""
    loss_fn = make_loss(program.model, program.loss, policy(cfg.precision))
    mstate = program.abstract_state.get(STATE_KEY, {})

    def residuals(params, batch):
        return jax.vjp(lambda p: loss_fn(p, mstate, batch, None)[0], params)[1]

    abs_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), program.abstract_state["params"]
    )
    return param_bytes(jax.eval_shape(residuals, abs_params, batch_spec))


def make_eval_step(mdef: ModelDef, loss: LossFn, mesh: Mesh, act_rules: Rules, prec: Policy = FP32):
    """(state, batch) -> {"loss", ...metrics} on the state's params and model state, in
    evaluation mode (no dropout), same precision."""
    loss_fn = make_loss(mdef, loss, prec, training=False)

    def eval_step(state, batch):
        with activation_rules(mesh, act_rules):
            value, (metrics, _) = loss_fn(state["params"], state.get(STATE_KEY, {}), batch, None)
        return {"loss": value, **metrics}

    return eval_step


def param_bytes(abstract_params: dict) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract_params))


# jaxpar's code a train step is traced from: the model, losses, layouts and data specs
PROGRAM_CODE = ("engine", "parallel", "data", "config.py", "contract.py", "_layout.py",
                "_compat.py", "usercode.py")  # fmt: skip


@functools.cache
def code_digest() -> str:
    """sha256 over the sources a train step is traced from (PROGRAM_CODE; the spare computes it
    before it is needed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jaxpar/
    h = hashlib.sha256()
    for part in PROGRAM_CODE:
        path = os.path.join(root, part)
        files = [path] if part.endswith(".py") else sorted(
            os.path.join(folder, name) for folder, _, names in os.walk(path)
            for name in names if name.endswith(".py"))  # fmt: skip
        for name in sorted(files):
            h.update(os.path.relpath(name, root).encode() + b"\0")
            with open(name, "rb") as f:
                h.update(f.read())
    return h.hexdigest()
