"""The Llama-family models (models/llama.py, models/llama_moe.py) inside jaxpar: the real shapes'
parameter counts, cached decoding against the full forward pass, and training on every kind of
layout against the one-device-equivalent reference (dp8). Parity with Hugging Face's
implementation: tests/hf/.

    python -m pytest tests/models/test_llama.py -s
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import apply_overrides, resolve_recipe
from jaxpar.engine.model import build

# Published parameter counts (the model cards' safetensors totals).
PUBLISHED = {
    "llama3_1b": 1_235_814_400,  # Llama 3.2 1B
    "llama3_8b": 8_030_261_248,  # Llama 3.1 8B
    "llama3_70b": 70_553_706_496,  # Llama 3.1 70B
    "qwen3_30b_a3b": 30_532_122_624,  # Qwen3-30B-A3B
    "mixtral_8x7b": 46_702_792_704,  # Mixtral 8x7B
}
STEPS = 3
SMALL = ("model.n_layers=2", "model.d_model=64", "model.d_mlp=96", "model.seq_len=32",
         "data.seq_len=32", "data.global_batch=16")  # fmt: skip
# MoE: every token fits (capacity n_experts / top_k), no auxiliary losses (a pipeline refuses them)
MOE = ("model.d_expert=32", "model.capacity_factor=4.0", "model.moe_aux_weight=0",
       "model.router_z_weight=0")  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_shapes_have_the_published_parameter_counts(name):
    model = resolve_recipe(name).model
    assert model.num_params() == PUBLISHED[name]
    if hasattr(model, "active_params"):  # 3.3B of Qwen3-30B-A3B, 12.9B of Mixtral per token
        assert model.active_params() < model.num_params() / 3
    active = getattr(model, "active_params", model.num_params)()
    lookup = 0 if model.tie_embeddings else model.vocab_size * model.d_model  # no matmul
    attn = 12 * model.n_layers * model.seq_len * model.n_heads * model.hd
    assert model.flops_per_token() == 6 * (active - lookup) + attn


@pytest.mark.parametrize("name", ["llama3_tiny", "qwen3_tiny", "mixtral_tiny", "qwen3_moe_tiny"])
def test_built_model_has_its_counted_parameters_and_cached_decoding_matches(name):
    """num_params counts the built model; the KV-cached path (a prompt, then one token at a
    time) gives the full forward pass's logits (rotary positions, grouped kv heads)."""
    cfg = resolve_recipe(name).model
    built = nnx.eval_shape(lambda: build(cfg, 0))  # the built model's arrays, none computed
    assert sum(x.size for x in jax.tree.leaves(_params(built))) == cfg.num_params()
    cfg = apply_overrides(resolve_recipe(name), [*SMALL, *_moe(name)]).model
    if hasattr(cfg, "n_experts"):  # the full forward drops no token either
        cfg = dataclasses.replace(cfg, capacity_factor=cfg.n_experts / cfg.top_k)
    model = build(cfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab_size)
    full = np.asarray(nnx.jit(type(model).__call__)(model, tokens))
    prefill, step = nnx.jit(type(model).decode), nnx.jit(type(model).decode)
    logits, cache = prefill(model, tokens[:, :20], model.init_cache(2), 0)
    got = [np.asarray(logits)]
    for t in range(20, 24):
        logits, cache = step(model, tokens[:, t : t + 1], cache, jnp.int32(t))
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=2e-5, rtol=0)
    assert cache["k"].shape == (cfg.n_layers, 2, cfg.seq_len, cfg.n_kv_heads, cfg.hd)


def _params(model):
    return nnx.state(model, nnx.Param)


def test_bad_configs_are_refused_with_the_fix():
    base = resolve_recipe("llama3_tiny")
    with pytest.raises(ValueError, match="not a multiple of model.n_kv_heads"):
        apply_overrides(base, ["model.n_kv_heads=3"])
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        apply_overrides(base, ["model.sliding_window=64"])
    with pytest.raises(ValueError, match="rope_scaling"):
        apply_overrides(base, ["model.rope_scaling=yarn"])
    with pytest.raises(ValueError, match="top_k"):
        apply_overrides(resolve_recipe("mixtral_tiny"), ["model.top_k=9"])


def _moe(name: str) -> tuple[str, ...]:
    return MOE if "moe" in name or "mixtral" in name else ()


def _config(jp, name: str, *extra: str):
    return apply_overrides(jp.recipe(name, steps=STEPS), [*SMALL, *_moe(name), *extra])


def _compile(jp, cfg, layout: str):
    """jp.compile_layout without the collective audit (its HLO text parsed), which no test here
    reads."""
    b = jp.build(cfg, layout)
    return jp.Compiled(b, jp.compile_train_step(b), [])


@pytest.fixture(scope="module")
def references(jp):
    """dp8 runs: the reference every layout of the same model must reproduce."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = jp.train(_compile(jp, _config(jp, name), "dp8"))
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, layout, extra",
    [
        ("llama3_tiny", "dp2_tp4", ()),
        ("llama3_tiny", "fsdp4_tp2", ()),
        ("qwen3_tiny", "data=2,context=4", ("model.attention=ring",)),
        ("llama3_tiny", "data=2,context=4", ("model.attention=alltoall",)),
        ("qwen3_tiny", "pp2", ("pipeline.schedule=1f1b", "pipeline.microbatches=4")),
        ("qwen3_moe_tiny", "data=2,expert=4", ()),
        ("mixtral_tiny", "data=2,expert=2,tensor=2", ()),
    ],
)
def test_layouts_train_like_the_reference(jp, references, name, layout, extra):
    """Losses within 1e-5 of dp8's over 3 AdamW steps, first-step gradients within 2e-6."""
    ref = references(name)
    got = jp.train(_compile(jp, _config(jp, name, *extra), layout))
    print(f"\n[{name}] {layout} {got.losses} dp8 {ref.losses}")
    assert np.all(np.isfinite(got.losses)) and got.losses[-1] < got.losses[0]
    assert jp.max_rel(got.losses, ref.losses) <= 1e-5
    assert jp.max_abs_tree(got.grads, ref.grads) <= 2e-6


def test_logits_do_not_depend_on_padding_positions_after_them():
    """Causality: changing later tokens leaves earlier positions' logits unchanged (qwen3_tiny
    made smaller: SMALL's two layers over 32 positions show it as its four over 128 do)."""
    cfg = apply_overrides(resolve_recipe("qwen3_tiny"), SMALL).model
    model = build(cfg, 0)
    a = jax.random.randint(jax.random.key(2), (1, cfg.seq_len), 0, cfg.vocab_size)
    b = a.at[:, 20:].set((a[:, 20:] + 7) % cfg.vocab_size)
    forward = nnx.jit(type(model).__call__)  # one program for both sequences
    la, lb = np.asarray(forward(model, a)), np.asarray(forward(model, b))
    np.testing.assert_allclose(la[:, :20], lb[:, :20], atol=1e-6)
    assert not np.allclose(la[:, 20:], lb[:, 20:])
    assert jnp.issubdtype(la.dtype, jnp.floating)
