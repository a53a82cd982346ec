"""Llama-family decoder with mixture-of-experts MLPs: Mixtral and Qwen3-MoE (and Qwen2-MoE's shared
expert), written once with logical axis names.

    python -m train --recipe mixtral_tiny --mesh data=2,expert=4
    python -m train --recipe qwen3_moe_tiny --mesh dp2_ep4
    jaxpar inspect --recipe qwen3_30b_a3b --mesh fsdp8

models/llama.py's blocks with the SwiGLU MLP replaced by `n_experts` gated (SwiGLU) experts of
width `d_expert` through jaxpar.engine.experts.moe_ffn: a router [D, E] in float32, softmax over
all experts, the `top_k` best per token, their weights renormalised to sum to 1 when
`normalize_top_k` (Mixtral; Qwen3-MoE's `norm_topk_prob`), a capacity per expert
(`capacity_factor`; set it to n_experts / top_k and nothing is ever dropped, as in Hugging Face's
dropless implementation). Optionally a shared expert every token passes through, scaled by a
sigmoid gate (Qwen2-MoE): `shared_expert_mlp` > 0.

Legend as in models/llama.py, plus E experts, Fe the width of one expert, Fs the shared expert's.
The model's own forward, `aux_forward(tokens, key) -> (logits, aux)`, returns the load-balancing
and router z-losses and the routing statistics as models/gpt_moe.py does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.engine.experts import check_config, moe_ffn
from jaxpar.engine.rules import constrain
from jaxpar.models.gpt import REMAT_POLICIES, _init, _param, block_at
from jaxpar.models.gpt_moe import MOE_IMPLS
from jaxpar.models.llama import Llama, LlamaBlock, LlamaConfig
from jaxpar.models.moe import aux_of, check_no_aux_losses


@dataclass(frozen=True)
class LlamaMoEConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 128  # width of one expert's SwiGLU MLP
    capacity_factor: float = 1.25  # slots per expert = ceil(cf x T x top_k / n_experts)
    normalize_top_k: bool = True  # the chosen experts' weights renormalised to sum to 1
    shared_expert_mlp: int = 0  # width of a shared expert with a sigmoid gate (0: none)
    moe_aux_weight: float = 0.01  # load-balancing loss weight
    router_z_weight: float = 0.001  # router z-loss weight
    moe_impl: str = "auto"  # auto | dense (models/gpt_moe.py): the same values either way

    NOT_HASHED: ClassVar[tuple[str, ...]] = ("remat", "attention", "moe_impl")

    def __post_init__(self):
        super().__post_init__()
        check_config(self.n_experts, self.top_k, self.capacity_factor)
        for key in ("moe_aux_weight", "router_z_weight"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"model.{key}={v}: use a finite weight >= 0")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"model.moe_impl={self.moe_impl!r}: use one of {list(MOE_IMPLS)}")

    def build(self, rngs: nnx.Rngs) -> LlamaMoE:
        return LlamaMoE(self, rngs=rngs)

    def mlp_params(self) -> int:
        d = self.d_model
        shared = 3 * d * self.shared_expert_mlp + d if self.shared_expert_mlp else 0
        return d * self.n_experts + self.n_experts * 3 * d * self.d_expert + shared

    def active_params(self) -> int:
        """Parameters a token passes through: top_k experts per layer (and the router)."""
        idle = (self.n_experts - self.top_k) * 3 * self.d_model * self.d_expert
        return self.num_params() - self.n_layers * idle

    def flops_per_token(self) -> float:
        """Training FLOPs per token of the active matmul parameters (+ attention)."""
        idle = (self.n_experts - self.top_k) * 3 * self.d_model * self.d_expert
        return super().flops_per_token() - 6.0 * self.n_layers * idle


class LlamaMoEBlock(LlamaBlock):
    """x + attn(norm(x)); x + moe(norm(x)) [+ the shared expert]."""

    def init_mlp(self, rngs: nnx.Rngs) -> None:
        c = self.cfg
        d, e, f, std = c.d_model, c.n_experts, c.d_expert, c.init_std
        self.router = _param(rngs, _init.normal(std), (d, e), ("embed", None))
        self.w_gate = _param(rngs, _init.normal(std), (e, d, f), ("expert", "embed", "mlp"))
        self.w_up = _param(rngs, _init.normal(std), (e, d, f), ("expert", "embed", "mlp"))
        self.w_down = _param(
            rngs, _init.normal(self.out_std), (e, f, d), ("expert", "mlp", "embed")
        )
        if c.shared_expert_mlp:
            fs = c.shared_expert_mlp
            self.shared_gate_up = _param(
                rngs, _init.normal(std), (d, 2, fs), ("embed", None, "mlp")
            )
            self.shared_down = _param(rngs, _init.normal(self.out_std), (fs, d), ("mlp", "embed"))
            self.shared_gate = _param(rngs, _init.normal(std), (d, 1), ("embed", None))

    def moe(self, x_BTD, dropless: bool = False) -> tuple[jax.Array, dict]:
        """(y_BTD, routing stats); `dropless`: a capacity of every token (decoding)."""
        c = self.cfg
        cf = c.n_experts / c.top_k if dropless else c.capacity_factor
        y_BTD, stats = moe_ffn(
            x_BTD, self.router[...], self.w_up[...], None, self.w_down[...], None,
            top_k=c.top_k, capacity_factor=cf, dense=c.moe_impl == "dense",
            w_gate_EDF=self.w_gate[...], activation="silu", normalize_top_k=c.normalize_top_k,
        )  # fmt: skip
        if c.shared_expert_mlp:
            g_BTF, u_BTF = jnp.einsum("btd,dcf->cbtf", x_BTD, self.shared_gate_up[...])
            h_BTF = constrain(jax.nn.silu(g_BTF) * u_BTF, ("batch", "seq", "mlp"))
            gate_BT1 = jax.nn.sigmoid(x_BTD @ self.shared_gate[...])
            y_BTD = y_BTD + gate_BT1 * (h_BTF @ self.shared_down[...])
        return constrain(y_BTD, ("batch", "seq", "embed")), stats

    def mlp(self, x_BTD):
        """LlamaBlock.decode's MLP: no token dropped, whatever the chunk's length (a capacity
        per sequence would depend on how the sequence is cut; Hugging Face's is dropless)."""
        return self.moe(x_BTD, dropless=True)[0]

    def forward_stats(self, x_BTD, key=None) -> tuple[jax.Array, dict]:
        x_BTD = x_BTD + self.attention(self.attn_norm(x_BTD))
        x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
        y_BTD, stats = self.moe(self.mlp_norm(x_BTD))
        return constrain(x_BTD + y_BTD, ("batch", "seq", "embed")), stats

    def stats_call(self, x_BTD, key=None) -> tuple[jax.Array, dict]:
        if self.cfg.remat == "none":
            return self.forward_stats(x_BTD, key)
        policy = REMAT_POLICIES[self.cfg.remat]
        return nnx.remat(LlamaMoEBlock.forward_stats, policy=policy)(self, x_BTD, key)

    def __call__(self, x_BTD, key=None):
        """The output alone: the form a pipeline stage calls. A pipeline computes the loss
        stage by stage, so the auxiliary losses cannot reach it: refused unless they are off."""
        check_no_aux_losses(self.cfg)
        return self.stats_call(x_BTD, key)[0]


class LlamaMoE(Llama):
    block_cls = LlamaMoEBlock

    def aux_forward(self, tokens_BT, key=None) -> tuple[jax.Array, dict]:
        """(logits_BTV, {"loss": weighted auxiliary losses, "metrics": routing statistics})."""
        c = self.cfg
        x_BTD = self.embed(tokens_BT)
        per_layer = []
        for i in range(c.n_layers):
            x_BTD, stats = block_at(self.blocks, i).stats_call(x_BTD)
            per_layer.append(stats)
        return self.unembed(x_BTD), aux_of(per_layer, c)

    def __call__(self, tokens_BT, key=None):
        return self.aux_forward(tokens_BT, key)[0]
