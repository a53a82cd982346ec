"""A user's own byte-level transformer, as a user would write it for jaxpar: the layers stacked
(one `nnx.vmap`-built module) and run with `jax.lax.scan` over the stack, pipeline parts for
`pipeline` > 1, and no `flops_per_token` (jaxpar knows nothing of its FLOPs but the compiled
program).

    jaxpar tune --recipe tests.support.scan_lm:recipe --devices 8 --measure 8
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxpar
from jaxpar import constrain
from jaxpar.engine.attention import attention


def _param(rngs, shape, names, std=0.02):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape), out_sharding=names)


@dataclass(frozen=True)
class ScanLMConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_mlp: int = 512

    def build(self, rngs: nnx.Rngs) -> ScanLM:
        return ScanLM(self, rngs)


class Block(nnx.Module):
    def __init__(self, cfg: ScanLMConfig, rngs: nnx.Rngs):
        d, n = cfg.d_model, cfg.n_heads
        self.w_qkv = _param(rngs, (d, 3, n, d // n), ("embed", None, "heads", "head_dim"))
        self.w_o = _param(rngs, (n, d // n, d), ("heads", "head_dim", "embed"))
        self.w_in = _param(rngs, (d, cfg.d_mlp), ("embed", "mlp"))
        self.w_out = _param(rngs, (cfg.d_mlp, d), ("mlp", "embed"))

    def __call__(self, x_BTD, key=None):
        q, k, v = (constrain(a, ("batch", "seq", "heads", "head_dim"))
                   for a in jnp.einsum("btd,dcnh->cbtnh", x_BTD, self.w_qkv[...]))  # fmt: skip
        x_BTD = x_BTD + jnp.einsum("btnh,nhd->btd", attention(q, k, v), self.w_o[...])
        x_BTD = x_BTD + jax.nn.gelu(x_BTD @ self.w_in[...]) @ self.w_out[...]
        return constrain(x_BTD, ("batch", "seq", "embed"))


class ScanLM(nnx.Module):
    def __init__(self, cfg: ScanLMConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.tok_emb = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        self.pos_emb = _param(rngs, (cfg.seq_len, cfg.d_model), (None, "embed"))

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(r: nnx.Rngs) -> Block:
            return Block(cfg, r)

        self.blocks = stack(rngs)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def embed(self, tokens_BT, key=None):
        x_BTD = jnp.take(self.tok_emb[...], tokens_BT, axis=0) + self.pos_emb[...]
        return constrain(x_BTD, ("batch", "seq", "embed"))

    def unembed(self, x_BTD):
        return constrain(x_BTD @ self.head[...], ("batch", "seq", "vocab"))

    def pipeline_parts(self):
        return self.embed, self.blocks, self.unembed

    def __call__(self, tokens_BT, key=None):
        graphdef, stacked = nnx.split(self.blocks)

        def layer(x_BTD, state):  # one layer of the stack per scan step
            return nnx.merge(graphdef, state)(x_BTD), None

        x_BTD, _ = jax.lax.scan(layer, self.embed(tokens_BT), stacked)
        return self.unembed(x_BTD)


def recipe() -> jaxpar.TrainConfig:
    return jaxpar.TrainConfig(
        name="scan_lm",
        model=ScanLMConfig(),
        data=jaxpar.DataConfig(source="stdlib_text", global_batch=32, seq_len=64),
        optimizer=optax.adam(3e-3),
        train=jaxpar.TrainLoopConfig(steps=20),
    )
