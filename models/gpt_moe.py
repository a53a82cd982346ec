"""GPT with mixture-of-experts MLPs: gpt's model with MoE blocks on every (or every other) layer.

    python -m train --recipe gpt_moe --mesh dp2_ep4
    python -m train --recipe gpt_moe --mesh data=2,expert=4 --set model.top_k=1

The stacked unit is `models.moe.MoEGroup` (n_layers / moe_every of them). The model's own
forward, `aux_forward(tokens, key) -> (logits, aux)`, returns with the logits the auxiliary
losses and the routing statistics averaged over the MoE layers; the built-in `lm` loss adds
aux["loss"] (moe_aux_weight x load-balancing loss + router_z_weight x z-loss) to the cross
entropy and reports aux["metrics"] on every metrics line (docs/model_contract.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.engine.experts import check_config
from jaxpar.models.gpt import GPT, GPTConfig, LayerNorm, _init, _param, block_at
from jaxpar.models.moe import MoEGroup, aux_of

MOE_IMPLS = ("auto", "dense")


@dataclass(frozen=True)
class GPTMoEConfig(GPTConfig):
    n_experts: int = 8
    top_k: int = 2  # experts per token (1..n_experts)
    capacity_factor: float = 1.25  # slots per expert = ceil(cf x T x top_k / n_experts)
    moe_every: int = 1  # 1: every layer is MoE; 2: every other layer (dense, MoE, ...)
    moe_aux_weight: float = 0.01  # load-balancing loss weight
    router_z_weight: float = 0.001  # router z-loss weight
    # auto: expert parallel (all-to-all over `expert`) when the mesh has expert > 1, else dense;
    # dense: the reference path everywhere. The same values either way: not hashed.
    moe_impl: str = "auto"

    NOT_HASHED: ClassVar[tuple[str, ...]] = ("remat", "moe_impl")

    def __post_init__(self):
        super().__post_init__()
        check_config(self.n_experts, self.top_k, self.capacity_factor)
        if self.moe_every not in (1, 2):
            raise ValueError(f"model.moe_every={self.moe_every}: use 1 (every layer) or 2")
        if self.n_layers % self.moe_every:
            raise ValueError(
                f"model.n_layers={self.n_layers} is not a multiple of model.moe_every="
                f"{self.moe_every}; change one of them"
            )
        for key in ("moe_aux_weight", "router_z_weight"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"model.{key}={v}: use a finite weight >= 0")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"model.moe_impl={self.moe_impl!r}: use one of {list(MOE_IMPLS)}")

    def build(self, rngs: nnx.Rngs) -> GPTMoE:
        return GPTMoE(self, rngs=rngs)

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers // self.moe_every

    def num_params(self) -> int:
        """All parameters (every expert counted)."""
        d, f, e = self.d_model, self.d_mlp, self.n_experts
        dense_mlp = d * f + f + f * d + d
        moe_mlp = d * e + e * dense_mlp
        return super().num_params() + self.n_moe_layers * (moe_mlp - dense_mlp)

    def active_params(self) -> int:
        """Parameters a token passes through: top_k experts per MoE layer (and the router)."""
        d, f = self.d_model, self.d_mlp
        dense_mlp = d * f + f + f * d + d
        extra = d * self.n_experts + (self.top_k - 1) * dense_mlp
        return super().num_params() + self.n_moe_layers * extra

    def dense_equivalent(self) -> GPTConfig:
        """The dense GPT a token costs as much as: one MLP of top_k x d_mlp units per layer."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(GPTConfig)}
        return GPTConfig(**{**fields, "d_mlp": self.d_mlp * self.top_k})

    def flops_per_token(self) -> float:
        """Training FLOPs per token of the active parameters (+ attention scores)."""
        return 6.0 * self.active_params() + 12.0 * self.n_layers * self.seq_len * self.d_model


def stacked_groups(cfg: GPTMoEConfig, rngs: nnx.Rngs) -> MoEGroup:
    """cfg.n_moe_layers groups as one module with a leading `layers` dimension."""

    @nnx.split_rngs(splits=cfg.n_moe_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r: nnx.Rngs) -> MoEGroup:
        return MoEGroup(cfg, r)

    return make(rngs)


class GPTMoE(GPT):
    def __init__(self, cfg: GPTMoEConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.d_model, cfg.vocab_size
        self.tok_emb = _param(rngs, _init.normal(0.02), (v, d), ("vocab", "embed"))
        self.pos_emb = _param(rngs, _init.normal(0.01), (cfg.seq_len, d), (None, "embed"))
        self.blocks = stacked_groups(cfg, rngs)
        self.ln_f = LayerNorm(d, rngs)
        self.head = _param(rngs, _init.normal(0.02), (d, v), ("embed", "vocab"))

    def aux_forward(self, tokens_BT, key=None) -> tuple[jax.Array, dict]:
        """(logits_BTV, {"loss": weighted auxiliary losses, "metrics": routing statistics})."""
        c, groups = self.cfg, self.cfg.n_moe_layers
        keys = jax.random.split(key, groups + 1) if key is not None else None
        x_BTD = self.embed(tokens_BT, None if keys is None else keys[-1])
        per_layer = []
        for i in range(groups):
            x_BTD, stats = block_at(self.blocks, i).forward_stats(
                x_BTD, None if keys is None else keys[i]
            )
            per_layer.append(stats)
        return self.unembed(x_BTD), aux_of(per_layer, c)

    def __call__(self, tokens_BT, key=None):
        return self.aux_forward(tokens_BT, key)[0]

    def decode(self, tokens_BT, cache: dict, pos):
        """Cached decoding (models/gpt.py): layer by layer through each group's blocks."""
        x_BTD = self.embed(tokens_BT, pos=pos)
        ks, vs = [], []
        for i in range(self.cfg.n_moe_layers):
            group = block_at(self.blocks, i)
            for block in (group.dense, group.moe):
                if block is None:
                    continue
                n = len(ks)
                x_BTD, k, v = block.decode(x_BTD, cache["k"][n], cache["v"][n], pos)
                ks.append(k)
                vs.append(v)
        return self.unembed(x_BTD), {"k": jnp.stack(ks), "v": jnp.stack(vs)}
