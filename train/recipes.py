"""Recipes: functions returning a typed TrainConfig. `python -m train --recipe NAME`.

A user's own recipe is `--recipe my_module:my_function` (current directory on sys.path).
"""

from __future__ import annotations

import dataclasses

from jaxpar.config import DataConfig, OptimConfig, PrecisionConfig, TrainConfig, TrainLoopConfig
from jaxpar.models.cnn import CNNConfig
from jaxpar.models.gpt import GPTConfig
from jaxpar.models.gpt_moe import GPTMoEConfig
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.llama_moe import LlamaMoEConfig
from jaxpar.models.mlp import MLPConfig


def gpt_tiny() -> TrainConfig:
    """The default job: a 0.87M-parameter GPT on Python stdlib bytes; every 8-device layout divides it."""
    return TrainConfig(
        name="gpt_tiny",
        model=GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4, d_mlp=512),
        data=DataConfig(source="stdlib_text", global_batch=32, seq_len=64),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        train=TrainLoopConfig(steps=200, eval_every=100, eval_batches=2),
    )


def gpt_moe() -> TrainConfig:
    """gpt_tiny with a mixture of 8 experts (top-2, d_mlp 256 each) on every layer: 2.4M
    parameters, of which each token uses as many as gpt_tiny's. `--mesh dp2_ep4` splits the
    experts 4 ways (all-to-all over `expert`)."""
    return TrainConfig(
        name="gpt_moe",
        model=GPTMoEConfig(
            vocab_size=256,
            seq_len=64,
            d_model=128,
            n_heads=4,
            n_layers=4,
            d_mlp=256,
            n_experts=8,
            top_k=2,
            capacity_factor=1.25,
        ),  # fmt: skip
        data=DataConfig(source="stdlib_text", global_batch=32, seq_len=64),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        train=TrainLoopConfig(steps=200, eval_every=100, eval_batches=2),
    )


def gpt_small() -> TrainConfig:
    """A 4.8M-parameter GPT with dropout (keyed by seed and step, so resumption stays exact)."""
    return TrainConfig(
        name="gpt_small",
        model=GPTConfig(
            vocab_size=256, seq_len=128, d_model=256, n_heads=8, n_layers=6, d_mlp=1024, dropout=0.1
        ),
        data=DataConfig(source="stdlib_text", global_batch=32, seq_len=128),
        optim=OptimConfig(lr=1e-3, warmup_steps=50),
        train=TrainLoopConfig(steps=1000, eval_every=250, eval_batches=4),
    )


def gpt_350m() -> TrainConfig:
    """GPT-2 medium's shape (24 layers, d_model 1024, 16 heads, seq 1024; 406M parameters with
    an untied 50304-entry vocabulary) for one GPU: bf16 compute, per-block rematerialisation.

    The data is the byte-level stdlib_text corpus (ids < 256, the data module's real text); the
    vocabulary stays GPT-2-sized (50257 padded to a multiple of 128) so that the FLOPs, memory and
    MFU are those of a GPT-2-medium-class model.

        python -m train --recipe gpt_350m --mesh h200x1
    """
    return TrainConfig(
        name="gpt_350m",
        model=GPTConfig(
            vocab_size=50304,
            seq_len=1024,
            d_model=1024,
            n_heads=16,
            n_layers=24,
            d_mlp=4096,
            remat="dots",
        ),  # fmt: skip
        data=DataConfig(source="stdlib_text", global_batch=16, seq_len=1024),
        optim=OptimConfig(lr=3e-4, warmup_steps=200, weight_decay=0.1),
        train=TrainLoopConfig(steps=5000, eval_every=500, eval_batches=4),
        precision=PrecisionConfig(compute="bfloat16"),
    )


def gpt_small_bf16() -> TrainConfig:
    """gpt_small with bf16 compute and per-block rematerialisation (for a GPU)."""
    cfg = gpt_small()
    return dataclasses.replace(
        cfg,
        name="gpt_small_bf16",
        model=dataclasses.replace(cfg.model, remat="block"),
        precision=PrecisionConfig(compute="bfloat16"),
    )


def digits_mlp() -> TrainConfig:
    """MLP on scikit-learn's bundled 8x8 digits (no download)."""
    return TrainConfig(
        name="digits_mlp",
        model=MLPConfig(hidden=256),
        data=DataConfig(source="digits", global_batch=64),
        optim=OptimConfig(lr=3e-3, warmup_steps=10, weight_decay=1e-4),
        train=TrainLoopConfig(steps=300, eval_every=100, eval_batches=4),
    )


def digits_cnn() -> TrainConfig:
    """Small CNN on scikit-learn's bundled 8x8 digits."""
    return TrainConfig(
        name="digits_cnn",
        model=CNNConfig(channels=(32, 64)),
        data=DataConfig(source="digits", global_batch=64),
        optim=OptimConfig(lr=3e-3, warmup_steps=10, weight_decay=1e-4),
        train=TrainLoopConfig(steps=300, eval_every=100, eval_batches=4),
    )


# ---- Llama-family models (models/llama.py, models/llama_moe.py; docs/models.md) ----------------
# The tiny ones are random and train on the stdlib_text bytes in seconds; the real shapes are for
# `jaxpar inspect` / `jaxpar tune` (nothing allocated) or for a Hugging Face checkpoint of that
# shape (`--init-from hf:DIR`). Their parameter counts are the published ones.

