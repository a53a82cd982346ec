"""How the engine runs a model: its variables split three ways, rebuilt inside traced code.

`nnx.Param`s are trained; every other variable (BatchNorm statistics, counters) is the train
state's `model_state`, sharded, checkpointed and restored like them; RNG state is not carried:
each step reseeds every stream. The contract (building, calling, training and evaluation mode,
randomness): docs/model_contract.md.
"""

from __future__ import annotations

import inspect
import math
import zlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

STATE_KEY = "model_state"  # the train-state entry of the non-parameter state
STATE_FILTER = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))


def build(model_cfg: Any, seed: int) -> nnx.Module:
    """The model from its config (Flax's eager sharding off while it is built)."""
    with nnx.use_eager_sharding(False):
        return model_cfg.build(nnx.Rngs(seed, params=seed))


@dataclass(frozen=True)
class ModelDef:
    """The abstract model: its graph and the abstract state of each group."""

    graphdef: Any
    params: nnx.State
    state: nnx.State
    rngs: nnx.State
    takes_key: bool  # __call__(inputs, key): the step's key is passed explicitly

    @property
    def has_state(self) -> bool:
        return bool(jax.tree.leaves(self.state))

    @property
    def has_streams(self) -> bool:
        return bool(jax.tree.leaves(self.rngs))

    def state_paths(self) -> list[str]:
        """Paths of the non-parameter variables with their types (for error messages)."""
        leaves = jax.tree_util.tree_leaves_with_path(
            self.state, is_leaf=lambda v: isinstance(v, nnx.Variable)
        )
        return [f"{jax.tree_util.keystr(p)} ({type(v).__name__})" for p, v in leaves]


# The jax settings an abstract model's dtypes depend on (a prebuilt model is used only under
# the same values)
DTYPE_FLAGS = ("jax_enable_x64", "jax_default_dtype_bits", "jax_numpy_dtype_promotion")
_PREBUILT: list = []  # [(key, ModelDef)]: built ahead by a spare worker, each used once


def _prebuilt_key(model_cfg: Any, seed: int) -> tuple:
    return (model_cfg, seed, tuple(jax.config.values.get(f) for f in DTYPE_FLAGS))


def prebuild(model_cfg: Any, seed: int) -> None:
    """Build `abstract(model_cfg, seed)` now (it needs no devices: a spare worker does it before
    a failure); the next `abstract` call with an equal config and seed returns it."""
    _PREBUILT.append((_prebuilt_key(model_cfg, seed), _abstract(model_cfg, seed)))


def abstract(model_cfg: Any, seed: int) -> ModelDef:
    """The model built under eval_shape and split into params / state / rng streams."""
    key = _prebuilt_key(model_cfg, seed)
    for i, (k, mdef) in enumerate(_PREBUILT):
        if k == key:
            del _PREBUILT[i]
            return mdef
    return _abstract(model_cfg, seed)


def _abstract(model_cfg: Any, seed: int) -> ModelDef:
    model = nnx.eval_shape(lambda: build(model_cfg, seed))
    graphdef, params, rngs, state = nnx.split(model, nnx.Param, nnx.RngState, ...)
    return ModelDef(graphdef, params, state, rngs, takes_key(model))


def takes_key(model: Any) -> bool:
    """Whether the model's __call__ has a parameter named `key` (jaxpar's explicit-key models)."""
    try:
        params = inspect.signature(type(model).__call__).parameters
    except (TypeError, ValueError):
        return False
    return "key" in params


def split_values(model: nnx.Module) -> tuple[dict, dict]:
    """(params, state) of a concrete model, as pure dicts."""
    _, params, _, state = nnx.split(model, nnx.Param, nnx.RngState, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(state)


def _filled(template: nnx.State, pure: dict) -> nnx.State:
    state = jax.tree.map(lambda x: x, template)  # fresh Variables: never mutate the template
    nnx.replace_by_pure_dict(state, pure)
    return state


def stream_keys(mdef: ModelDef, key: jax.Array | None) -> dict:
    """Pure dict of the rng streams' keys and counts for one step: each stream keyed by
    fold_in(key, crc32(stream name)), counts 0 (a fixed key when `key` is None)."""
    base = jax.random.key(0) if key is None else key

    def one(v):
        if isinstance(v, nnx.RngCount):
            return jnp.zeros(v.shape, v.dtype)
        k = jax.random.fold_in(base, zlib.crc32(str(v.tag).encode()) & 0x7FFFFFFF)
        if v.shape:
            k = jax.random.split(k, math.prod(v.shape)).reshape(v.shape)
        return k

    out = jax.tree.map(one, mdef.rngs, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.to_pure_dict(out) if isinstance(out, nnx.State) else out


def rebuild(mdef: ModelDef, params: dict, state: dict | None, key: jax.Array | None) -> Any:
    """The model from pure dicts of its params and state, its streams reseeded from `key`."""
    parts = [_filled(mdef.params, params)]
    if mdef.has_streams:
        parts.append(_filled(mdef.rngs, stream_keys(mdef, key)))
    if mdef.has_state:
        parts.append(_filled(mdef.state, state))
    return nnx.merge(mdef.graphdef, *parts)


def new_state(mdef: ModelDef, model: nnx.Module) -> dict:
    """The model's non-parameter state after a call, in the dtypes of the train state."""
    if not mdef.has_state:
        return {}
    out = nnx.to_pure_dict(nnx.state(model, STATE_FILTER))
    ref = nnx.to_pure_dict(mdef.state)
    return jax.tree.map(lambda x, r: x.astype(r.dtype), out, ref)


def apply(model: Any, inputs: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
    """`model(inputs, key)` for a model that takes a key (the key of `rngs`' default stream,
    None without `rngs`), else `model(inputs)`."""
    if takes_key(model):
        return model(inputs, None if rngs is None else rngs.default.key[...])
    return model(inputs)


def apply_aux(model: Any, inputs: jax.Array, rngs: nnx.Rngs | None) -> tuple[jax.Array, dict]:
    """(outputs, aux) of a model with auxiliary losses (an `aux_forward(inputs, key)` method
    returning (outputs, {"loss": scalar, "metrics": {name: value}}), e.g. a mixture of experts);
    (outputs, {}) for any other model."""
    forward = getattr(model, "aux_forward", None)
    if forward is None:
        return apply(model, inputs, rngs), {}
    out, aux = forward(inputs, None if rngs is None else rngs.default.key[...])
    if not (isinstance(aux, dict) and "loss" in aux and isinstance(aux.get("metrics", {}), dict)):
        raise ValueError(
            f"{type(model).__name__}.aux_forward returned aux {type(aux).__name__}; it returns "
            f'(outputs, {{"loss": scalar, "metrics": {{...}}}}) (jaxpar docs model_contract)'
        )
    return out, aux
