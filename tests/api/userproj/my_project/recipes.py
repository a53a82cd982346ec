"""Recipes of the user project: `jaxpar train --recipe my_project.recipes:digits_bn`."""

from __future__ import annotations

import optax

import jaxpar
from my_project.model import NetConfig


def loss(model, batch, rngs):
    """Cross-entropy and accuracy of one batch (the model keeps its own dropout stream)."""
    logits_BK = model(batch["image"])
    labels_B = batch["label"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BK, labels_B).mean()
    return ce, {"accuracy": (logits_BK.argmax(-1) == labels_B).mean()}


def optimizer(total_steps: int) -> optax.GradientTransformation:
    """SGD with Nesterov momentum, weight decay and a cosine schedule, clipped."""
    schedule = optax.cosine_decay_schedule(0.05, max(total_steps, 1), alpha=0.1)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.add_decayed_weights(1e-4),
        optax.sgd(schedule, momentum=0.9, nesterov=True),
    )


def digits_bn() -> jaxpar.TrainConfig:
    return jaxpar.TrainConfig(
        name="digits_bn",
        model=NetConfig(),
        data=jaxpar.DataConfig(source="digits", global_batch=32),
        train=jaxpar.TrainLoopConfig(steps=20, eval_every=10, eval_batches=2),
        ckpt=jaxpar.CkptConfig(every=5),
        loss=loss,
        optimizer=optimizer,
        rules=(("hidden", "tensor"),),  # a name jaxpar does not know, and where it goes
    )
