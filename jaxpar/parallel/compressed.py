"""Compressed all-reduce over `data` with error feedback (`--set comm.compress=int8|bf16`).

Like the manual data axis (jaxpar/parallel/manual_data.py), each replica accumulates its own
gradients inside a shard_map manual over `data`; the mean over `data` is then a compressed
reduce-scatter + all-gather: int8 with one float32 scale per 256 values, or bf16. What the
compression dropped is kept per replica (the error-feedback residual, state entry "comm",
[data, *param shape], checkpointed) and added back to the next step's gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.engine.mesh import DATA
from jaxpar.parallel.base import Context, OverData

COMPRESS = ("none", "bf16", "int8")
INT8_BLOCK = 256  # values per int8 scale: small blocks keep one outlier from flattening the rest


def _quantize(x_NB: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per block (last dim): q = round(x / s), s = max|x| / 127."""
    scale = jnp.max(jnp.abs(x_NB), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    q = jnp.clip(jnp.round(x_NB / scale), -127, 127).astype(jnp.int8)
    return q, scale


def _two_phase_mean(x: jax.Array, axis: str, n: int, kind: str) -> tuple[jax.Array, jax.Array]:
    """Compressed mean over `axis` as a reduce-scatter then an all-gather, both on the small dtype:
    chunks go out by all-to-all and are summed in f32, the reduced shard is compressed again and
    all-gathered. (A bf16 all-reduce is not used: XLA CPU promotes it to f32, or aborts.)
    Returns (mean, the local compression error of phase one, for error feedback)."""
    flat = x.reshape(-1)
    size = flat.shape[0]
    chunk = -(-size // (n * INT8_BLOCK)) * INT8_BLOCK  # per-replica shard, whole blocks
    x_NCB = jnp.pad(flat, (0, n * chunk - size)).reshape(n, chunk // INT8_BLOCK, INT8_BLOCK)
    encode, decode = _CODECS[kind]
    q, s = encode(x_NCB)
    error = (x_NCB - decode(q, s)).reshape(-1)[:size].reshape(x.shape)
    # chunk j of every replica goes to replica j, which sums its shard in f32
    q_recv = jax.lax.all_to_all(q, axis, split_axis=0, concat_axis=0, tiled=True)
    s_recv = jax.lax.all_to_all(s, axis, split_axis=0, concat_axis=0, tiled=True)
    shard_CB = jnp.sum(decode(q_recv, s_recv), axis=0) / n
    q2, s2 = encode(shard_CB)
    q_all = jax.lax.all_gather(q2, axis, tiled=False)
    s_all = jax.lax.all_gather(s2, axis, tiled=False)
    mean = decode(q_all, s_all).reshape(-1)[:size].reshape(x.shape)
    return mean, error


def _bf16_encode(x):
    return x.astype(jnp.bfloat16), jnp.zeros(x.shape[:-1] + (1,), jnp.bfloat16)


def _bf16_decode(q, s):
    return q.astype(jnp.float32)


def _int8_decode(q, s):
    return q.astype(jnp.float32) * s


_CODECS = {"bf16": (_bf16_encode, _bf16_decode), "int8": (_quantize, _int8_decode)}


def compressed_mean(grads, residual, kind: str, axis: str, n: int):
    """Mean of per-replica `grads` over `axis` with `kind` compression and error feedback.

    Returns (mean grads, new residual). `kind="none"` is a plain f32 pmean (residual unchanged).
    """
    if kind == "none":
        return jax.lax.pmean(grads, axis), residual

    if kind not in _CODECS:
        raise ValueError(f"comm.compress={kind!r}: use one of {COMPRESS}")

    def one(g, r):
        return _two_phase_mean(g + r, axis, n, kind)

    pairs = jax.tree.map(one, grads, residual)
    mean = jax.tree.map(lambda p: p[0], pairs, is_leaf=lambda p: isinstance(p, tuple))
    new_res = jax.tree.map(lambda p: p[1], pairs, is_leaf=lambda p: isinstance(p, tuple))
    return mean, new_res


class Compressed(OverData):
    """The manual data axis with a compressed gradient mean and error feedback."""

    name = "compressed"
    extra_keys = ("comm",)

    def __init__(self, ctx: Context):
        self._kind, self._n = ctx.cfg.comm.compress, ctx.mesh.shape[DATA]
        super().__init__(ctx)

    def reduce(self, loss, aux, grads, own):
        grads, residual = compressed_mean(grads, own["comm"], self._kind, DATA, self._n)
        loss, aux = jax.lax.pmean((loss, aux), DATA)
        return loss, aux, grads, {"comm": residual}

    def state_shardings(self) -> dict:
        # per-replica error-feedback residuals: [data, *param shape]
        mesh = self.ctx.mesh
        comm = jax.tree.map(
            lambda sh: NamedSharding(mesh, PartitionSpec(DATA, *sh.spec)), self.ctx.param_shardings
        )
        return {**super().state_shardings(), "comm": comm}

    def init_state(self, state: dict) -> dict:
        n = self.ctx.mesh.shape[DATA]
        comm = jax.tree.map(lambda p: jnp.zeros((n, *p.shape), p.dtype), state["params"])
        return {**super().init_state(state), "comm": comm}
