"""jaxpar.engine.attention with grouped-query attention: every kernel against a float32
reference that repeats the kv heads (values and gradients, a non-default scale), the bytes that
travel over `context` (K kv heads, never N), and the one-line refusals of shapes and splits
that cannot work.

The kernels run on small random q/k/v inside activation_rules, as a model's attention does inside
jaxpar's step (tests/engine/test_attention.py: the multi-head cases and the ring's permute
count).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.engine import attention as attn
from jaxpar.engine import collectives
from jaxpar.engine.mesh import make_mesh
from jaxpar.engine.rules import ACT_RULES, activation_rules, constrain

B, T, N, H = 2, 64, 8, 16
SCALE = 0.3  # not 1/sqrt(H) = 0.25


def _inputs(kv: int):
    ks = jax.random.split(jax.random.key(kv), 4)
    return (
        jax.random.normal(ks[0], (B, T, N, H), jnp.float32),
        jax.random.normal(ks[1], (B, T, kv, H), jnp.float32),
        jax.random.normal(ks[2], (B, T, kv, H), jnp.float32),
        jax.random.normal(ks[3], (B, T, N, H), jnp.float32),  # the loss's weights
    )


def reference(q, k, v, *, scale, causal=True):
    """Plain float32 softmax attention with each kv head repeated for its N/K query heads."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v, precision="highest")


@functools.cache
def _compiled(mesh_text: str, impl: str, kv: int, causal: bool = True):
    """(mesh, compiled value_and_grad of sum(attention * w) w.r.t. q, k, v) — shared by the
    parity and the bytes checks."""
    mesh = make_mesh(mesh_text)
    q, k, v, w = _inputs(kv)

    def loss(q, k, v):
        with activation_rules(mesh, ACT_RULES):
            q = constrain(q, attn.NAMES)
            k, v = (constrain(x, attn.KV_NAMES) for x in (k, v))
            o = attn.attention(q, k, v, impl=impl, causal=causal, scale=SCALE)
            return jnp.sum(o * w)

    return mesh, jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, k, v).compile()


CASES = [
    ("data=2,context=4", "ring", 2, True),
    ("data=2,context=4", "allgather", 2, True),
    ("data=2,context=4", "alltoall", 4, True),
    ("data=2,tensor=2,context=2", "ring", 4, True),
    ("data=2,tensor=2,context=2", "allgather", 2, True),  # one kv head per device
    ("data=2,tensor=2,context=2", "alltoall", 4, True),
    ("context=8", "ring", 1, False),  # multi-query, not causal
]


@pytest.mark.parametrize("mesh_text, impl, kv, causal", CASES)
def test_gqa_kernel_matches_repeated_kv_reference(mesh_text, impl, kv, causal):
    q, k, v, w = _inputs(kv)
    _, fn = _compiled(mesh_text, impl, kv, causal)
    args = [jax.device_put(a, s) for a, s in zip((q, k, v), fn.input_shardings[0], strict=True)]
    got, got_g = fn(*args)

    def ref_loss(q, k, v):
        return jnp.sum(reference(q, k, v, scale=SCALE, causal=causal) * w)

    ref, ref_g = jax.value_and_grad(ref_loss, (0, 1, 2))(q, k, v)
    assert abs(float(got - ref)) <= 1e-5 * max(1.0, abs(float(ref)))
    for name, a, b in zip("qkv", got_g, ref_g, strict=True):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_gqa_without_a_split_sequence_is_plain_attention():
    """Outside jaxpar's step every impl is `dense`, which groups the heads the same way; the
    scale default is 1/sqrt(H)."""
    q, k, v, _ = _inputs(2)
    for scale in (None, SCALE):
        ref = reference(q, k, v, scale=scale or H**-0.5)
        for impl in attn.IMPLS:
            got = attn.attention(q, k, v, impl=impl, scale=scale)
            np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5)
    # K = N: the multi-head path, and a non-default scale in it
    k8, v8 = jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2)
    np.testing.assert_allclose(attn.dense(q, k8, v8, scale=SCALE), attn.dense(q, k, v, scale=SCALE),
                               atol=2e-6, rtol=1e-5)  # fmt: skip


