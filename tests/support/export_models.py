"""Tiny models written the way Flax's own docs write them, for export and load round trips: a CNN
with BatchNorm (batch statistics), a call counter (int state) and Dropout (an RNG stream kept in
the model), and a ViT-style classifier with `nnx.MultiHeadAttention` (attention dropout: its own
RNG stream) whose MLP is sharded over `tensor` (logical name `mlp`). Both classify the `digits`
source's 8x8x1 images and take only their input (`__call__(x)`).

Legend: B batch, H height, W width, C channels, P patches, D embedding, F hidden, K classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

import jaxpar


@dataclass(frozen=True)
class BNNetConfig:
    channels: int = 4
    hidden: int = 16
    num_classes: int = 10
    dropout: float = 0.2

    def build(self, rngs: nnx.Rngs) -> BNNet:
        return BNNet(self, rngs=rngs)


class BNNet(nnx.Module):
    def __init__(self, cfg: BNNetConfig, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, cfg.channels, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(cfg.channels, rngs=rngs)
        self.fc1 = nnx.Linear(4 * 4 * cfg.channels, cfg.hidden, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.fc2 = nnx.Linear(cfg.hidden, cfg.num_classes, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))  # a counter: int, 0-d state

    def __call__(self, x_BHWC: jnp.ndarray) -> jnp.ndarray:
        self.calls[...] += 1
        x = nnx.relu(self.norm(self.conv(x_BHWC)))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))  # [B, 4, 4, C]
        x_BF = nnx.relu(self.fc1(x.reshape(x.shape[0], -1)))
        return self.fc2(self.dropout(x_BF))


@dataclass(frozen=True)
class ViTConfig:
    patch: int = 2
    embed: int = 16
    heads: int = 2
    hidden: int = 32
    num_classes: int = 10
    dropout: float = 0.1

    def build(self, rngs: nnx.Rngs) -> ViT:
        return ViT(self, rngs=rngs)


class ViT(nnx.Module):
    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        patches = (8 // cfg.patch) ** 2
        self.embed = nnx.Linear(cfg.patch * cfg.patch, cfg.embed, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (patches, cfg.embed)))
        self.ln1 = nnx.LayerNorm(cfg.embed, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            cfg.heads, cfg.embed, dropout_rate=cfg.dropout, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(cfg.embed, rngs=rngs)
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.mlp1 = nnx.Linear(
            cfg.embed, cfg.hidden, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, (None, "mlp")),
            bias_init=nnx.with_partitioning(zeros, ("mlp",)),
        )  # fmt: skip
        self.mlp2 = nnx.Linear(
            cfg.hidden, cfg.embed, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("mlp", None)),
        )  # fmt: skip
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.head = nnx.Linear(cfg.embed, cfg.num_classes, rngs=rngs)

    def __call__(self, x_BHWC: jnp.ndarray) -> jnp.ndarray:
        p = self.cfg.patch
        b, h, w, _ = x_BHWC.shape
        x = x_BHWC.reshape(b, h // p, p, w // p, p).transpose(0, 1, 3, 2, 4)
        x_BPD = self.embed(x.reshape(b, (h // p) * (w // p), p * p)) + self.pos[...]
        x_BPD = x_BPD + self.attn(self.ln1(x_BPD))
        x_BPD = x_BPD + self.dropout(self.mlp2(nnx.gelu(self.mlp1(self.ln2(x_BPD)))))
        return self.head(x_BPD.mean(axis=1))


def digits_config(model, name: str, steps: int = 3) -> jaxpar.TrainConfig:
    """A few steps on `digits`, checkpointed and evaluated at the last one."""
    return jaxpar.TrainConfig(
        name=name,
        model=model,
        data=jaxpar.DataConfig(source="digits", global_batch=16),
        train=jaxpar.TrainLoopConfig(steps=steps, eval_every=steps, eval_batches=2),
        ckpt=jaxpar.CkptConfig(every=steps, use_async=False, local_every=0),
        log=jaxpar.LogConfig(progress=False),
        run=jaxpar.RunConfig(compile_cache=False),
    )
