"""jaxpar.engine.attention: the ring, all-gather and all-to-all kernels against plain attention
(values and gradients), the ring's collective-permute count, and the one-line refusals.

The kernels run on small random q/k/v inside activation_rules, as a model's attention does
inside jaxpar's step; tests/parallel/test_context.py checks gpt_tiny trained end to end.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import apply_overrides, resolve_recipe
from jaxpar.data.sources import batch_spec
from jaxpar.engine import attention as attn
from jaxpar.engine import collectives
from jaxpar.engine.mesh import make_mesh
from jaxpar.engine.rules import ACT_RULES, activation_rules, constrain
from jaxpar.parallel.program import build_program
from jaxpar.worker import training

B, T, N, H = 2, 32, 4, 8


def _inputs():
    ks = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(k, (B, T, N, H), jnp.float32) for k in ks]


def _loss(mesh, impl, causal=True):
    *_, w = _inputs()

    def f(q, k, v):
        with activation_rules(mesh, ACT_RULES):
            q, k, v = (constrain(x, attn.NAMES) for x in (q, k, v))
            return jnp.sum(attn.attention(q, k, v, impl=impl, causal=causal) * w)

    return f


def _dense_loss(causal=True):
    *_, w = _inputs()
    return lambda q, k, v: jnp.sum(attn.dense(q, k, v, causal=causal) * w)


@pytest.mark.parametrize(
    "mesh_text, impl, causal",
    [
        ("data=2,context=4", "ring", True),
        ("data=2,context=4", "allgather", True),
        ("data=2,context=4", "alltoall", True),
        ("fsdp=2,tensor=2,context=2", "ring", True),
        ("context=8", "ring", False),
    ],
)
def test_kernel_matches_plain_attention(mesh_text, impl, causal):
    q, k, v, _ = _inputs()
    mesh = make_mesh(mesh_text)
    got, got_g = jax.jit(jax.value_and_grad(_loss(mesh, impl, causal), (0, 1, 2)))(q, k, v)
    ref, ref_g = jax.value_and_grad(_dense_loss(causal), (0, 1, 2))(q, k, v)
    assert abs(float(got - ref)) <= 1e-5 * abs(float(ref))
    for a, b in zip(got_g, ref_g, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_ring_permutes_match_theory():
    """Executions per call (the ring steps are a loop): forward c-1 ring steps and four
    reorders; backward c-1 K/V shifts, c gradient shifts and the reorders' transposes. A ring of
    2: two reorders are no-ops and its K/V shift is shared by both passes."""
    q, k, v, _ = _inputs()
    for c in (2, 4):
        mesh = make_mesh(f"data=2,tensor={4 // c},context={c}")
        f = _loss(mesh, "ring")

        def permutes(fn, mesh=mesh):
            colls = collectives.audit(jax.jit(fn).lower(q, k, v).compile(), mesh)
            perms = [x for x in colls if x.kind == "collective-permute"]
            assert {x.mesh_axes for x in perms} == {("context",)}
            return sum(x.executions for x in perms)

        n_fwd, n_bwd = attn.ring_permutes(c)
        assert (n_fwd, n_bwd) == ((3, 4) if c == 2 else (c + 3, 2 * c + 3))
        assert permutes(f) == n_fwd
        assert permutes(jax.value_and_grad(f, (0, 1, 2))) == n_fwd + n_bwd


def test_plain_attention_when_seq_is_not_split():
    """Outside jaxpar's step, or on a mesh without `context`, every impl is plain attention."""
    q, k, v, _ = _inputs()
    ref = attn.dense(q, k, v)
    for impl in attn.IMPLS:
        np.testing.assert_array_equal(attn.attention(q, k, v, impl=impl), ref)
    with activation_rules(make_mesh("data=8"), ACT_RULES):
        assert attn.ring_of_seq() == (None, 1)


@pytest.mark.parametrize(
    "impl, t, n, match",
    [
        ("ring", 36, 4, r"seq_len 36 is not divisible by 8, the context ring of 4 \(x 2 for the "),
        ("allgather", 30, 4, r"seq_len 30 is not divisible by 4.*multiple of 4"),
        ("alltoall", 32, 2, r"2 heads per device.*n_heads a multiple of 4"),
    ],
)
def test_bad_shapes_are_refused_in_one_line(impl, t, n, match):
    x = jnp.zeros((B, t, n, H))
    mesh = make_mesh("data=2,context=4")
    with activation_rules(mesh, ACT_RULES), pytest.raises(ValueError, match=match) as e:
        attn.attention(x, x, x, impl=impl)
    assert "\n" not in str(e.value)


def test_unknown_attention_name_is_refused():
    cfg = resolve_recipe("gpt_tiny")
    with pytest.raises(ValueError, match=r"model.attention='flash': use one of \['ring', "):
        apply_overrides(cfg, ["model.attention=flash"])


def _build(cfg, mesh_text):
    from jaxpar import meshes

    preset = meshes.resolve(mesh_text)
    source = training.make_source(cfg)
    spec = batch_spec(source, cfg.data.global_batch)
    return build_program(cfg, make_mesh(preset.mesh), preset.params, preset.acts, spec, source.kind)


def test_model_without_attention_on_a_context_mesh_is_refused():
    cfg = resolve_recipe("digits_mlp")
    with pytest.raises(
        ValueError, match=r"never calls jaxpar.engine.attention.attention.*context=1"
    ):
        _build(cfg, "data=2,context=4")


def test_gpt_seq_len_not_divisible_by_the_ring_is_refused_at_build():
    cfg = resolve_recipe("gpt_tiny")  # seq_len 64
    cfg = apply_overrides(cfg, ["model.seq_len=60", "data.seq_len=60"])
    with pytest.raises(ValueError, match=r"seq_len 60 is not divisible by 8"):
        _build(cfg, "data=2,context=4")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.1, seq_len=64),
                              data=dataclasses.replace(cfg.data, seq_len=64))  # fmt: skip
    with pytest.raises(ValueError, match=r"attention dropout .* model.dropout=0 or use context=1"):
        _build(cfg, "data=2,context=4")


def test_context_with_pipeline_stages_is_refused():
    cfg = resolve_recipe("gpt_tiny")
    with pytest.raises(ValueError, match=r"does not combine with pipeline stages; use pipeline=1"):
        _build(cfg, "pipeline=2,context=4")
