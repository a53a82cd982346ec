"""Mixture of experts: top-k routing with a capacity, dispatch and combine, expert parallelism.

    y_BTD, stats = moe_ffn(x_BTD, router_DE, w_in_EDF, b_in_EF, w_out_EFD, b_out_ED,
                           top_k=2, capacity_factor=1.25)

A model's MoE layer calls `moe_ffn` with its activations and its weights (the expert weights
carry the logical axis `expert` first). Routing is per sequence: each row of the batch routes its
T tokens, and each expert takes at most C = ceil(capacity_factor * T * top_k / E) of them (the
first choices of every token before any second choice, then in token order); a token over
capacity is dropped for that expert (its residual path carries it) and counted. Because a
sequence never spans devices, the result is the same on every layout.

Two paths compute it:

- **expert parallel** (the activation rules are in force and the mesh has `expert` > 1): a
  `shard_map` manual over `expert` and the batch axes (those not already manual). Each device
  routes its own rows, sends each expert's slots to the device holding that expert with one
  all-to-all over `expert`, applies its E/ep experts (their MLP dimension stays automatically
  sharded over `tensor`), and sends the results back with a second all-to-all. Per MoE layer and
  direction, (ep-1)/ep of the dispatched slots [rows, E, C, D] leave each device.
- **dense** (anywhere else: no mesh, `expert` = 1): the same dispatch and combine with every
  expert applied where the tokens are; no all-to-all. The reference for parity.

`stats` holds scalars averaged over the batch: `aux` (the load-balancing loss, E * sum_e f_e P_e
with f_e the share of assignments routed to e and P_e the mean router probability), `z` (the
router z-loss, mean logsumexp(logits)^2), `dropped` (the share of assignments over capacity),
and `load` [E] (the share of assignments routed to each expert, before capacity).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.engine.rules import _ACT, _as_tuple, logical_to_spec

EXPERT = "expert"  # the mesh axis (and logical axis) of the experts


def active_mesh() -> tuple[jax.sharding.Mesh, tuple[str, ...], tuple[str, ...]] | None:
    """(mesh, mesh axes the `batch` rule splits rows over, manual axes) while activation rules
    are in force (jaxpar.engine.rules.activation_rules), else None."""
    ctx = _ACT.get()
    if ctx is None:
        return None
    rows = _as_tuple(logical_to_spec(("batch",), ctx.rules, ctx.mesh)[0])
    return ctx.mesh, rows, ctx.manual


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for a group of `tokens` tokens (at least 1, at most tokens)."""
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / n_experts)))


def check_config(n_experts: int, top_k: int, capacity_factor: float) -> None:
    """ValueError (one line naming the fix) for a router that cannot be built."""
    if top_k not in (1, 2):
        raise ValueError(f"model.top_k={top_k}: use 1 or 2 (--set model.top_k=2)")
    if top_k > n_experts:
        raise ValueError(
            f"model.top_k={top_k} is more than model.n_experts={n_experts}: each token picks "
            f"top_k distinct experts; lower top_k or raise n_experts"
        )
    if not capacity_factor > 0:
        raise ValueError(
            f"model.capacity_factor={capacity_factor}: it must be > 0 (1.0: each expert takes "
            f"its even share of tokens; 1.25 leaves room for imbalance)"
        )


def check_mesh(param_template, mesh_shape) -> None:
    """ValueError (one line naming the fix) when the mesh's `expert` axis cannot split the
    model's experts: the model has none (no parameter carries the logical axis `expert`), or
    their number is not divisible by it. `param_template`: the model's abstract nnx.State."""
    ep = dict(mesh_shape).get(EXPERT, 1)
    if ep == 1:
        return
    counts = set()
    for v in jax.tree.leaves(param_template, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        names = tuple(v.get_metadata().get("out_sharding") or ())
        if EXPERT in names:
            counts.add(v.shape[names.index(EXPERT)])
    if not counts:
        raise ValueError(
            f"the mesh has {EXPERT}={ep} but the model has no experts (no parameter carries the "
            f"logical axis {EXPERT!r}); use a mesh with {EXPERT}=1, or a mixture-of-experts "
            f"model (--recipe gpt_moe)"
        )
    for n in sorted(counts):
        if n % ep:
            raise ValueError(
                f"model.n_experts={n} is not divisible by the {EXPERT} mesh axis ({ep}); make "
                f"n_experts a multiple of {ep} or change the mesh"
            )


def route(logits_BTE: jax.Array, top_k: int, cap: int):
    """(dispatch_BTEC, combine_BTEC, stats) of router logits (float32), per row of the batch."""
    b, t, e = logits_BTE.shape
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    gates_BTK, idx_BTK = jax.lax.top_k(probs_BTE, top_k)
    if top_k > 1:  # the chosen experts' weights sum to 1
        gates_BTK = gates_BTK / gates_BTK.sum(-1, keepdims=True)
    # Priority: every token's first choice, then every token's second choice, in token order.
    mask_BKTE = jax.nn.one_hot(idx_BTK.swapaxes(1, 2), e, dtype=jnp.int32)
    flat_BNE = mask_BKTE.reshape(b, top_k * t, e)
    pos_BNE = jnp.cumsum(flat_BNE, axis=1) - 1
    kept_BNE = flat_BNE * (pos_BNE < cap)
    slot_BNEC = jax.nn.one_hot(jnp.where(kept_BNE > 0, pos_BNE, -1), cap, dtype=jnp.float32)
    slot_BKTEC = slot_BNEC.reshape(b, top_k, t, e, cap)
    dispatch_BTEC = slot_BKTEC.sum(1)
    combine_BTEC = jnp.einsum("bktec,btk->btec", slot_BKTEC, gates_BTK)
    assigned_BE = flat_BNE.sum(1).astype(jnp.float32)
    load_BE = assigned_BE / (t * top_k)
    stats = {
        "aux": (e * (load_BE * probs_BTE.mean(1)).sum(-1)).mean(),
        "z": jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)).mean(),
        "dropped": 1.0 - kept_BNE.sum((1, 2)).mean() / (t * top_k),
        "load": load_BE.mean(0),
    }
    return dispatch_BTEC, combine_BTEC, stats


