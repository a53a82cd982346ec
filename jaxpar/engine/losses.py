"""Losses: the built-in tasks (`lm`, `classify`) and the recipe's own loss hook.

    loss(model, batch, rngs) -> (scalar loss, {name: scalar metric})

The contract (what `model`, `batch` and `rngs` are, metrics as means over the global batch, the
built-in tasks): docs/model_contract.md, "The loss".
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxpar.engine.model import apply, apply_aux

LossFn = Callable[..., tuple[jax.Array, dict]]

# Metrics that are vectors, not scalars: the tokens routed to each expert, as fractions.
VECTOR_METRICS = ("moe_expert_load",)


def causal_lm(model, batch: dict, rngs) -> tuple[jax.Array, dict]:
    """Mean next-token cross entropy, plus a model's auxiliary losses (`aux_forward`: a mixture
    of experts' load-balancing and router z-losses), whose metrics it reports."""
    logits_BTV, aux = apply_aux(model, batch["inputs"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits_BTV.astype(jnp.float32), batch["targets"]
    )
    if not aux:
        return loss.mean(), {}
    return loss.mean() + aux["loss"], dict(aux.get("metrics", {}))


def classification(model, batch: dict, rngs) -> tuple[jax.Array, dict]:
    logits_BC = apply(model, batch["image"], rngs).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch["label"]).mean()
    accuracy = (jnp.argmax(logits_BC, -1) == batch["label"]).mean()
    return loss, {"accuracy": accuracy}


BUILTIN: dict[str, LossFn] = {"lm": causal_lm, "classify": classification}


def loss_for(user_loss: LossFn | None, kind: str) -> LossFn:
    """The recipe's loss, else the built-in task of the data source's kind."""
    if user_loss is not None:
        if not callable(user_loss):
            raise ValueError(
                f"TrainConfig.loss is a {type(user_loss).__name__}; give a function "
                f"loss(model, batch, rngs) -> (loss, metrics dict), or None for the built-in task"
            )
        return user_loss
    if kind not in BUILTIN:
        raise ValueError(
            f"no built-in loss for data of kind {kind!r} (built in: {sorted(BUILTIN)}); give "
            f"the recipe a loss(model, batch, rngs) -> (loss, metrics) as TrainConfig.loss"
        )
    return BUILTIN[kind]


def check_output(out, where: str) -> tuple[jax.Array, dict]:
    """The loss hook's (loss, metrics), checked: a scalar loss and a dict of scalar metrics."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise ValueError(
            f"{where} returned {type(out).__name__}; a loss returns (scalar loss, metrics dict)"
        )
    loss, metrics = out
    if jnp.shape(loss) != ():
        raise ValueError(f"{where} returned a loss of shape {jnp.shape(loss)}; it must be a scalar")
    bad = {
        k: jnp.shape(v)
        for k, v in metrics.items()
        if jnp.shape(v) != () and not (k in VECTOR_METRICS and jnp.ndim(v) == 1)
    }
    if bad:
        raise ValueError(f"{where} returned non-scalar metrics {bad}; average them to scalars")
    return jnp.asarray(loss, jnp.float32), {
        k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()
    }
