"""A small classifier with BatchNorm and dropout, written the way Flax's own tutorials write one.

It takes only its input (`__call__(x)`); dropout draws from the `dropout` stream the model keeps
from its `nnx.Rngs`; its hidden features carry a logical name jaxpar does not know, `hidden`,
which the recipe maps onto a mesh axis.

Legend: B batch, H height, W width, C channels, F hidden features, K classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx


@dataclass(frozen=True)
class NetConfig:
    channels: int = 16
    hidden: int = 64
    num_classes: int = 10
    dropout: float = 0.1

    def build(self, rngs: nnx.Rngs) -> Net:
        return Net(self, rngs=rngs)


class Net(nnx.Module):
    def __init__(self, cfg: NetConfig, *, rngs: nnx.Rngs):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.conv = nnx.Conv(1, cfg.channels, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(cfg.channels, rngs=rngs)
        self.fc1 = nnx.Linear(
            4 * 4 * cfg.channels, cfg.hidden, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, (None, "hidden")),
            bias_init=nnx.with_partitioning(zeros, ("hidden",)),
        )  # fmt: skip
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.fc2 = nnx.Linear(
            cfg.hidden, cfg.num_classes, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("hidden", None)),
        )  # fmt: skip

    def __call__(self, x_BHWC: jnp.ndarray) -> jnp.ndarray:
        x = nnx.relu(self.norm(self.conv(x_BHWC)))  # [B, 8, 8, C]
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))  # [B, 4, 4, C]
        x_BF = nnx.relu(self.fc1(x.reshape(x.shape[0], -1)))
        return self.fc2(self.dropout(x_BF))  # [B, K]