def _experts(x_BECD, w_in_EDF, b_in_EF, w_out_EFD, b_out_ED):
    h_BECF = jnp.einsum("becd,edf->becf", x_BECD, w_in_EDF) + b_in_EF[:, None, :]
    h_BECF = jax.nn.gelu(h_BECF)
    return jnp.einsum("becf,efd->becd", h_BECF, w_out_EFD) + b_out_ED[:, None, :]


def _local(x_BTD, router_DE, weights, top_k, capacity_factor, exchange):
    """Route, dispatch, apply the experts (via `exchange`), combine: (y_BTD, stats)."""
    e, t = router_DE.shape[1], x_BTD.shape[1]
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD, router_DE).astype(jnp.float32)
    dispatch, combine, stats = route(logits_BTE, top_k, capacity(t, e, top_k, capacity_factor))
    x_BECD = jnp.einsum("btec,btd->becd", dispatch.astype(x_BTD.dtype), x_BTD)
    y_BECD = exchange(x_BECD, weights)
    y_BTD = jnp.einsum("btec,becd->btd", combine.astype(y_BECD.dtype), y_BECD)
    return y_BTD, stats


def moe_ffn(
    x_BTD: jax.Array,
    router_DE: jax.Array,
    w_in_EDF: jax.Array,
    b_in_EF: jax.Array,
    w_out_EFD: jax.Array,
    b_out_ED: jax.Array,
    *,
    top_k: int,
    capacity_factor: float,
    dense: bool = False,
) -> tuple[jax.Array, dict]:
    """The MoE feed-forward of x_BTD: (y_BTD, stats) (module docstring). Expert parallel when
    the activation rules' mesh has `expert` > 1 (unless `dense`), else the dense path."""
    weights = (w_in_EDF, b_in_EF, w_out_EFD, b_out_ED)
    found = active_mesh()
    if dense or found is None or found[0].shape.get(EXPERT, 1) == 1:
        return _local(
            x_BTD, router_DE, weights, top_k, capacity_factor, lambda x, w: _experts(x, *w)
        )
    mesh, rows, manual = found
    ep = mesh.shape[EXPERT]
    n = router_DE.shape[1]
    if n % ep:
        raise ValueError(
            f"model.n_experts={n} is not divisible by the expert mesh axis ({ep}); make "
            f"n_experts a multiple of {ep} or change the mesh"
        )
    axes = tuple(a for a in (*rows, EXPERT) if a not in manual)
    row_axes = tuple(a for a in rows if a not in manual)
    if EXPERT not in row_axes:
        raise ValueError(
            f"the activation rules split the batch over {rows}, not over {EXPERT!r}: expert "
            f"parallelism routes each device's own rows; add {EXPERT!r} to the 'batch' rule"
        )

    def exchange(x_BECD, w):
        # Each device's slots for expert group j go to device j; it receives [ep * B, E/ep, C, D].
        x_BECD = jax.lax.all_to_all(x_BECD, EXPERT, 1, 0, tiled=True)
        y_BECD = _experts(x_BECD, *w)
        return jax.lax.all_to_all(y_BECD, EXPERT, 0, 1, tiled=True)

    def local(x_BTD, router_DE, weights):
        y_BTD, stats = _local(x_BTD, router_DE, weights, top_k, capacity_factor, exchange)
        return y_BTD, jax.lax.pmean(stats, row_axes)

    row_spec = PartitionSpec(row_axes if len(row_axes) > 1 else row_axes[0])
    w_spec = PartitionSpec(EXPERT)
    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh() if manual else mesh,
        in_specs=(row_spec, PartitionSpec(), (w_spec,) * 4),
        out_specs=(row_spec, PartitionSpec()),
        axis_names=set(axes),
        check_vma=False,
    )(x_BTD, router_DE, weights)
