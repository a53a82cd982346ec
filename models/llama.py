"""Llama 3 family decoder (Llama 3.x, Qwen3 dense, Mistral), written once with logical axis names.

    python -m train --recipe llama3_tiny --mesh dp2_tp4
    python -m train --recipe qwen3_tiny --mesh data=2,context=4 --set model.attention=alltoall
    jaxpar inspect --recipe llama3_8b --mesh fsdp8

The architecture of Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM / MistralForCausalLM:
RMSNorm (eps from the config), rotary position embeddings with `rope_theta` and Llama 3's
frequency scaling (`rope_scaling="llama3"`), grouped-query attention (`n_kv_heads` key/value
heads shared by n_heads / n_kv_heads query heads each), a SwiGLU MLP, no biases, tied or untied
embeddings, and for Qwen3 an RMSNorm over each query and key head before the rotation (`qk_norm`).
Checkpoints convert to and from Hugging Face folders with jaxpar.hf (docs/models.md); the rotary
embedding uses Hugging Face's half-split layout (`rotate_half`), so their q/k weights load as
they are.

Legend: B batch, T seq, D embed, N query heads, K kv heads, G = N / K query heads per kv head,
H head_dim, F mlp, V vocab, L layers, S cached positions (= seq_len).
The L blocks are one stacked module (a leading `layers` dimension) so that a pipeline can split
them into stages; the model's own forward walks them in order (`block_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import NON_NEGATIVE, POSITIVE, Range
from jaxpar.engine.attention import attention, check_impl
from jaxpar.engine.rules import constrain
from jaxpar.models.gpt import REMAT_POLICIES, _init, _param, block_at

ROPE_SCALINGS = ("", "llama3")
QKV_NAMES = ("batch", "seq", "heads", "head_dim")
KV_NAMES = ("batch", "seq", "kv", "head_dim")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    seq_len: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 0  # 0: d_model // n_heads (Qwen3 sets it explicitly)
    d_mlp: int = 384
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: str = ""  # "" | "llama3" (Llama 3.1+ frequency scaling, the fields below)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before the rotation
    tie_embeddings: bool = False  # the output layer reuses the token table
    sliding_window: int = 0  # Mistral's; 0 = full attention (a window is refused)
    init_std: float = 0.02
    remat: str = "none"  # none | block | dots (models/gpt.py REMAT_POLICIES)
    attention: str = "ring"  # the context-parallel kernel: ring | allgather | alltoall

    NOT_HASHED: ClassVar[tuple[str, ...]] = ("remat", "attention")
    # Fields whose allowed values differ from jaxpar's defaults for a model (ints >= 1).
    RANGES: ClassVar[dict] = {
        "head_dim": NON_NEGATIVE, "sliding_window": NON_NEGATIVE, "norm_eps": POSITIVE,
        "rope_theta": POSITIVE, "rope_factor": Range(1), "init_std": POSITIVE,
        "rope_scaling": ROPE_SCALINGS,
    }  # fmt: skip

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}: use one of {list(REMAT_POLICIES)}")
        check_impl(self.attention)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads="
                f"{self.n_kv_heads}: each kv head serves n_heads / n_kv_heads query heads"
            )
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set "
                f"model.head_dim explicitly"
            )
        if self.hd % 2:
            raise ValueError(f"head_dim={self.hd} must be even for the rotary embedding")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(
                f"model.rope_scaling={self.rope_scaling!r}: use one of {list(ROPE_SCALINGS)}"
            )
        if self.sliding_window and self.sliding_window < self.seq_len:
            raise ValueError(
                f"model.sliding_window={self.sliding_window} < seq_len {self.seq_len}: sliding-"
                f"window attention is not supported; use seq_len <= {self.sliding_window} or 0"
            )

    @property
    def hd(self) -> int:
        """The width of one head."""
        return self.head_dim or self.d_model // self.n_heads

    def build(self, rngs: nnx.Rngs) -> Llama:
        return Llama(self, rngs=rngs)

    def mlp_params(self) -> int:
        return 3 * self.d_model * self.d_mlp

    def block_params(self) -> int:
        d, h = self.d_model, self.hd
        attn = d * self.n_heads * h + 2 * d * self.n_kv_heads * h + self.n_heads * h * d
        return 2 * d + attn + (2 * h if self.qk_norm else 0) + self.mlp_params()

    def num_params(self) -> int:
        table = self.vocab_size * self.d_model
        return (
            table * (1 if self.tie_embeddings else 2)
            + self.d_model
            + (self.n_layers * self.block_params())
        )

    def matmul_params(self) -> int:
        """Parameters a token multiplies with: all but the token table's lookup (counted again
        when it is tied, as the output layer)."""
        return self.num_params() - (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x matmul parameters + attention scores and values
        (6 x 2 x L x T x N x H, causal mask not discounted)."""
        return 6.0 * self.matmul_params() + 12.0 * self.n_layers * self.seq_len * (
            self.n_heads * self.hd
        )


