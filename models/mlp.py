"""Multi-layer perceptron classifier (digits), written with logical axis names.

    python -m train --recipe digits_mlp

Legend: B batch, I flattened input, F hidden (mlp), D hidden (embed), C classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.engine.rules import constrain


@dataclass(frozen=True)
class MLPConfig:
    image_shape: tuple[int, ...] = (8, 8, 1)
    hidden: int = 256
    num_classes: int = 10

    def build(self, rngs: nnx.Rngs) -> MLP:
        return MLP(self, rngs=rngs)

    def num_params(self) -> int:
        i, h, c = math.prod(self.image_shape), self.hidden, self.num_classes
        return i * h + h + h * h + h + h * c + c

    def flops_per_example(self) -> float:
        return 6.0 * self.num_params()


def _dense(rngs, fan_in, fan_out, names):
    init = nnx.initializers.lecun_normal()
    w = nnx.Param(init(rngs.params(), (fan_in, fan_out), jnp.float32), out_sharding=names)
    b = nnx.Param(jnp.zeros((fan_out,), jnp.float32), out_sharding=names[1:])
    return w, b


class MLP(nnx.Module):
    def __init__(self, cfg: MLPConfig, rngs: nnx.Rngs):
        i, h, c = math.prod(cfg.image_shape), cfg.hidden, cfg.num_classes
        # The input width is the image's pixel count: left unsharded so any mesh divides it.
        self.w1, self.b1 = _dense(rngs, i, h, (None, "mlp"))
        self.w2, self.b2 = _dense(rngs, h, h, ("mlp", "embed"))
        self.w3, self.b3 = _dense(rngs, h, c, ("embed", "classes"))

    def __call__(self, image_BHWC, key=None):
        x_BI = image_BHWC.reshape(image_BHWC.shape[0], -1)
        h_BF = constrain(jax.nn.relu(x_BI @ self.w1[...] + self.b1[...]), ("batch", "mlp"))
        h_BD = constrain(jax.nn.relu(h_BF @ self.w2[...] + self.b2[...]), ("batch", "embed"))
        return constrain(h_BD @ self.w3[...] + self.b3[...], ("batch", "classes"))
