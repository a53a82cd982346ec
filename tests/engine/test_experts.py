"""Mixture of experts (jaxpar/engine/experts.py): routing with a capacity, the expert-parallel
path (all-to-all over `expert`) against the dense reference, and bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine import experts
from jaxpar.engine.mesh import make_mesh
from jaxpar.engine.rules import ACT_RULES, activation_rules


def test_route_counts_drops_and_keeps_first_choices_first():
    # One row of 4 tokens, 2 experts, top-1, capacity 2: tokens 0, 1, 2 pick expert 0.
    logits = jnp.array([[[2.0, 0.0], [3.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    dispatch, combine, stats = experts.route(logits, top_k=1, cap=2)
    assert dispatch.shape == (1, 4, 2, 2)
    np.testing.assert_array_equal(dispatch[0, :, 0].sum(-1), [1, 1, 0, 0])  # token 2 dropped
    np.testing.assert_array_equal(dispatch[0, :, 1].sum(-1), [0, 0, 0, 1])
    assert float(stats["dropped"]) == pytest.approx(0.25)
    np.testing.assert_allclose(stats["load"], [0.75, 0.25])
    probs = jax.nn.softmax(logits, -1)
    np.testing.assert_allclose(combine[0, 0, 0, 0], probs[0, 0, 0], rtol=1e-6)
    assert float(stats["z"]) > 0 and float(stats["aux"]) > 1.0  # unbalanced: above 1
    # Top-2: every token's first choice is placed before any second choice; gates sum to 1.
    dispatch, combine, stats = experts.route(logits, top_k=2, cap=4)
    assert float(stats["dropped"]) == 0.0
    np.testing.assert_allclose(combine.sum((-1, -2)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(stats["load"], [0.5, 0.5])
    assert experts.capacity(64, 8, 2, 1.25) == 20 and experts.capacity(4, 8, 1, 0.1) == 1


def _weights(key, d=16, f=32, e=8):
    ks = jax.random.split(key, 6)
    return (
        jax.random.normal(ks[0], (d, e)),
        jax.random.normal(ks[1], (e, d, f)) * 0.2,
        jax.random.normal(ks[2], (e, f)) * 0.1,
        jax.random.normal(ks[3], (e, f, d)) * 0.2,
        jax.random.normal(ks[4], (e, d)) * 0.1,
        jax.random.normal(ks[5], (8, 12, d)),
    )


def _run(mesh_text: str, dense: bool, capacity_factor: float):
    """Loss, gradients and compiled text of a small MoE layer on a mesh. With `pipeline` in the
    mesh, the layer runs inside a shard_map manual over data and pipeline, as a pipeline
    stage's blocks do (jaxpar/parallel/pipeline.py)."""
    mesh = make_mesh(mesh_text)
    *w, x = _weights(jax.random.key(0))
    manual = ("data", "pipeline") if mesh.shape["pipeline"] > 1 else ()

    def layer(w, x):
        with activation_rules(mesh, ACT_RULES, manual=manual):
            y, stats = experts.moe_ffn(x, *w, top_k=2, capacity_factor=capacity_factor, dense=dense)
        if manual:  # this replica's rows, then the mean over the replicas
            return jax.lax.pmean((jnp.mean(y**2), stats), "data")
        return jnp.mean(y**2), stats

    if manual:
        rep = PartitionSpec()
        layer = jax.shard_map(
            layer, mesh=mesh, in_specs=(rep, PartitionSpec("data")), out_specs=(rep, rep),
            axis_names=set(manual), check_vma=False,
        )  # fmt: skip

    def loss(w, x):
        y2, stats = layer(w, x)
        return y2 + 0.01 * stats["aux"] + 0.001 * stats["z"], stats

    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert")))
    spec = [PartitionSpec(), PartitionSpec("expert"), PartitionSpec("expert"),
            PartitionSpec("expert"), PartitionSpec("expert")]  # fmt: skip
    w = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(w, spec, strict=True)]
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    args = (w, jax.device_put(x, rows))
    (value, stats), grads = fn(*args)
    return value, stats, grads, fn.lower(*args).compile().as_text()