def inv_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """[H/2] rotary inverse frequencies (float32, computed as Hugging Face does), with Llama 3's
    scaling: long wavelengths divided by `rope_factor`, short ones kept, a smooth blend between."""
    h = cfg.hd
    exps = np.arange(0, h, 2, dtype=np.int64).astype(np.float32) / np.float32(h)
    inv = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exps)).astype(np.float32)
    if cfg.rope_scaling != "llama3":
        return inv
    factor = np.float32(cfg.rope_factor)
    low, high = np.float32(cfg.rope_low_freq_factor), np.float32(cfg.rope_high_freq_factor)
    old = np.float32(cfg.rope_original_max_len)
    wavelen = np.float32(2 * np.pi) / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv).astype(np.float32)
    smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
    blended = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rotary(cfg: LlamaConfig, pos_T: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos_TH, sin_TH) at positions pos_T, in float32."""
    freqs_TH2 = pos_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_frequencies(cfg))[None, :]
    emb_TH = jnp.concatenate([freqs_TH2, freqs_TH2], axis=-1)
    return jnp.cos(emb_TH), jnp.sin(emb_TH)


def rotate(x_BTNH: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] of x's two halves."""
    half = x_BTNH.shape[-1] // 2
    x1, x2 = x_BTNH[..., :half], x_BTNH[..., half:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_TH[:, None, :].astype(x_BTNH.dtype), sin_TH[:, None, :].astype(x_BTNH.dtype)
    return x_BTNH * cos + rot * sin


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last dimension, in float32; output in the input's dtype."""

    def __init__(self, d: int, eps: float):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), out_sharding=("norm",))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * y).astype(x.dtype)


class LlamaBlock(nnx.Module):
    """x + attn(norm(x)); x + mlp(norm(x)), with grouped-query attention and a SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd
        std = cfg.init_std
        self.out_std = std / (2 * cfg.n_layers) ** 0.5
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.w_q = _param(rngs, _init.normal(std), (d, n, h), ("embed", "heads", "head_dim"))
        self.w_kv = _param(rngs, _init.normal(std), (d, 2, k, h), ("embed", None, "kv", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.norm_eps)
            self.k_norm = RMSNorm(h, cfg.norm_eps)
        self.w_o = _param(
            rngs, _init.normal(self.out_std), (n, h, d), ("heads", "head_dim", "embed")
        )
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.init_mlp(rngs)

    def init_mlp(self, rngs: nnx.Rngs) -> None:
        d, f, std = self.cfg.d_model, self.cfg.d_mlp, self.cfg.init_std
        self.w_gate_up = _param(rngs, _init.normal(std), (d, 2, f), ("embed", None, "mlp"))
        self.w_down = _param(rngs, _init.normal(self.out_std), (f, d), ("mlp", "embed"))

    def qkv(self, x_BTD, pos_T):
        """Rotated queries [B, T, N, H], keys and values [B, T, K, H] at positions pos_T."""
        q_BTNH = jnp.einsum("btd,dnh->btnh", x_BTD, self.w_q[...])
        k_BTKH, v_BTKH = jnp.einsum("btd,dckh->cbtkh", x_BTD, self.w_kv[...])
        if self.cfg.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        cos_TH, sin_TH = rotary(self.cfg, pos_T)
        q_BTNH, k_BTKH = rotate(q_BTNH, cos_TH, sin_TH), rotate(k_BTKH, cos_TH, sin_TH)
        return (
            constrain(q_BTNH, QKV_NAMES),
            constrain(k_BTKH, KV_NAMES),
            constrain(v_BTKH, KV_NAMES),
        )

    def attention(self, x_BTD):
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, jnp.arange(x_BTD.shape[1]))
        o_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, impl=self.cfg.attention)
        o_BTNH = constrain(o_BTNH, QKV_NAMES)
        return jnp.einsum("btnh,nhd->btd", o_BTNH, self.w_o[...])

    def mlp(self, x_BTD):
        g_BTF, u_BTF = jnp.einsum("btd,dcf->cbtf", x_BTD, self.w_gate_up[...])
        h_BTF = constrain(jax.nn.silu(g_BTF) * u_BTF, ("batch", "seq", "mlp"))
        return h_BTF @ self.w_down[...]

    def attention_cached(self, x_BTD, k_BSKH, v_BSKH, pos):
        """Attention of T new positions [pos, pos + T) to the cache's earlier positions and to
        each other (causal); returns (out_BTD, cache with the new keys and values written)."""
        t, span = x_BTD.shape[1], k_BSKH.shape[1]
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, pos + jnp.arange(t))
        k_BSKH = jax.lax.dynamic_update_slice(k_BSKH, k_BTKH.astype(k_BSKH.dtype), (0, pos, 0, 0))
        v_BSKH = jax.lax.dynamic_update_slice(v_BSKH, v_BTKH.astype(v_BSKH.dtype), (0, pos, 0, 0))
        b, _, n, h = q_BTNH.shape
        kv = k_BSKH.shape[2]
        q_BTKGH = q_BTNH.reshape(b, t, kv, n // kv, h)
        s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH) / jnp.sqrt(h).astype(x_BTD.dtype)
        visible_TS = jnp.arange(span)[None, :] <= pos + jnp.arange(t)[:, None]
        s_BKGTS = jnp.where(visible_TS, s_BKGTS, jnp.finfo(s_BKGTS.dtype).min)
        p_BKGTS = jax.nn.softmax(s_BKGTS.astype(jnp.float32), axis=-1).astype(x_BTD.dtype)
        o_BTNH = jnp.einsum("bkgts,bskh->btkgh", p_BKGTS, v_BSKH).reshape(b, t, n, h)
        return jnp.einsum("btnh,nhd->btd", o_BTNH, self.w_o[...]), k_BSKH, v_BSKH

    def decode(self, x_BTD, k_BSKH, v_BSKH, pos):
        """The block on T new positions with a key/value cache."""
        a_BTD, k_BSKH, v_BSKH = self.attention_cached(self.attn_norm(x_BTD), k_BSKH, v_BSKH, pos)
        x_BTD = x_BTD + a_BTD
        return x_BTD + self.mlp(self.mlp_norm(x_BTD)), k_BSKH, v_BSKH

    def forward(self, x_BTD, key=None):
        x_BTD = x_BTD + self.attention(self.attn_norm(x_BTD))
        x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
        x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
        return constrain(x_BTD, ("batch", "seq", "embed"))

    def __call__(self, x_BTD, key=None):
        if self.cfg.remat == "none":
            return self.forward(x_BTD, key)
        # The same computation; the backward pass recomputes what the policy does not keep.
        policy = REMAT_POLICIES[self.cfg.remat]
        return nnx.remat(type(self).forward, policy=policy)(self, x_BTD, key)


def stacked(block_cls, cfg, rngs: nnx.Rngs) -> nnx.Module:
    """cfg.n_layers blocks of `block_cls` as one module with a leading `layers` dimension."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r: nnx.Rngs):
        return block_cls(cfg, r)

    return make(rngs)


