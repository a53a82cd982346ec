"""Attention over a sequence that the activation rules may split across devices.

    from jaxpar.engine.attention import attention
    o_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, impl="ring")

A model calls `attention` with queries named ("batch", "seq", "heads", "head_dim") and keys and
values named ("batch", "seq", "kv", "head_dim"), and never names a mesh axis. Grouped-query
attention is native: q has N heads, k and v K heads with K dividing N, and query head n attends
with kv head n // (N/K) (consecutive query heads share a kv head, as Hugging Face's repeat_kv
orders them); K = N is multi-head attention, K = 1 multi-query. The kv heads are never repeated
to N: scores are a grouped einsum of q as [B, T, K, N/K, H] against [B, S, K, H], and only the K
kv heads travel between devices. The softmax scale is `scale` (default 1/sqrt(head_dim)), in
every kernel, forward and backward.

Where the activation rules put `seq` on a mesh axis of size 1 (every layout without `context`),
or outside jaxpar's step, it is plain causal softmax attention. Where they split `seq` over an
axis of size c > 1 (the `context` axis: the ring), it runs in a shard_map over the mesh, each
device holding T/c positions, as one of:

    ring       K/V blocks passed around the ring with ppermute, an online softmax, and the causal
               load balance of the zigzag order: the sequence in 2c chunks, device r holding
               chunks r and 2c-1-r, so every device does the same work at every ring step. Only
               O(T/c) per device is kept for the backward pass, which passes K/V and their
               gradients around the ring again. seq_len must be a multiple of 2c. A ring step
               moves K/V of K heads (and their gradients in the backward pass).
    allgather  K/V (K heads) all-gathered over the ring; scores of T/c queries against all T
               keys. The simplest, for small rings. seq_len a multiple of c.
    alltoall   (Ulysses) one all-to-all from the sequence split to a head split of q (N heads)
               and k/v (K heads) together, plain attention on the whole sequence for N/c query
               and K/c kv heads, and an all-to-all back. The kv heads held by a device (after
               `tensor`) must be a multiple of c (for K = N: the heads).

The rules must split `heads` and `kv` alike (ACT_RULES put both on `tensor`), so that a device's
query heads use its own kv heads; K must be divisible by that split.

Collective-permutes of one ring attention call, ring size c, counted in executions (the ring
steps are a loop, so that one step's scores are alive at a time): forward c+3 (c-1 ring steps,
two into the zigzag order and two back, q, k and v reordered as one array); backward 2c+3 (c-1
for K/V, c for their gradients, which travel with them and end at home, and the transposes of
the four reorders). A ring of 2 keeps its even chunks in place (two reorders fewer each way),
and its one step is no loop, so the backward pass reuses the forward's shifted K/V: 3 and 4.
`ring_permutes(c)`.

Docs: docs/parallelism.md ("context") and docs/model_contract.md (a model of one's own; the
helpers' numerics).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from jaxpar.engine.rules import _ACT, Rules, _as_tuple, activation_rules, logical_to_spec

IMPLS: tuple[str, ...] = ("ring", "allgather", "alltoall")
NAMES: tuple[str, ...] = ("batch", "seq", "heads", "head_dim")  # queries (and the output)
KV_NAMES: tuple[str, ...] = ("batch", "seq", "kv", "head_dim")  # keys and values
_NEG = float(jnp.finfo(jnp.float32).min)

# The calls of `attention` traced while `recording()` is open (their impl and ring size).
_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_attn", default=None)


def ring_permutes(ring: int) -> tuple[int, int]:
    """(forward, backward) collective-permutes of one ring attention call on a ring of `ring`."""
    if ring == 1:
        return 0, 0
    if ring == 2:  # even chunks stay; the one step is no loop, its K/V shift is the forward's
        return 3, 4
    return ring + 3, 2 * ring + 3


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"model.attention={impl!r}: use one of {list(IMPLS)}")


def kv_groups(q: jax.Array, k: jax.Array, v: jax.Array) -> int:
    """G = N/K, the query heads per kv head of q [B, T, N, H] and k, v [B, S, K, H]; ValueError
    (one line naming the fix) for shapes that do not fit together."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"attention: q {q.shape}, k {k.shape} and v {v.shape} must be [batch, seq, heads, "
            f"head_dim] with k and v of one shape; reshape them to 4 dimensions"
        )
    n, kv, h = q.shape[2], k.shape[2], q.shape[3]
    if k.shape[3] != h:
        raise ValueError(
            f"attention: q's head_dim {h} differs from k/v's {k.shape[3]}; give q, k and v one "
            f"head_dim"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"attention: q's batch {q.shape[0]} differs from k/v's {k.shape[0]}; give q, k and v "
            f"one batch"
        )
    if kv == 0 or n % kv:
        raise ValueError(
            f"attention: q has {n} heads and k/v {kv}; the kv heads must divide the query heads "
            f"(query head n uses kv head n // (N/K)): use a kv head count that divides {n}"
        )
    return n // kv