@pytest.fixture(scope="module")
def dense_reference():
    """dense_reference(capacity_factor): _run on data=8 with the dense path, computed once per
    capacity factor for every layout it is compared with."""
    cache = {}

    def get(capacity_factor: float):
        if capacity_factor not in cache:
            cache[capacity_factor] = _run("data=8", dense=True, capacity_factor=capacity_factor)
        return cache[capacity_factor]

    return get


LAYOUTS = [
    "data=2,expert=4",
    pytest.param("data=1,fsdp=2,tensor=2,expert=2", marks=pytest.mark.slow),
    pytest.param("data=2,expert=2,pipeline=2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_text", LAYOUTS)
def test_expert_parallel_equals_dense(mesh_text, dense_reference):
    """The all-to-all path computes what the dense path computes, drops included (routing is
    per sequence), with fsdp and tensor in the mesh, and nested in a pipeline's shard_map;
    gradients too."""
    for cf in (4.0, 0.5):  # no token dropped; many dropped
        value, stats, grads, text = _run(mesh_text, dense=False, capacity_factor=cf)
        ref, ref_stats, ref_grads, ref_text = dense_reference(cf)
        assert "all-to-all" in text and "all-to-all" not in ref_text
        assert (float(stats["dropped"]) > 0.1) == (cf < 1)
        np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-6)
        for k in ("aux", "z", "dropped", "load"):
            np.testing.assert_allclose(stats[k], ref_stats[k], rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bad_router_settings_name_the_fix():
    with pytest.raises(ValueError, match=r"model.top_k=0: use an integer from 1 to model.n_exp"):
        experts.check_config(8, 0, 1.0)
    experts.check_config(128, 8, 1.0)  # any top_k up to the experts (Qwen3-MoE: 8 of 128)
    with pytest.raises(ValueError, match=r"top_k=2 is more than model.n_experts=1"):
        experts.check_config(1, 2, 1.0)
    for cf in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"capacity_factor=.*must be > 0"):
            experts.check_config(8, 2, cf)


def test_expert_axis_must_split_the_models_experts():
    from jaxpar.engine import model as model_lib
    from jaxpar.models.gpt import GPTConfig
    from jaxpar.models.gpt_moe import GPTMoEConfig

    small = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_mlp=32)
    dense = model_lib.abstract(GPTConfig(**small), 0).params
    with pytest.raises(ValueError, match=r"expert=4 but the model has no experts.*expert=1"):
        experts.check_mesh(dense, {"data": 2, "expert": 4})
    experts.check_mesh(dense, {"data": 8, "expert": 1})
    moe = model_lib.abstract(GPTMoEConfig(**small, n_experts=6), 0).params
    with pytest.raises(ValueError, match=r"n_experts=6 is not divisible by the expert mesh axis"):
        experts.check_mesh(moe, {"data": 2, "expert": 4})
    experts.check_mesh(moe, {"data": 4, "expert": 2})


@pytest.mark.slow
def test_gpt_moe_counts_its_parameters_and_decodes_like_its_forward():
    """models/gpt_moe.py: every other layer MoE (moe_every=2); num_params counts what is built;
    the cached decoding (jaxpar sample) gives the forward pass's logits when no token is
    dropped (capacity for every token)."""
    from flax import nnx

    from jaxpar.engine import model as model_lib
    from jaxpar.models.gpt_moe import GPTMoEConfig

    cfg = GPTMoEConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4, d_mlp=32,
                       n_experts=4, moe_every=2, capacity_factor=4.0)  # fmt: skip
    model = model_lib.build(cfg, 0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
    assert set(params["blocks"]) == {"dense", "moe"} and cfg.n_moe_layers == 2
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    full, aux = nnx.jit(lambda m, t: m.aux_forward(t))(model, tokens)
    assert aux["metrics"]["moe_expert_load"].shape == (4,)
    assert float(aux["metrics"]["moe_dropped_frac"]) == 0.0
    decode = nnx.jit(lambda m, t, c, pos: m.decode(t, c, pos))
    first, cache = decode(model, tokens[:, :8], model.init_cache(2), 0)
    steps = [first]
    for pos in range(8, 12):
        logits, cache = decode(model, tokens[:, pos : pos + 1], cache, jnp.int32(pos))
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-4, atol=1e-5)