class Llama(nnx.Module):
    block_cls = LlamaBlock

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.d_model, cfg.vocab_size
        self.tok_emb = _param(rngs, _init.normal(cfg.init_std), (v, d), ("vocab", "embed"))
        self.blocks = stacked(self.block_cls, cfg, rngs)
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, _init.normal(cfg.init_std), (d, v), ("embed", "vocab"))

    def embed(self, tokens_BT, key=None):
        if tokens_BT.shape[1] > self.cfg.seq_len:
            raise ValueError(
                f"sequence length {tokens_BT.shape[1]} exceeds the model's seq_len "
                f"{self.cfg.seq_len}"
            )
        x_BTD = jnp.take(self.tok_emb[...], tokens_BT, axis=0)
        return constrain(x_BTD, ("batch", "seq", "embed"))

    def unembed(self, x_BTD):
        h_BTD = self.final_norm(x_BTD)
        if self.cfg.tie_embeddings:
            logits_BTV = jnp.einsum("btd,vd->btv", h_BTD, self.tok_emb[...])
        else:
            logits_BTV = h_BTD @ self.head[...]
        return constrain(logits_BTV, ("batch", "seq", "vocab"))

    def pipeline_parts(self):
        """(embed, blocks, head): embed(tokens_BT, key) -> x_BTD; one layer's slice of the
        stacked blocks is called as block(x_BTD, key); head(x_BTD) -> logits_BTV."""
        return self.embed, self.blocks, self.unembed

    def __call__(self, tokens_BT, key=None):
        x_BTD = self.embed(tokens_BT)
        for i in range(self.cfg.n_layers):
            x_BTD = block_at(self.blocks, i)(x_BTD)
        return self.unembed(x_BTD)

    def init_cache(self, batch: int, dtype=jnp.float32) -> dict:
        """An empty key/value cache for `decode`: {"k", "v"} of [L, B, S, K, H], S = seq_len."""
        c = self.cfg
        shape = (c.n_layers, batch, c.seq_len, c.n_kv_heads, c.hd)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def decode(self, tokens_BT, cache: dict, pos):
        """Logits of tokens_BT at positions [pos, pos + T) given the cache of positions < pos;
        returns (logits_BTV, cache holding positions < pos + T). pos + T <= seq_len."""
        x_BTD = self.embed(tokens_BT)
        ks, vs = [], []
        for i in range(self.cfg.n_layers):
            x_BTD, k, v = block_at(self.blocks, i).decode(x_BTD, cache["k"][i], cache["v"][i], pos)
            ks.append(k)
            vs.append(v)
        return self.unembed(x_BTD), {"k": jnp.stack(ks), "v": jnp.stack(vs)}
