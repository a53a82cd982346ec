"""Decoder-only transformer (GPT), written once with logical axis names.

    python -m train --recipe gpt_tiny --mesh dp2_tp4
    python -m train --recipe gpt_small --set model.remat=block --set precision.compute=bfloat16

Legend: B batch, T seq, D embed, F mlp, N heads, H head_dim, V vocab, L layers,
S cached positions (= seq_len).
The L repeated blocks are one stacked module (parameters carry a leading `layers` dimension) so
a pipeline can split them into stages; the forward pass walks them in order.

Generation (`jaxpar sample`) uses the cached path: `init_cache` then `decode` on the prompt and on
one new token at a time; each call computes only its new positions' keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.engine.attention import attention, check_impl, dropout
from jaxpar.engine.rules import constrain

_init = nnx.initializers


# Rematerialisation per block (`remat`): what the backward pass keeps of each block's forward.
# "block" keeps only the block's input and recomputes the rest; "dots" also keeps the outputs of
# the weight matmuls (no batch dimension) and recomputes attention scores, softmax and GELU.
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _param(rngs: nnx.Rngs, init, shape, names) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_mlp: int = 512
    dropout: float = 0.0
    remat: str = "none"  # none | block | dots (see REMAT_POLICIES)
    # How attention runs when the sequence is split over the `context` mesh axis: ring |
    # allgather | alltoall (jaxpar/engine/attention.py); plain attention when it is not.
    attention: str = "ring"

    # Change memory and speed, not the values computed: left out of jaxpar's config hash.
    NOT_HASHED: ClassVar[tuple[str, ...]] = ("remat", "attention")

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}: use one of {list(REMAT_POLICIES)}")
        check_impl(self.attention)

    def build(self, rngs: nnx.Rngs) -> GPT:
        return GPT(self, rngs=rngs)

    def num_params(self) -> int:
        d, f, v, t, layers = self.d_model, self.d_mlp, self.vocab_size, self.seq_len, self.n_layers
        per_block = 4 * d + 3 * d * d + 3 * d + d * d + d + d * f + f + f * d + d
        return v * d + t * d + layers * per_block + 2 * d + d * v

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x parameters + attention scores (6 x L x T x D x 2)."""
        return 6.0 * self.num_params() + 12.0 * self.n_layers * self.seq_len * self.d_model


class LayerNorm(nnx.Module):
    """Statistics and normalisation in float32 whatever the input dtype; output in its dtype."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), out_sharding=("norm",))
        self.bias = nnx.Param(jnp.zeros((d,), jnp.float32), out_sharding=("norm",))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
        return (
            y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        ).astype(x.dtype)


_dropout = dropout


class Block(nnx.Module):
    """Pre-norm block: x + attn(ln(x)); x + mlp(ln(x)). Fused QKV: one backward all-reduce under TP."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, n, f = cfg.d_model, cfg.n_heads, cfg.d_mlp
        if d % n:
            raise ValueError(f"d_model={d} must be divisible by n_heads={n}")
        h = d // n
        self.cfg = cfg
        self.ln1 = LayerNorm(d, rngs)
        self.ln2 = LayerNorm(d, rngs)
        std = 0.02
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.w_qkv = _param(
            rngs, _init.normal(std), (d, 3, n, h), ("embed", None, "heads", "head_dim")
        )
        self.b_qkv = _param(rngs, _init.zeros, (3, n, h), (None, "heads", "head_dim"))
        self.w_o = _param(rngs, _init.normal(out_std), (n, h, d), ("heads", "head_dim", "embed"))
        self.b_o = _param(rngs, _init.zeros, (d,), ("embed",))
        self.w_in = _param(rngs, _init.normal(std), (d, f), ("embed", "mlp"))
        self.b_in = _param(rngs, _init.zeros, (f,), ("mlp",))
        self.w_out = _param(rngs, _init.normal(out_std), (f, d), ("mlp", "embed"))
        self.b_out = _param(rngs, _init.zeros, (d,), ("embed",))

    def qkv(self, x_BTD):
        qkv = jnp.einsum("btd,dknh->kbtnh", x_BTD, self.w_qkv[...]) + self.b_qkv[...][:, None, None]
        return tuple(constrain(a, ("batch", "seq", "heads", "head_dim")) for a in qkv)

    def attention(self, x_BTD, key):
        q_BTNH, k_BTNH, v_BTNH = self.qkv(x_BTD)
        o_BTNH = attention(
            q_BTNH, k_BTNH, v_BTNH, impl=self.cfg.attention, dropout_rate=self.cfg.dropout,
            dropout_key=key,
        )  # fmt: skip
        o_BTNH = constrain(o_BTNH, ("batch", "seq", "heads", "head_dim"))
        return jnp.einsum("btnh,nhd->btd", o_BTNH, self.w_o[...]) + self.b_o[...]

    def attention_cached(self, x_BTD, k_BSNH, v_BSNH, pos):
        """Attention of T new positions [pos, pos + T) to the cache's earlier positions and to
        each other (causal); returns (out_BTD, cache with the new keys and values written)."""
        q_BTNH, k_BTNH, v_BTNH = self.qkv(x_BTD)
        k_BSNH = jax.lax.dynamic_update_slice(k_BSNH, k_BTNH.astype(k_BSNH.dtype), (0, pos, 0, 0))
        v_BSNH = jax.lax.dynamic_update_slice(v_BSNH, v_BTNH.astype(v_BSNH.dtype), (0, pos, 0, 0))
        h = q_BTNH.shape[-1]
        s_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH) / jnp.sqrt(h).astype(x_BTD.dtype)
        t, span = x_BTD.shape[1], k_BSNH.shape[1]
        visible_TS = jnp.arange(span)[None, :] <= pos + jnp.arange(t)[:, None]
        s_BNTS = jnp.where(visible_TS, s_BNTS, jnp.finfo(s_BNTS.dtype).min)
        p_BNTS = jax.nn.softmax(s_BNTS.astype(jnp.float32), axis=-1).astype(x_BTD.dtype)
        o_BTNH = jnp.einsum("bnts,bsnh->btnh", p_BNTS, v_BSNH)
        return jnp.einsum("btnh,nhd->btd", o_BTNH, self.w_o[...]) + self.b_o[...], k_BSNH, v_BSNH

    def decode(self, x_BTD, k_BSNH, v_BSNH, pos):
        """The block on T new positions with a key/value cache (no dropout)."""
        a_BTD, k_BSNH, v_BSNH = self.attention_cached(self.ln1(x_BTD), k_BSNH, v_BSNH, pos)
        x_BTD = x_BTD + a_BTD
        return x_BTD + self.mlp(self.ln2(x_BTD)), k_BSNH, v_BSNH

    def mlp(self, x_BTD):
        h_BTF = jax.nn.gelu(x_BTD @ self.w_in[...] + self.b_in[...])
        h_BTF = constrain(h_BTF, ("batch", "seq", "mlp"))
        return h_BTF @ self.w_out[...] + self.b_out[...]

    def __call__(self, x_BTD, key=None):
        policy = REMAT_POLICIES[self.cfg.remat]
        if self.cfg.remat == "none":
            return self.forward(x_BTD, key)
        # The same computation; the backward pass recomputes what `policy` does not keep.
        return nnx.remat(Block.forward, policy=policy)(self, x_BTD, key)

    def forward(self, x_BTD, key=None):
        k_attn, k_res1, k_res2 = jax.random.split(key, 3) if key is not None else (None,) * 3
        x_BTD = x_BTD + _dropout(self.attention(self.ln1(x_BTD), k_attn), self.cfg.dropout, k_res1)
        x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
        x_BTD = x_BTD + _dropout(self.mlp(self.ln2(x_BTD)), self.cfg.dropout, k_res2)
        return constrain(x_BTD, ("batch", "seq", "embed"))


