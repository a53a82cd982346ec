"""The replica groups' screen of a step's gradients (non-finite leaves, sum of squares), computed
inside the gradient program where the gradients lie (`groups.gradient_screen`) instead of by a
host pass over them: it must say what the host screen (group_exchange.screen) says."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.worker import group_exchange, groups


def _sharded(tree: dict):
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    specs = {"w": P("data", "tensor"), "b": P(), "v": P("data"), "n": P()}
    return jax.device_put(tree, {k: NamedSharding(mesh, specs[k]) for k in tree})


def _both(tree: dict):
    device = groups.screened(jax.jit(groups.gradient_screen)(_sharded(tree)))
    host = group_exchange.screen([(i, np.asarray(x)) for i, x in
                                  enumerate(jax.tree.leaves(tree))], None)  # fmt: skip
    return device, host


def _tree(scale: float = 1.0) -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": (rng.normal(size=(64, 32)) * scale).astype(np.float32),
        "b": rng.normal(size=(16,)).astype(np.float32),
        "v": np.zeros((8,), np.float32),  # m = 0: nothing to divide by
        "n": np.arange(4, dtype=np.int32),  # not floating: never bad, no square
    }


@pytest.mark.parametrize("scale", [1.0, 1e20], ids=["plain", "squares_past_float32"])
def test_sum_of_squares_matches_the_host_screen(scale):
    (bad, sq), (host_bad, host_sq) = _both(_tree(scale))
    assert bad == host_bad == []
    assert np.isfinite(sq) and sq == pytest.approx(host_sq, rel=1e-6)  # float32 on the devices


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_leaves_are_named_and_left_out_of_the_norm(value):
    tree = _tree()
    tree["b"][3] = value
    tree["v"][1] = value
    (bad, sq), (host_bad, host_sq) = _both(tree)
    leaves = sorted(tree)  # jax's order of a dict's leaves
    assert bad == host_bad == sorted([leaves.index("b"), leaves.index("v")])
    assert sq == pytest.approx(host_sq, rel=1e-6)
    assert sq == pytest.approx(float(np.sum(tree["w"].astype(np.float64) ** 2)), rel=1e-6)


def test_bfloat16_leaves_are_screened_in_float32():
    tree = {"w": jnp.full((8, 4), 3.0, jnp.bfloat16), "x": jnp.ones((2,), jnp.float32)}
    m, r = jax.jit(groups.gradient_screen)(tree)
    assert m.dtype == jnp.float32
    assert groups.screened((m, r)) == ([], 8 * 4 * 9.0 + 2.0)