# ---- gated experts (SwiGLU: Mixtral, Qwen3-MoE), any top_k, the weights' normalisation ----------


def _gated_weights(key, d=16, f=32, e=8):
    """router, w_up, w_down, w_gate (no biases), x."""
    ks = jax.random.split(key, 5)
    return (
        jax.random.normal(ks[0], (d, e)),
        jax.random.normal(ks[1], (e, d, f)) * 0.3,
        jax.random.normal(ks[2], (e, f, d)) * 0.3,
        jax.random.normal(ks[3], (e, d, f)) * 0.3,
        jax.random.normal(ks[4], (8, 12, d)),
    )


def _run_gated(mesh_text: str, dense: bool, top_k: int):
    mesh = make_mesh(mesh_text)
    router, w_up, w_down, w_gate, x = _gated_weights(jax.random.key(1))

    def loss(w, x):
        router, w_up, w_down, w_gate = w
        with activation_rules(mesh, ACT_RULES):
            y, stats = experts.moe_ffn(
                x, router, w_up, None, w_down, None, top_k=top_k, capacity_factor=1.0,
                dense=dense, w_gate_EDF=w_gate, activation="silu", normalize_top_k=True,
            )  # fmt: skip
        return jnp.mean(y**2) + 0.01 * stats["aux"] + 0.001 * stats["z"], stats

    ep = PartitionSpec("expert")
    w = [jax.device_put(a, NamedSharding(mesh, s))
         for a, s in zip((router, w_up, w_down, w_gate), (PartitionSpec(), ep, ep, ep),
                         strict=True)]  # fmt: skip
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    args = (w, jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert")))))
    (value, stats), grads = fn(*args)
    return value, stats, grads, fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("top_k", [2, 4])
def test_gated_expert_parallel_equals_dense(top_k):
    """SwiGLU experts without biases, top_k of 8, on data=2,expert=4: the all-to-all path (the
    gate weights split over `expert` like the others) computes what the dense path computes,
    gradients included (capacity factor 1: some assignments dropped)."""
    value, stats, grads, text = _run_gated("data=2,expert=4", dense=False, top_k=top_k)
    ref, ref_stats, ref_grads, ref_text = _run_gated("data=8", dense=True, top_k=top_k)
    assert "all-to-all" in text and "all-to-all" not in ref_text
    assert float(stats["dropped"]) > 0
    np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-6)
    for k in ("aux", "z", "dropped", "load"):
        np.testing.assert_allclose(stats[k], ref_stats[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


_NP_ACT = {
    "silu": lambda h: h / (1.0 + np.exp(-h)),
    "gelu": lambda h: 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0))),
    "gelu_tanh": lambda h: 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3))),
    "relu": lambda h: np.maximum(h, 0.0),
}


def per_token_reference(x, router, w_in, b_in, w_out, b_out, w_gate, *, top_k, act, normalize):
    """Token by token in float64: softmax over all experts, the top_k, their weights
    (renormalised or raw), the weighted sum of the chosen experts' outputs (nothing dropped)."""
    x, router, w_in, w_out = (np.asarray(a, np.float64) for a in (x, router, w_in, w_out))
    y = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            xt = x[b, t]
            logits = xt @ router
            p = np.exp(logits - logits.max())
            p /= p.sum()
            chosen = np.argsort(-p)[:top_k]
            weights = p[chosen] / p[chosen].sum() if normalize else p[chosen]
            for e, g in zip(chosen, weights, strict=True):
                h = xt @ w_in[e] + (0.0 if b_in is None else np.asarray(b_in, np.float64)[e])
                if w_gate is not None:
                    h = _NP_ACT[act](xt @ np.asarray(w_gate, np.float64)[e]) * h
                else:
                    h = _NP_ACT[act](h)
                out = h @ w_out[e] + (0.0 if b_out is None else np.asarray(b_out, np.float64)[e])
                y[b, t] += g * out
    return y


