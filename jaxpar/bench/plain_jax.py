"""A minimal hand-written GPT train step in plain JAX + optax: the baseline of `jaxpar bench overhead`.

It imports nothing from jaxpar on purpose. It computes what models/gpt.py computes, on the same
parameter pytree (pure dict), with the same optimizer chain, jitted with NamedShardings that put
the batch on all devices and replicate the parameters (plain data parallelism).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _ln(x, p):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _block(x, b):
    h = _ln(x, b["ln1"])
    qkv = jnp.einsum("btd,dknh->kbtnh", h, b["w_qkv"]) + b["b_qkv"][:, None, None]
    q, k, v = qkv[0], qkv[1], qkv[2]
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1]).astype(x.dtype)
    t = x.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), s, jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bnts,bsnh->btnh", p, v)
    x = x + jnp.einsum("btnh,nhd->btd", o, b["w_o"]) + b["b_o"]
    h = jax.nn.gelu(_ln(x, b["ln2"]) @ b["w_in"] + b["b_in"])
    return x + h @ b["w_out"] + b["b_out"]


def loss_fn(params, tokens, targets):
    t = tokens.shape[1]
    x = jnp.take(params["tok_emb"], tokens, axis=0) + params["pos_emb"][:t]
    n_layers = params["blocks"]["w_qkv"].shape[0]
    for i in range(n_layers):
        x = _block(x, jax.tree.map(lambda a, i=i: a[i], params["blocks"]))
    logits = _ln(x, params["ln_f"]) @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_step(mesh: Mesh, tx: optax.GradientTransformation):
    """jit(step)(params, opt_state, tokens, targets) -> (params, opt_state, loss), data parallel."""
    rep = NamedSharding(mesh, PartitionSpec())
    batch = NamedSharding(mesh, PartitionSpec(mesh.axis_names))

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(
        step,
        in_shardings=(rep, rep, batch, batch),
        out_shardings=(rep, rep, rep),
        donate_argnums=(0, 1),
    ), batch
