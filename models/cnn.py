"""Small convolutional classifier (digits), written with logical axis names.

    python -m train --recipe digits_cnn

Legend: B batch, H height, W width, C channels, K classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.engine.rules import constrain


@dataclass(frozen=True)
class CNNConfig:
    image_shape: tuple[int, ...] = (8, 8, 1)
    channels: tuple[int, ...] = (32, 64)
    num_classes: int = 10

    def build(self, rngs: nnx.Rngs) -> CNN:
        return CNN(self, rngs=rngs)

    def flops_per_example(self) -> float:
        h, w, c_in = self.image_shape
        flops, prev = 0.0, c_in
        for c in self.channels:
            flops += 2 * h * w * 9 * prev * c
            prev = c
        return 3.0 * (flops + 2 * prev * self.num_classes)


class CNN(nnx.Module):
    def __init__(self, cfg: CNNConfig, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernels, self.biases = nnx.List(), nnx.List()
        prev = cfg.image_shape[-1]
        for i, c in enumerate(cfg.channels):
            # The image's own channels (first layer) stay unsharded: 1 divides no mesh axis.
            names = (None, None, None if i == 0 else "conv_in", "conv_out")
            self.kernels.append(
                nnx.Param(init(rngs.params(), (3, 3, prev, c), jnp.float32), out_sharding=names)
            )
            self.biases.append(nnx.Param(jnp.zeros((c,), jnp.float32), out_sharding=("conv_out",)))
            prev = c
        self.head = nnx.Param(
            init(rngs.params(), (prev, cfg.num_classes), jnp.float32),
            out_sharding=("embed", "classes"),
        )
        self.head_b = nnx.Param(
            jnp.zeros((cfg.num_classes,), jnp.float32), out_sharding=("classes",)
        )

    def __call__(self, image_BHWC, key=None):
        x = image_BHWC
        for k, b in zip(self.kernels, self.biases, strict=True):
            x = jax.lax.conv_general_dilated(
                x, k[...], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            x = constrain(jax.nn.relu(x + b[...]), ("batch", "height", "width", "conv_out"))
        pooled_BC = x.mean(axis=(1, 2))
        return constrain(pooled_BC @ self.head[...] + self.head_b[...], ("batch", "classes"))
