"""A replica group spanning several processes splits the gradient leaves it would replicate over
the batch axes (`groups.spread_over_batch`): each process then holds, sums across groups and
sends only its part; the GPU and TPU compilers reduce the group's gradients with a
reduce-scatter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.tools import targets
from jaxpar.worker.groups import spread_over_batch
from tests.tools.test_targets import _need


def _mesh(**axes):
    names = tuple(axes)
    devices = np.array(jax.devices()[: int(np.prod(list(axes.values())))])
    return jax.sharding.Mesh(devices.reshape(tuple(axes.values())), names)


def test_replicated_leaves_are_split_over_the_free_batch_axes():
    mesh = _mesh(data=2, fsdp=2, tensor=2)
    leaves = {
        "replicated": jax.ShapeDtypeStruct((6, 8), jnp.float32),  # 6 % 4: the second dim
        "on_fsdp": jax.ShapeDtypeStruct((8, 16, 4), jnp.float32),  # data is left: dim 2
        "on_both": jax.ShapeDtypeStruct((8, 16), jnp.float32),  # nothing left to split over
        "odd": jax.ShapeDtypeStruct((3, 5), jnp.float32),  # no dimension 4 divides
        "scalar": jax.ShapeDtypeStruct((), jnp.float32),
    }
    specs = {
        "replicated": P(), "on_fsdp": P("fsdp", "tensor"), "on_both": P(("data", "fsdp")),
        "odd": P(), "scalar": P(),
    }  # fmt: skip
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    out = spread_over_batch(shardings, leaves)
    got = {k: tuple(v.spec) for k, v in out.items()}
    assert got["replicated"] == (None, ("data", "fsdp"))
    assert got["on_fsdp"] == ("fsdp", "tensor", "data")
    assert out["on_both"] is shardings["on_both"]
    assert out["odd"] is shardings["odd"] and out["scalar"] is shardings["scalar"]
    # nothing to split: one device on every batch axis, or every leaf already split over them
    single = _mesh(tensor=2)
    assert spread_over_batch({"w": NamedSharding(single, P())}, {"w": leaves["replicated"]}) is None
    assert spread_over_batch({"w": shardings["on_both"]}, {"w": leaves["on_both"]}) is None


def _grads(mesh, n=64):
    """The gradient of a data-parallel layer, with and without the spread, lowered for `mesh`."""
    w = jax.ShapeDtypeStruct((n, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((8, n), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    spread = spread_over_batch({"w": w.sharding}, {"w": w})["w"]

    def grads(w, x, constrain):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        return jax.lax.with_sharding_constraint(g, spread) if constrain else g

    plain = jax.jit(lambda w, x: grads(w, x, False)).lower(w, x)
    split = jax.jit(lambda w, x: grads(w, x, True)).lower(w, x)
    return w, x, plain, split


def test_each_device_holds_its_part_of_the_same_gradients():
    """Data parallel over 4 devices: each device's result is a quarter of the leaf, equal to the
    replicated gradients' rows. (XLA's CPU backend all-reduces and slices; the GPU and TPU
    compilers reduce-scatter: test_the_cuda_compiler_reduce_scatters_them.)"""
    mesh = _mesh(data=4)
    w, x, plain, split = _grads(mesh)
    plain, split = plain.compile(), split.compile()
    assert split.output_shardings.spec == P("data")
    wv = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    xv = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    args = jax.device_put(wv, w.sharding), jax.device_put(xv, x.sharding)
    a, b = plain(*args), split(*args)
    assert {s.data.shape for s in b.addressable_shards} == {(16, 32)}
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.targets
def test_the_cuda_compiler_reduce_scatters_them():
    """For 8 H100s the same program reduces the gradients with one reduce-scatter (an eighth per
    device) where the unsplit one all-reduces the whole leaf."""
    _need("cuda")
    t = targets.get("h100x8")
    mesh = jax.sharding.Mesh(np.array(targets.devices(t)).reshape(8), ("data",))
    _, _, plain, split = _grads(mesh, n=1024)
    kinds = lambda lowered: [c.kind for c in targets.compile_lowered(t, lowered, mesh).colls]  # noqa: E731
    assert kinds(plain) == ["all-reduce"]
    assert kinds(split) == ["reduce-scatter"]