def _scale(scale: float | None, h: int) -> jax.Array:
    """The softmax scale in float32 (default 1/sqrt(head_dim))."""
    if scale is None:
        return 1.0 / jnp.sqrt(h).astype(jnp.float32)
    return jnp.float32(scale)


def _grouped(q_BTNH: jax.Array, groups: int) -> jax.Array:
    """[B, T, N, H] -> [B, T, K, G, H]: query head n = k G + g uses kv head k."""
    b, t, n, h = q_BTNH.shape
    return q_BTNH.reshape(b, t, n // groups, groups, h)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout of rate `rate` keyed by `key` (identity without a key or at rate 0)."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def dense(
    q, k, v, *, causal: bool = True, dropout_rate: float = 0.0, dropout_key=None,
    scale: float | None = None,
):  # fmt: skip
    """Plain softmax attention of [B, T, N, H] queries and [B, S, K, H] keys and values (K
    dividing N; softmax in float32) -> [B, T, N, H]."""
    groups = kv_groups(q, k, v)
    b, t, n, h = q.shape
    if groups == 1:
        s_BNTS = jnp.einsum("btnh,bsnh->bnts", q, k)
    else:
        s_BNTS = jnp.einsum("btkgh,bskh->bkgts", _grouped(q, groups), k)
        s_BNTS = s_BNTS.reshape(b, n, t, k.shape[1])
    if scale is None:
        s_BNTS = s_BNTS / jnp.sqrt(h).astype(q.dtype)
    else:
        s_BNTS = s_BNTS * jnp.asarray(scale, q.dtype)
    if causal:
        mask = jnp.tril(jnp.ones((t, k.shape[1]), dtype=bool))
        s_BNTS = jnp.where(mask, s_BNTS, jnp.finfo(s_BNTS.dtype).min)
    p_BNTS = jax.nn.softmax(s_BNTS.astype(jnp.float32), axis=-1).astype(q.dtype)
    p_BNTS = dropout(p_BNTS, dropout_rate, dropout_key)
    if groups == 1:
        return jnp.einsum("bnts,bsnh->btnh", p_BNTS, v)
    p_BKGTS = p_BNTS.reshape(b, n // groups, groups, t, k.shape[1])
    return jnp.einsum("bkgts,bskh->btkgh", p_BKGTS, v).reshape(b, t, n, h)


def ring_of_seq() -> tuple[str | None, int]:
    """(mesh axis, size) that the current activation rules split `seq` over; (None, 1) when
    they split it over none (or outside jaxpar's step)."""
    ctx = _ACT.get()
    if ctx is None:
        return None, 1
    spec = logical_to_spec(("seq",), ctx.rules, ctx.mesh, exclude=ctx.manual)
    axes = _as_tuple(spec[0] if len(spec) else None)
    if not axes:
        return None, 1
    if len(axes) > 1:
        raise ValueError(f"the rules split `seq` over {axes}; give it one mesh axis (context)")
    return axes[0], ctx.mesh.shape[axes[0]]


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collect (impl, ring size) of every `attention` call traced inside the block."""
    calls: list = []
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)


def check_model(trace: Callable[[], object], mesh: jax.sharding.Mesh, act_rules: Rules) -> tuple:
    """Where `act_rules` split `seq` over a mesh axis of size > 1: trace the model's training
    forward pass (`trace`, abstractly) and raise ValueError naming the fix when it never calls
    `attention`. The helper's own refusals (seq_len not divisible by the ring, attention
    dropout) come out of the trace as they are, before anything is compiled.

    Returns the (impl, ring size) of each attention call traced (() when `seq` is unsplit)."""
    with activation_rules(mesh, act_rules):
        axis, ring = ring_of_seq()
        if ring == 1:
            return ()
        if mesh.shape.get("pipeline", 1) > 1:
            raise ValueError(
                f"the sequence split over {axis}={ring} does not combine with pipeline stages; "
                f"use pipeline=1 or {axis}=1"
            )
        with recording() as calls:
            trace()
    if not calls:
        raise ValueError(
            f"the mesh splits the sequence over {axis}={ring}, but the model never calls "
            f"jaxpar.engine.attention.attention, so it cannot run context-parallel; use {axis}=1 "
            f"(a model of one's own: jaxpar docs model_contract)"
        )
    return tuple(calls)


def inspect_lines(calls: tuple, colls: list | None) -> list[str]:
    """Markdown lines for `jaxpar inspect` on a mesh that splits the sequence: the kernels, and
    the collectives over the ring against their count in theory.

    `calls`: (impl, ring size) per attention call of the model (Program.attention); `colls`:
    the collective audit of the train step (None: not compiled)."""
    if not calls:
        return []
    impls = sorted({impl for impl, _ in calls})
    ring = calls[0][1]
    out = [
        "",
        f"## context: {', '.join(impls)} attention over a ring of {ring}, {len(calls)} attention "
        f"call(s) per forward pass; each device holds 1/{ring} of the sequence",
    ]
    if colls is None:
        return out
    on_ring = [c for c in colls if c.mesh_axes and set(c.mesh_axes) <= {"context"}]
    by_kind: dict[str, list[int]] = {}
    for c in on_ring:
        n, b = by_kind.get(c.kind, [0, 0])
        by_kind[c.kind] = [n + c.executions, b + c.bytes * c.executions]
    out.append(
        "collectives over context per step: "
        + (", ".join(f"{k} x{n} ({b:,} bytes)" for k, (n, b) in sorted(by_kind.items())) or "none")
    )
    rings = sum(1 for impl, _ in calls if impl == "ring")
    if rings:
        fwd, bwd = ring_permutes(ring)
        got = by_kind.get("collective-permute", [0, 0])[0]
        verdict = "as expected" if got == rings * (fwd + bwd) else "differs"
        out.append(
            f"ring collective-permutes: {got} executed per step; theory {rings} layer(s) x "
            f"({fwd} forward + {bwd} backward) = {rings * (fwd + bwd)}: {verdict}"
        )
    return out


def _ways(spec, mesh) -> int:
    """Devices a PartitionSpec entry splits a dimension over."""
    ways = 1
    for a in _as_tuple(spec):
        ways *= mesh.shape[a]
    return ways


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    impl: str = "ring",
    causal: bool = True,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention of q [B, T, N, H] (logical names NAMES) and k, v [B, T, K, H]
    (KV_NAMES), K dividing N (grouped-query attention; K = N multi-head) -> [B, T, N, H].

    `impl` picks the context-parallel kernel (IMPLS); with `seq` unsplit all three are `dense`.
    `scale` multiplies the scores (default 1/sqrt(H)). Dropout on the attention probabilities
    is supported only with `seq` unsplit.
    """
    check_impl(impl)
    groups = kv_groups(q, k, v)
    axis, ring = ring_of_seq()
    calls = _CALLS.get()
    if calls is not None:
        calls.append((impl, ring))
    if ring == 1:
        return dense(
            q, k, v, causal=causal, dropout_rate=dropout_rate, dropout_key=dropout_key,
            scale=scale,
        )  # fmt: skip
    if dropout_rate and dropout_key is not None:
        raise ValueError(
            f"attention dropout (rate {dropout_rate}) is not supported with the sequence split "
            f"over {axis}={ring}; set --set model.dropout=0 or use {axis}=1"
        )
    t, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != t:
        raise ValueError(
            f"attention: q has {t} positions and k/v {k.shape[1]}; with the sequence split over "
            f"{axis} they must be the same sequence (self-attention)"
        )
    blocks = 2 * ring if impl == "ring" and causal else ring
    if t % blocks:
        why = " (x 2 for the causal balance of ring attention)" if blocks != ring else ""
        raise ValueError(
            f"seq_len {t} is not divisible by {blocks}, the {axis} ring of {ring}{why}; set "
            f"model.seq_len and data.seq_len to a multiple of {blocks}"
        )
    ctx = _ACT.get()
    spec = logical_to_spec(NAMES, ctx.rules, ctx.mesh, exclude=ctx.manual)
    kv_spec = logical_to_spec(KV_NAMES, ctx.rules, ctx.mesh, exclude=ctx.manual)
    q_split, kv_split = (_as_tuple(s[2] if len(s) > 2 else None) for s in (spec, kv_spec))
    head_ways = _ways(q_split, ctx.mesh)
    if q_split != kv_split or kv_heads % head_ways:
        raise ValueError(
            f"attention: the rules split the {heads} query heads over {q_split or 'no axis'} "
            f"and the {kv_heads} kv heads over {kv_split or 'no axis'}; a device's query heads "
            f"need their own kv heads: give `kv` the rule of `heads` and a kv head count "
            f"divisible by {head_ways}"
        )
    if impl == "alltoall" and (kv_heads // head_ways) % ring:
        what = "heads" if groups == 1 else "kv heads"
        field = "model.n_heads" if groups == 1 else "the kv head count (model.n_kv_heads)"
        raise ValueError(
            f"attention=alltoall: the {kv_heads // head_ways} {what} per device (of {kv_heads}) "
            f"are not divisible by the {axis} ring of {ring}; use {field} a multiple of "
            f"{head_ways * ring}, or --set model.attention=ring (or allgather)"
        )
    kernel = {"ring": _ring, "allgather": _allgather, "alltoall": _alltoall}[impl]
    local = functools.partial(
        kernel, axis=axis, ring=ring, causal=causal, scale=None if scale is None else float(scale)
    )
    mesh = jax.sharding.get_abstract_mesh() if ctx.manual else ctx.mesh
    auto = {a for a in ctx.mesh.axis_names if a not in ctx.manual}
    out = jax.shard_map(
        local, mesh=mesh, in_specs=(spec, kv_spec, kv_spec), out_specs=spec, axis_names=auto,
        check_vma=False,
    )(q, k, v)  # fmt: skip
    return out


# ---- all-gather ------------------------------------------------------------------------------


def _visible(t_local: int, span: int, offset) -> jax.Array:
    """[t_local, span] causal mask of queries at positions offset + i against keys 0..span-1."""
    return jnp.arange(span)[None, :] <= offset + jnp.arange(t_local)[:, None]


def _allgather(q, k, v, *, axis: str, ring: int, causal: bool, scale: float | None):
    # Only the K kv heads travel: [2, B, T/c, K, H] -> [2, B, T, K, H].
    kv = jax.lax.all_gather(jnp.stack([k, v]), axis, axis=2, tiled=True)
    b, t, n, h = q.shape
    q_BTKGH = _grouped(q, n // k.shape[2])
    s = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, kv[0], preferred_element_type=jnp.float32)
    s = s * _scale(scale, h)
    if causal:
        mask = _visible(t, kv.shape[2], jax.lax.axis_index(axis) * t)
        s = jnp.where(mask, s, _NEG)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", p, kv[1]).reshape(b, t, n, h)


# ---- all-to-all (Ulysses) ----------------------------------------------------------------------


def _alltoall(q, k, v, *, axis: str, ring: int, causal: bool, scale: float | None):
    # q [B, T/c, N, H], k and v [B, T/c, K, H] -> one all-to-all of the heads in c groups: group
    # j (N/c query heads, then K/c keys and K/c values) goes to device j, which gets the whole
    # sequence of its groups [B, T, 1, (N + 2K)/c, H]. Query group j uses kv group j.
    b, t, n, h = q.shape
    kv = k.shape[2]
    nc, kc = n // ring, kv // ring
    parts = [x.reshape(b, t, ring, x.shape[2] // ring, h) for x in (q, k, v)]
    qkv = jax.lax.all_to_all(jnp.concatenate(parts, axis=3), axis, 2, 1, tiled=True)
    qkv = qkv[:, :, 0]
    q, k, v = qkv[:, :, :nc], qkv[:, :, nc : nc + kc], qkv[:, :, nc + kc :]
    o = dense(q, k, v, causal=causal, scale=scale)
    return jax.lax.all_to_all(o, axis, 1, 2, tiled=True)


# ---- ring ------------------------------------------------------------------------------------


def _shift(x, axis: str, ring: int):
    """Device r's x to device r+1 (mod ring)."""
    return jax.lax.ppermute(x, axis, [(r, (r + 1) % ring) for r in range(ring)])


def _permute(x, axis: str, pairs: list[tuple[int, int]]):
    """ppermute by `pairs`, none when it moves nothing (the even chunks of a ring of 2)."""
    return x if all(i == j for i, j in pairs) else jax.lax.ppermute(x, axis, pairs)


def _zigzag_device(chunk: int, ring: int) -> int:
    return chunk if chunk < ring else 2 * ring - 1 - chunk


def _to_zigzag(x, axis: str, ring: int):
    """[..., T/c, ...] (axis -3) contiguous chunks (2r, 2r+1) -> zigzag chunks (r, 2c-1-r).

    Chunk m goes to device m (first slot) if m < c, else to device 2c-1-m (second slot). The
    even chunks (one per device) travel by one ppermute, the odd ones by another; an even device
    receives its first slot's chunk by the first, an odd device by the second."""
    c2 = x.shape[-3] // 2
    even, odd = x[..., :c2, :, :], x[..., c2:, :, :]
    even = _permute(even, axis, [(r, _zigzag_device(2 * r, ring)) for r in range(ring)])
    odd = _permute(odd, axis, [(r, _zigzag_device(2 * r + 1, ring)) for r in range(ring)])
    is_even = jax.lax.axis_index(axis) % 2 == 0
    first, second = jnp.where(is_even, even, odd), jnp.where(is_even, odd, even)
    return jnp.concatenate([first, second], axis=-3)


def _from_zigzag(x, axis: str, ring: int):
    """Inverse of _to_zigzag."""
    c2 = x.shape[-3] // 2
    first, second = x[..., :c2, :, :], x[..., c2:, :, :]
    is_even = jax.lax.axis_index(axis) % 2 == 0
    even, odd = jnp.where(is_even, first, second), jnp.where(is_even, second, first)
    even = _permute(even, axis, [(_zigzag_device(2 * r, ring), r) for r in range(ring)])
    odd = _permute(odd, axis, [(_zigzag_device(2 * r + 1, ring), r) for r in range(ring)])
    return jnp.concatenate([even, odd], axis=-3)


def _ring(q, k, v, *, axis: str, ring: int, causal: bool, scale: float | None):
    b, t, n, h = q.shape
    kv = k.shape[2]
    if not causal:
        o = _ring_core(_grouped(q, n // kv), k, v, axis, ring, False, scale)
        return o.reshape(b, t, n, h)
    # q, k and v reordered as one array [B, T/c, N + 2K, H] (two permutes each way, not six).
    qkv = _to_zigzag(jnp.concatenate([q, k, v], axis=2), axis, ring)
    q, k, v = qkv[:, :, :n], qkv[:, :, n : n + kv], qkv[:, :, n + kv :]
    o = _ring_core(_grouped(q, n // kv), k, v, axis, ring, True, scale)
    return _from_zigzag(o.reshape(b, t, n, h), axis, ring)


def _scores(q_BTKGH, k_BSKH, scale):
    s = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
    return s * _scale(scale, q_BTKGH.shape[-1])


def _blocks(step, axis: str, ring: int, causal: bool, fn: Callable, carry, q, kv):
    """Apply `fn(carry, q_rows, kv_cols, rows, cols, mask)` to the visible blocks of ring step
    `step` (device r then holds the K/V of device r - step), zigzag order, one chunk of C
    queries against one chunk of C keys at a time (so C x C scores are alive at once).

    Local queries and K/V hold two chunks each, A (chunk r) and B (chunk 2c-1-r). Step 0: AA and
    BB causal, BA in full. Later, K/V from src = r - step: an earlier device's (src < r) A' is
    visible to both A and B, its B' to neither; a later device's A' and B' to B only. Two
    C x C blocks either way: every device does the same work at every step."""
    n = q.shape[1]
    c2 = n // 2
    a, b = slice(0, c2), slice(c2, n)

    def block(carry, rows, cols, mask=None):
        return fn(carry, q[:, rows], kv[:, :, cols], rows, cols, mask)

    if not causal:
        return block(block(carry, a, slice(None)), b, slice(None))
    if isinstance(step, int) and step == 0:
        tril = jnp.tril(jnp.ones((c2, c2), bool))
        return block(block(block(carry, a, a, tril), b, a), b, b, tril)
    src = (jax.lax.axis_index(axis) - step) % ring

    def earlier(carry):
        return block(block(carry, a, a), b, a)

    def later(carry):
        return block(block(carry, b, a), b, b)

    return jax.lax.cond(src < jax.lax.axis_index(axis), earlier, later, carry)


# Shapes inside the ring: q and the output [B, T, K, G, H] (G = N/K query heads per kv head),
# k and v [B, T, K, H], the softmax statistics [B, K, G, T], scores [B, K, G, T, S].


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ring_core(q, k, v, axis: str, ring: int, causal: bool, scale: float | None):
    return _ring_fwd(q, k, v, axis, ring, causal, scale)[0]


def _ring_fwd(q, k, v, axis, ring, causal, scale):
    b, t, kv_heads, g, h = q.shape
    acc = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((b, kv_heads, g, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, kv_heads, g, t), jnp.float32),
    )

    def update(acc, q_rows, kv, rows, cols, mask):
        o, m, l_ = acc
        s = _scores(q_rows, kv[0], scale)
        if mask is not None:
            s = jnp.where(mask, s, _NEG)
        m_old, l_old, o_old = m[..., rows], l_[..., rows], o[:, rows]
        m_new = jnp.maximum(m_old, s.max(-1))
        corr = jnp.exp(m_old - m_new)
        p = jnp.exp(s - m_new[..., None])
        l_new = l_old * corr + p.sum(-1)
        pv = jnp.einsum("bkgts,bskh->btkgh", p.astype(kv.dtype), kv[1],
                        preferred_element_type=jnp.float32)  # fmt: skip
        o_new = o_old * jnp.moveaxis(corr, -1, 1)[..., None] + pv
        return o.at[:, rows].set(o_new), m.at[..., rows].set(m_new), l_.at[..., rows].set(l_new)

    # Step 0 on the local block, then a loop (one step's scores live at a time): shift, attend.
    kv = jnp.stack([k, v])
    acc = _blocks(0, axis, ring, causal, update, acc, q, kv)

    def step(i, carry):
        acc, kv = carry
        kv = _shift(kv, axis, ring)
        return _blocks(i, axis, ring, causal, update, acc, q, kv), kv

    acc, _ = jax.lax.fori_loop(1, ring, step, (acc, kv))
    o, m, l_ = acc
    out = (o / jnp.moveaxis(l_, -1, 1)[..., None]).astype(q.dtype)
    lse = m + jnp.log(l_)
    return out, (q, k, v, out, lse)


def _ring_bwd(axis, ring, causal, scale, res, d_out):
    q, k, v, out, lse = res
    delta = jnp.einsum("btkgh,btkgh->bkgt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    do = d_out.astype(q.dtype)
    ds_scale = _scale(scale, q.shape[-1])

    def grads(carry, q_rows, kv, rows, cols, mask):
        dq, dkv = carry
        s = _scores(q_rows, kv[0], scale)
        p = jnp.exp(s - lse[..., rows][..., None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        do_rows = do[:, rows]
        dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(do.dtype), do_rows,
                        preferred_element_type=jnp.float32)  # fmt: skip
        dp = jnp.einsum("btkgh,bskh->bkgts", do_rows, kv[1], preferred_element_type=jnp.float32)
        ds = p * (dp - delta[..., rows][..., None]) * ds_scale
        dq_rows = jnp.einsum("bkgts,bskh->btkgh", ds.astype(q.dtype), kv[0],
                             preferred_element_type=jnp.float32)  # fmt: skip
        dk = jnp.einsum("bkgts,btkgh->bskh", ds.astype(q.dtype), q_rows,
                        preferred_element_type=jnp.float32)  # fmt: skip
        dq = dq.at[:, rows].add(dq_rows)
        dkv = dkv.at[:, :, cols].add(jnp.stack([dk, dv]))
        return dq, dkv

    kv = jnp.stack([k, v])
    carry = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(kv.shape, jnp.float32))
    carry = _blocks(0, axis, ring, causal, grads, carry, q, kv)

    def step(i, loop):
        (dq, dkv), kv = loop
        # The gradients travel with their K/V block.
        kv, dkv = _shift(kv, axis, ring), _shift(dkv, axis, ring)
        return _blocks(i, axis, ring, causal, grads, (dq, dkv), q, kv), kv

    carry, _ = jax.lax.fori_loop(1, ring, step, (carry, kv))
    carry = (carry[0], _shift(carry[1], axis, ring))  # home: the gradients of one's own K/V
    dq, dkv = carry
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


_ring_core.defvjp(_ring_fwd, _ring_bwd)