_LLAMA3_ROPE = dict(rope_theta=500000.0, rope_scaling="llama3", rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_len=8192)  # fmt: skip


def _tiny(name: str, model, lr: float = 3e-3) -> TrainConfig:
    return TrainConfig(
        name=name,
        model=model,
        data=DataConfig(source="stdlib_text", global_batch=16, seq_len=model.seq_len),
        optim=OptimConfig(lr=lr, warmup_steps=20),
        train=TrainLoopConfig(steps=200, eval_every=100, eval_batches=2),
    )


def _real(name: str, model, batch: int = 8) -> TrainConfig:
    return TrainConfig(
        name=name,
        model=model,
        data=DataConfig(source="stdlib_text", global_batch=batch, seq_len=model.seq_len),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000, weight_decay=0.1, b2=0.95),
        train=TrainLoopConfig(steps=100_000, eval_every=1000, eval_batches=4),
        precision=PrecisionConfig(compute="bfloat16"),
    )


def llama3_tiny() -> TrainConfig:
    """A 3.2M-parameter Llama 3 (grouped-query attention 8/4 heads, Llama 3 rotary scaling,
    SwiGLU, RMSNorm) on stdlib bytes; every 8-device layout divides it."""
    model = LlamaConfig(
        vocab_size=256, seq_len=128, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
        d_mlp=768, rope_factor=8.0, **{**_LLAMA3_ROPE, "rope_original_max_len": 64},
    )  # fmt: skip
    return _tiny("llama3_tiny", model)


def qwen3_tiny() -> TrainConfig:
    """A Qwen3-style dense model (q/k RMSNorm per head, explicit head_dim, tied embeddings)."""
    model = LlamaConfig(
        vocab_size=256, seq_len=128, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
        head_dim=32, d_mlp=768, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        tie_embeddings=True,
    )  # fmt: skip
    return _tiny("qwen3_tiny", model)


def mixtral_tiny() -> TrainConfig:
    """A Mixtral-style MoE: 8 SwiGLU experts, top-2 renormalised, on every layer."""
    model = LlamaMoEConfig(
        vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=8, n_kv_heads=4,
        d_mlp=384, rope_theta=1e6, n_experts=8, top_k=2, d_expert=256,
    )  # fmt: skip
    return _tiny("mixtral_tiny", model)


def qwen3_moe_tiny() -> TrainConfig:
    """A Qwen3-MoE-style model: 16 fine-grained experts, top-4 renormalised, q/k norm."""
    model = LlamaMoEConfig(
        vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=8, n_kv_heads=4,
        head_dim=32, d_mlp=384, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, n_experts=16,
        top_k=4, d_expert=64,
    )  # fmt: skip
    return _tiny("qwen3_moe_tiny", model)


def llama3_1b() -> TrainConfig:
    """Llama 3.2 1B's shape: 1,235,814,400 parameters (tied embeddings)."""
    model = LlamaConfig(
        vocab_size=128256, seq_len=8192, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
        head_dim=64, d_mlp=8192, rope_factor=32.0, tie_embeddings=True, remat="block",
        **_LLAMA3_ROPE,
    )  # fmt: skip
    return _real("llama3_1b", model)


def llama3_8b() -> TrainConfig:
    """Llama 3.1 8B's shape: 8,030,261,248 parameters.

    jaxpar inspect --recipe llama3_8b --mesh fsdp8
    """
    model = LlamaConfig(
        vocab_size=128256, seq_len=8192, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        d_mlp=14336, rope_factor=8.0, remat="block", **_LLAMA3_ROPE,
    )  # fmt: skip
    return _real("llama3_8b", model)


def llama3_70b() -> TrainConfig:
    """Llama 3.1 70B's shape: 70,553,706,496 parameters."""
    model = LlamaConfig(
        vocab_size=128256, seq_len=8192, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        d_mlp=28672, rope_factor=8.0, remat="block", **_LLAMA3_ROPE,
    )  # fmt: skip
    return _real("llama3_70b", model)


def qwen3_30b_a3b() -> TrainConfig:
    """Qwen3-30B-A3B's shape: 30,532,122,624 parameters, 128 experts of which 8 per token."""
    model = LlamaMoEConfig(
        vocab_size=151936, seq_len=4096, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
        head_dim=128, d_mlp=6144, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, n_experts=128,
        top_k=8, d_expert=768, normalize_top_k=True, remat="block",
    )  # fmt: skip
    return _real("qwen3_30b_a3b", model)


def mixtral_8x7b() -> TrainConfig:
    """Mixtral 8x7B's shape: 46,702,792,704 parameters, 8 experts of which 2 per token."""
    model = LlamaMoEConfig(
        vocab_size=32000, seq_len=4096, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        d_mlp=14336, rope_theta=1e6, n_experts=8, top_k=2, d_expert=14336, remat="block",
    )  # fmt: skip
    return _real("mixtral_8x7b", model)


RECIPES = {
    f.__name__: f
    for f in (
        gpt_tiny,
        gpt_moe,
        gpt_small,
        gpt_small_bf16,
        gpt_350m,
        digits_mlp,
        digits_cnn,
        llama3_tiny,
        qwen3_tiny,
        mixtral_tiny,
        qwen3_moe_tiny,
        llama3_1b,
        llama3_8b,
        llama3_70b,
        qwen3_30b_a3b,
        mixtral_8x7b,
    )  # fmt: skip
}
