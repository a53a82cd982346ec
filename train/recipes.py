"""Recipes: functions returning a typed TrainConfig. `python -m train --recipe NAME`.

A user's own recipe is `--recipe my_module:my_function` (current directory on sys.path).
"""

from __future__ import annotations

import dataclasses

from jaxpar.config import DataConfig, OptimConfig, PrecisionConfig, TrainConfig, TrainLoopConfig
from jaxpar.models.cnn import CNNConfig
from jaxpar.models.gpt import GPTConfig
from jaxpar.models.gpt_moe import GPTMoEConfig
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


RECIPES = {
    f.__name__: f
    for f in (gpt_tiny, gpt_moe, gpt_small, gpt_small_bf16, gpt_350m, digits_mlp, digits_cnn)
}