def stacked_blocks(cfg: GPTConfig, rngs: nnx.Rngs) -> Block:
    """cfg.n_layers blocks as one module whose parameters have a leading `layers` dimension."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r: nnx.Rngs) -> Block:
        return Block(cfg, r)

    return make(rngs)


def block_at(blocks: Block, i: int) -> Block:
    """Block i of a stacked module (a view sharing no state; used inside traced code)."""
    graphdef, state = nnx.split(blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.d_model, cfg.vocab_size
        self.tok_emb = _param(rngs, _init.normal(0.02), (v, d), ("vocab", "embed"))
        self.pos_emb = _param(rngs, _init.normal(0.01), (cfg.seq_len, d), (None, "embed"))
        self.blocks = stacked_blocks(cfg, rngs)
        self.ln_f = LayerNorm(d, rngs)
        self.head = _param(rngs, _init.normal(0.02), (d, v), ("embed", "vocab"))

    def embed(self, tokens_BT, key=None, pos=0):
        t = tokens_BT.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        if isinstance(pos, int):
            pos_TD = self.pos_emb[...][pos : pos + t]
        else:  # a traced position (cached decoding)
            pos_TD = jax.lax.dynamic_slice_in_dim(self.pos_emb[...], pos, t)
        x_BTD = jnp.take(self.tok_emb[...], tokens_BT, axis=0) + pos_TD
        x_BTD = _dropout(x_BTD, self.cfg.dropout, key)
        return constrain(x_BTD, ("batch", "seq", "embed"))

    def unembed(self, x_BTD):
        logits_BTV = self.ln_f(x_BTD) @ self.head[...]
        return constrain(logits_BTV, ("batch", "seq", "vocab"))

    def pipeline_parts(self):
        """(embed, blocks, head) for a pipeline schedule (jaxpar.parallel.pipeline.PipelineModel).

        embed(tokens_BT, key) -> x_BTD; blocks: the stacked module (one layer's slice of its
        state, merged with its graphdef, is a Block called as block(x_BTD, key)); head(x_BTD) ->
        logits_BTV, applied position by position.
        """
        return self.embed, self.blocks, self.unembed

    def __call__(self, tokens_BT, key=None):
        keys = jax.random.split(key, self.cfg.n_layers + 1) if key is not None else None
        x_BTD = self.embed(tokens_BT, None if keys is None else keys[-1])
        for i in range(self.cfg.n_layers):
            x_BTD = block_at(self.blocks, i)(x_BTD, None if keys is None else keys[i])
        return self.unembed(x_BTD)

    def init_cache(self, batch: int, dtype=jnp.float32) -> dict:
        """An empty key/value cache for `decode`: {"k", "v"} of [L, B, S, N, H], S = seq_len."""
        c = self.cfg
        shape = (c.n_layers, batch, c.seq_len, c.n_heads, c.d_model // c.n_heads)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def decode(self, tokens_BT, cache: dict, pos):
        """Logits of tokens_BT at positions [pos, pos + T) given the cache of positions < pos;
        returns (logits_BTV, cache holding positions < pos + T). pos + T <= seq_len."""
        x_BTD = self.embed(tokens_BT, pos=pos)
        ks, vs = [], []
        for i in range(self.cfg.n_layers):
            x_BTD, k, v = block_at(self.blocks, i).decode(x_BTD, cache["k"][i], cache["v"][i], pos)
            ks.append(k)
            vs.append(v)
        return self.unembed(x_BTD), {"k": jnp.stack(ks), "v": jnp.stack(vs)}
