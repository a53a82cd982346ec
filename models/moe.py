"""Mixture-of-experts blocks for decoder-only transformers, written with logical axis names.

`MoEBlock` is gpt's pre-norm block with its MLP replaced by E experts and a top-k router
(jaxpar.engine.experts.moe_ffn: per-sequence routing with a capacity, expert parallelism over the
`expert` mesh axis when the mesh has one). `MoEGroup` is the unit that is stacked over layers:
with `moe_every` = 1 one MoE block, with 2 a dense gpt block followed by an MoE block.

Legend as in models/gpt.py, plus E experts. Expert weights carry the logical axis `expert`
first, then `embed` / `mlp` like a dense MLP (so the experts' MLP dimension splits over
`tensor`); the router [D, E] is replicated over the experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.engine.experts import moe_ffn
from jaxpar.engine.rules import constrain
from jaxpar.models.gpt import REMAT_POLICIES, Block, _dropout, _init, _param

STAT_KEYS = ("aux", "z", "dropped", "load")


class MoEBlock(Block):
    """x + attn(ln(x)); x + moe(ln(x)). The attention is gpt's Block's."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        del self.w_in, self.b_in, self.w_out, self.b_out  # the dense MLP: replaced by experts
        d, f, e = cfg.d_model, cfg.d_mlp, cfg.n_experts
        std, out_std = 0.02, 0.02 / (2 * cfg.n_layers) ** 0.5
        self.router = _param(rngs, _init.normal(std), (d, e), ("embed", None))
        self.w_in = _param(rngs, _init.normal(std), (e, d, f), ("expert", "embed", "mlp"))
        self.b_in = _param(rngs, _init.zeros, (e, f), ("expert", "mlp"))
        self.w_out = _param(rngs, _init.normal(out_std), (e, f, d), ("expert", "mlp", "embed"))
        self.b_out = _param(rngs, _init.zeros, (e, d), ("expert", "embed"))

    def moe(self, x_BTD) -> tuple[jax.Array, dict]:
        c = self.cfg
        y_BTD, stats = moe_ffn(
            x_BTD, self.router[...], self.w_in[...], self.b_in[...], self.w_out[...],
            self.b_out[...], top_k=c.top_k, capacity_factor=c.capacity_factor,
            dense=c.moe_impl == "dense",
        )  # fmt: skip
        return constrain(y_BTD, ("batch", "seq", "embed")), stats

    def mlp(self, x_BTD):  # gpt's Block.decode calls it
        return self.moe(x_BTD)[0]

    def forward_stats(self, x_BTD, key=None) -> tuple[jax.Array, dict]:
        rate = self.cfg.dropout
        k_attn, k_res1, k_res2 = jax.random.split(key, 3) if key is not None else (None,) * 3
        x_BTD = x_BTD + _dropout(self.attention(self.ln1(x_BTD), k_attn), rate, k_res1)
        x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
        y_BTD, stats = self.moe(self.ln2(x_BTD))
        x_BTD = x_BTD + _dropout(y_BTD, rate, k_res2)
        return constrain(x_BTD, ("batch", "seq", "embed")), stats


class MoEGroup(nnx.Module):
    """`moe_every` layers: (a dense gpt block, then) an MoE block; stacked over the layers."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dense = Block(cfg, rngs) if cfg.moe_every == 2 else None
        self.moe = MoEBlock(cfg, rngs)

    def forward_stats(self, x_BTD, key=None) -> tuple[jax.Array, dict]:
        """(output, the MoE block's stats): the form the model's own forward uses."""
        k_dense, k_moe = jax.random.split(key) if key is not None else (None, None)
        if self.dense is not None:
            x_BTD = self.dense(x_BTD, k_dense)
        if self.cfg.remat == "none":
            return self.moe.forward_stats(x_BTD, k_moe)
        policy = REMAT_POLICIES[self.cfg.remat]
        return nnx.remat(MoEBlock.forward_stats, policy=policy)(self.moe, x_BTD, k_moe)

    def __call__(self, x_BTD, key=None):
        """The output alone: the form a pipeline stage calls. A pipeline computes the loss
        stage by stage, so the auxiliary losses cannot reach it: refused unless they are off."""
        check_no_aux_losses(self.cfg)
        return self.forward_stats(x_BTD, key)[0]


def check_no_aux_losses(cfg) -> None:
    """A pipeline stage calls an MoE block for its output alone: refuse auxiliary losses it
    would silently leave out."""
    if cfg.moe_aux_weight or cfg.router_z_weight:
        raise ValueError(
            "a pipeline computes the loss stage by stage and cannot add the MoE auxiliary "
            "losses; set model.moe_aux_weight=0 and model.router_z_weight=0, or pipeline=1"
        )


def mean_stats(per_layer: list[dict]) -> dict:
    """The MoE layers' stats averaged over the layers."""
    return {k: jnp.mean(jnp.stack([s[k] for s in per_layer]), axis=0) for k in STAT_KEYS}


def aux_of(per_layer: list[dict], cfg) -> dict:
    """An MoE model's `aux_forward` aux: the weighted load-balancing and z-losses and the
    routing metrics, averaged over its MoE layers (docs/model_contract.md)."""
    s = mean_stats(per_layer)
    metrics = {
        "moe_aux_loss": s["aux"], "moe_z_loss": s["z"], "moe_dropped_frac": s["dropped"],
        "moe_expert_load": s["load"],
    }  # fmt: skip
    return {
        "loss": cfg.moe_aux_weight * s["aux"] + cfg.router_z_weight * s["z"],
        "metrics": metrics,
    }