@pytest.mark.parametrize(
    "gated, act, top_k, normalize",
    [
        (True, "silu", 2, True),  # Mixtral
        (True, "silu", 4, True),  # Qwen3-MoE, norm_topk_prob=True
        (True, "silu", 4, False),  # Qwen3-MoE, norm_topk_prob=False
        (True, "silu", 1, True),  # one expert at weight 1
        (False, "gelu", 3, None),  # None above top_k = 1: renormalised
        (False, "relu", 1, None),  # None at top_k = 1: the raw probability
        (False, "gelu_tanh", 2, False),
    ],
)
def test_moe_ffn_matches_a_per_token_reference(gated, act, top_k, normalize):
    """With capacity for every token (capacity_factor = E / top_k: C = T) nothing is dropped, and
    moe_ffn is the textbook per-token mixture; biases where the plain experts have them."""
    router, w_in, b_in, w_out, b_out, x = _weights(jax.random.key(2))
    w_gate = _gated_weights(jax.random.key(3))[3] if gated else None
    if gated:
        b_in = b_out = None
    e = router.shape[1]
    y, stats = experts.moe_ffn(
        x, router, w_in, b_in, w_out, b_out, top_k=top_k, capacity_factor=e / top_k,
        w_gate_EDF=w_gate, activation=act, normalize_top_k=normalize,
    )  # fmt: skip
    assert float(stats["dropped"]) == 0.0
    ref = per_token_reference(
        x, router, w_in, b_in, w_out, b_out, w_gate, top_k=top_k, act=act,
        normalize=normalize or (normalize is None and top_k > 1),
    )  # fmt: skip
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5)


def test_raw_weights_are_the_renormalised_ones_times_the_chosen_probability_mass():
    """normalize_top_k=False keeps the chosen experts' softmax probabilities: per token, the
    output is the renormalised one times the probability the chosen experts hold."""
    router, w_up, w_down, w_gate, x = _gated_weights(jax.random.key(4))
    router = router * 0.1  # probabilities spread over the experts
    kw = dict(top_k=4, capacity_factor=2.0, w_gate_EDF=w_gate, activation="silu")
    y_norm, _ = experts.moe_ffn(x, router, w_up, None, w_down, None, normalize_top_k=True, **kw)
    y_raw, _ = experts.moe_ffn(x, router, w_up, None, w_down, None, normalize_top_k=False, **kw)
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, router), axis=-1)
    mass = jax.lax.top_k(probs, 4)[0].sum(-1, keepdims=True)
    assert float(jnp.max(mass)) < 0.99  # the two differ
    np.testing.assert_allclose(y_raw, y_norm * mass, rtol=1e-5, atol=1e-6)


def test_bad_moe_arguments_name_the_fix():
    router, w_up, w_down, w_gate, x = _gated_weights(jax.random.key(5))
    with pytest.raises(ValueError, match=r"activation='swish': use one of \['gelu_tanh', 'gelu', "):
        experts.moe_ffn(x, router, w_up, None, w_down, None, top_k=2, capacity_factor=1.0,
                        activation="swish")  # fmt: skip
    with pytest.raises(ValueError, match=r"top_k=9 is more than model.n_experts=8.*lower top_k"):
        experts.moe_ffn(x, router, w_up, None, w_down, None, top_k=9, capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"w_gate has shape \(8, 16, 16\), expected \(8, 16, 32\)"):
        experts.moe_ffn(x, router, w_up, None, w_down, None, top_k=2, capacity_factor=1.0,
                        w_gate_EDF=w_gate[..., :16])  # fmt: skip
