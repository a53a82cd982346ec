"""A model's auxiliary losses (`aux_forward`, docs/model_contract.md): the built-in `lm` loss adds
them and reports their metrics; per-expert loads are the one vector metric."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.engine import losses


class WithAux(nnx.Module):
    def __init__(self, aux_loss: float):
        self.emb = nnx.Param(jax.random.normal(jax.random.key(0), (16, 16)))
        self.aux_loss = aux_loss

    def __call__(self, tokens_BT, key=None):
        return self.aux_forward(tokens_BT, key)[0]

    def aux_forward(self, tokens_BT, key=None):
        load = jnp.array([0.75, 0.25])
        metrics = {"moe_aux_loss": jnp.float32(1.5), "moe_expert_load": load}
        return self.emb[...][tokens_BT], {"loss": jnp.float32(self.aux_loss), "metrics": metrics}


def test_lm_loss_adds_the_models_auxiliary_losses_and_reports_them():
    tokens = jnp.arange(8).reshape(2, 4)
    batch = {"inputs": tokens, "targets": (tokens + 1) % 16}
    model = WithAux(0.25)
    ce = optax.softmax_cross_entropy_with_integer_labels(model(tokens), batch["targets"]).mean()
    loss, metrics = losses.check_output(losses.causal_lm(model, batch, None), "the loss")
    assert float(loss) == pytest.approx(float(ce) + 0.25, rel=1e-6)
    assert float(metrics["moe_aux_loss"]) == 1.5
    np.testing.assert_allclose(metrics["moe_expert_load"], [0.75, 0.25])


def test_only_the_listed_vector_metrics_may_be_vectors():
    vec = jnp.ones(3)
    losses.check_output((jnp.float32(1), {"moe_expert_load": vec}), "the loss")
    with pytest.raises(ValueError, match="non-scalar metrics"):
        losses.check_output((jnp.float32(1), {"accuracy": vec}), "the loss")
    with pytest.raises(ValueError, match="non-scalar metrics"):
        losses.check_output((jnp.float32(1), {"moe_expert_load": jnp.ones((2, 2))}), "the loss")


def test_aux_forward_must_return_a_loss():
    class Bad(WithAux):
        def aux_forward(self, tokens_BT, key=None):
            return self.emb[...][tokens_BT], 0.5

    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"aux_forward returned aux float.*\"loss\""):
        losses.causal_lm(Bad(0.0), {"inputs": tokens, "targets": tokens}, None)