def _bytes(*shape) -> int:
    return int(np.prod(shape)) * 4  # float32


@pytest.mark.parametrize("impl", attn.IMPLS)
def test_only_the_kv_heads_travel_over_context(impl):
    """On data=2,context=4 (one row and T/4 = 16 positions per device), N=8 query heads and
    K=2 kv heads (alltoall: K=4): what the collectives over `context` carry is sized by K."""
    kv = 4 if impl == "alltoall" else 2
    mesh, fn = _compiled("data=2,context=4", impl, kv)
    on_ring = [c for c in collectives.audit(fn, mesh) if c.mesh_axes == ("context",)]
    b, t, c = 1, T // 4, 4
    by_kind: dict[str, set[int]] = {}
    for x in on_ring:
        if x.bytes > 4:  # not the loss's scalar
            by_kind.setdefault(x.kind, set()).add(x.bytes)
    if impl == "ring":
        # The ring steps (a loop): K/V forward, K/V and their gradients backward, [2, b, t, K, H]
        # each (N heads would be 4x as many bytes).
        steps = [x for x in on_ring if x.kind == "collective-permute" and x.in_loop]
        assert {x.bytes for x in steps} == {_bytes(2, b, t, kv, H)}
        assert sum(x.executions for x in steps) == 3 * (c - 1)
        # Outside it: the zigzag reorders of q, k, v as one array (half chunks of N + 2K heads),
        # of the output, and the gradients' way home.
        assert by_kind == {
            "collective-permute": {_bytes(b, t // 2, N + 2 * kv, H), _bytes(2, b, t, kv, H),
                                   _bytes(b, t // 2, N, H)},
        }  # fmt: skip
    elif impl == "allgather":
        # K/V of the whole sequence gathered, their gradients reduce-scattered back.
        assert by_kind == {"all-gather": {_bytes(2, b, T, kv, H)},
                           "reduce-scatter": {_bytes(2, b, t, kv, H)}}  # fmt: skip
    else:
        # One all-to-all of N/c query and 2K/c kv heads over the whole sequence each way, and one
        # of the output heads each way.
        assert by_kind == {
            "all-to-all": {_bytes(b, T, (N + 2 * kv) // c, H), _bytes(b, T, N // c, H)}
        }


@pytest.mark.parametrize(
    "mesh_text, kv, h_kv, impl, match",
    [
        ("data=2,context=4", 3, H, "ring", r"q has 8 heads and k/v 3.*kv head count that divides 8"),
        ("data=2,context=4", 2, 8, "ring", r"q's head_dim 16 differs from k/v's 8"),
        ("data=2,context=4", 2, H, "alltoall",
         r"alltoall: the 2 kv heads per device \(of 2\) are not divisible by the context ring of "
         r"4; use the kv head count \(model.n_kv_heads\) a multiple of 4, or --set "
         r"model.attention=ring \(or allgather\)"),
        ("data=2,tensor=2,context=2", 2, H, "alltoall", r"1 kv heads per device.*multiple of 4"),
        ("tensor=4,context=2", 2, H, "ring", r"the 2 kv heads over \('tensor',\).*divisible by 4"),
        (None, 3, H, "ring", r"q has 8 heads and k/v 3"),  # also with the sequence unsplit
    ],
)  # fmt: skip
def test_bad_gqa_shapes_are_refused_in_one_line(mesh_text, kv, h_kv, impl, match):
    q = jnp.zeros((B, T, N, H))
    k = jnp.zeros((B, T, kv, h_kv))
    with pytest.raises(ValueError, match=match) as e:
        if mesh_text is None:
            attn.attention(q, k, k, impl=impl)
        else:
            with activation_rules(make_mesh(mesh_text), ACT_RULES):
                attn.attention(q, k, k, impl=impl)
    assert "\n" not in str(e.value)
