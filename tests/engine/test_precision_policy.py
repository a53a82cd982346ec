"""Precision policy and per-block rematerialisation without a mesh: config keys, validation,
casts, the GPT's float32 islands under bf16, and remat computing the same values."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.config import PrecisionConfig, apply_overrides, config_hash, resolve_recipe
from jaxpar.engine.precision import FP32, policy
from jaxpar.models.gpt import GPTConfig, LayerNorm


@pytest.fixture
def gpt():
    return resolve_recipe("gpt_tiny")


def test_set_keys_reach_the_config(gpt):
    cfg = apply_overrides(gpt, ["precision.compute=bfloat16", "model.remat=dots"])
    assert cfg.precision == PrecisionConfig(params="float32", compute="bfloat16")
    assert cfg.model.remat == "dots"
    assert gpt.precision.compute == "float32" and gpt.model.remat == "none"  # fp32 by default


@pytest.mark.parametrize(
    "override,fix",
    [
        ("precision.compute=float16", "bfloat16"),
        ("precision.params=bfloat16", "precision.compute=bfloat16"),
    ],
)
def test_bad_precision_names_the_fix(gpt, override, fix):
    with pytest.raises(ValueError, match=fix):
        policy(apply_overrides(gpt, [override]).precision)


def test_bad_remat_policy_is_refused_at_set_time(gpt):
    with pytest.raises(ValueError, match="none.*block.*dots"):
        apply_overrides(gpt, ["model.remat=everything"])


def test_config_hash_counts_precision_but_not_remat(gpt):
    h = config_hash(gpt)
    assert config_hash(apply_overrides(gpt, ["precision.compute=bfloat16"])) != h
    assert config_hash(apply_overrides(gpt, ["model.remat=block"])) == h


def test_cast_touches_floating_leaves_only():
    bf16 = policy(PrecisionConfig(compute="bfloat16"))
    tree = {"w": jnp.ones((2, 2)), "tokens": jnp.ones((2,), jnp.int32)}
    out = bf16.cast(tree)
    assert out["w"].dtype == jnp.bfloat16 and out["tokens"].dtype == jnp.int32
    assert FP32.cast(tree) is tree and not FP32.mixed and bf16.mixed


def test_layernorm_statistics_in_float32_under_bf16():
    # A large offset: bf16 statistics would lose the small variations entirely.
    x = 1000.0 + jax.random.normal(jax.random.key(0), (4, 64), jnp.float32)
    with nnx.use_eager_sharding(False):  # an annotated layer built with no mesh
        ln = LayerNorm(64, nnx.Rngs(0))
    want = ln(x)
    got = ln(x.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    # bf16 quantises the input itself (spacing 8 at 1000): compare with that input in float32.
    want_q = ln(x.astype(jnp.bfloat16).astype(jnp.float32))
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want_q))) < 0.05
    assert want.shape == got.shape


def _tiny(**changes) -> GPTConfig:
    return GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=3, d_mlp=64,
                     **changes)  # fmt: skip


def _loss_and_grads(cfg: GPTConfig, compute=jnp.float32):
    with nnx.use_eager_sharding(False):  # an annotated model built with no mesh
        model = cfg.build(nnx.Rngs(params=0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, cfg.vocab_size)
    key = jax.random.key(2)

    def loss_fn(p):
        p = jax.tree.map(lambda a: a.astype(compute), p)
        logits = nnx.merge(graphdef, p)(tokens[:, :-1], key).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


@pytest.fixture(scope="module")
def without_remat():
    """(loss, gradients) of _tiny with dropout and no remat: what every remat must give."""
    return _loss_and_grads(_tiny(dropout=0.1))


@pytest.mark.parametrize("remat", ["block", "dots"])
def test_remat_gives_the_same_loss_and_gradients(remat, without_remat):
    cfg = _tiny(dropout=0.1)  # dropout too: the recomputation must redraw the same bits
    loss, grads = without_remat
    loss_r, grads_r = _loss_and_grads(dataclasses.replace(cfg, remat=remat))
    assert abs(loss_r - loss) <= 1e-6
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), grads, grads_r))
    assert max(diffs) <= 1e-6


def test_bf16_forward_is_finite_and_close_to_fp32():
    cfg = _tiny()
    loss32, grads32 = _loss_and_grads(cfg)
    loss16, grads16 = _loss_and_grads(cfg, jnp.bfloat16)
    assert np.isfinite(loss16) and abs(loss16 - loss32) / loss32 < 2e-2  # the mask's finfo.min
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads16))  # back through the cast
