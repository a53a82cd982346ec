"""Mixture of experts: top-k routing with a capacity, dispatch and combine, expert parallelism.

    y_BTD, stats = moe_ffn(x_BTD, router_DE, w_in_EDF, b_in_EF, w_out_EFD, b_out_ED,
                           top_k=2, capacity_factor=1.25)
    y_BTD, stats = moe_ffn(x_BTD, router_DE, w_up_EDF, None, w_down_EFD, None, top_k=8,
                           capacity_factor=1.25, w_gate_EDF=w_gate_EDF, activation="silu",
                           normalize_top_k=True)       (SwiGLU experts: Mixtral, Qwen3-MoE)

A model's MoE layer calls `moe_ffn` with its activations and its weights (the expert weights
carry the logical axis `expert` first). The router's logits x @ router are taken in float32, a
softmax over all E experts gives each token's probabilities, and each token picks its top_k
(1 <= top_k <= E) experts. Their weights are the chosen probabilities renormalised to sum to 1
(`normalize_top_k=True`: Mixtral, Qwen3-MoE's norm_topk_prob) or the raw probabilities
(False); the default None keeps jaxpar's original rule: raw with top_k = 1, renormalised with
top_k > 1. An expert is `act(x @ w_in + b_in) @ w_out + b_out`, or with `w_gate_EDF` the gated
`(act(x @ w_gate) * (x @ w_in + b_in)) @ w_out + b_out` (SwiGLU with activation="silu"); any
bias may be None (none). ACTIVATIONS: gelu_tanh (the default, jax.nn.gelu's tanh
approximation), gelu (exact, erf), silu, relu.

Routing is per sequence: each row of the batch routes its T tokens, and each expert takes at
most C = ceil(capacity_factor * T * top_k / E) of them (every token's first choice before any
token's second choice, and so on, in token order); a token over capacity is dropped for that
expert (its residual path carries it; its other experts still count) and counted. Because a
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
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.engine.rules import _ACT, _as_tuple, logical_to_spec

EXPERT = "expert"  # the mesh axis (and logical axis) of the experts

# The experts' activation functions, by the name `moe_ffn(activation=...)` takes.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


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
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(
            f"model.top_k={top_k!r}: use an integer from 1 to model.n_experts={n_experts} "
            f"(experts per token, e.g. --set model.top_k=2)"
        )
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


def check_activation(activation: str) -> Callable[[jax.Array], jax.Array]:
    """The activation function named `activation`; ValueError (one line) listing the names."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: use one of {list(ACTIVATIONS)}")
    return ACTIVATIONS[activation]


def route(logits_BTE: jax.Array, top_k: int, cap: int, normalize_top_k: bool | None = None):
    """(dispatch_BTEC, combine_BTEC, stats) of router logits (float32), per row of the batch.

    `normalize_top_k`: True, the chosen experts' probabilities renormalised to sum to 1; False,
    the raw probabilities; None, raw with top_k = 1 and renormalised with top_k > 1."""
    b, t, e = logits_BTE.shape
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    gates_BTK, idx_BTK = jax.lax.top_k(probs_BTE, top_k)
    if normalize_top_k or (normalize_top_k is None and top_k > 1):
        gates_BTK = gates_BTK / gates_BTK.sum(-1, keepdims=True)
    # Priority: every token's first choice, then every token's second choice, ..., in token
    # order. A token's top_k experts are distinct, so each (token, expert) has one choice at most.
    mask_BKTE = jax.nn.one_hot(idx_BTK.swapaxes(1, 2), e, dtype=jnp.int32)
    flat_BNE = mask_BKTE.reshape(b, top_k * t, e)
    pos_BNE = jnp.cumsum(flat_BNE, axis=1) - 1
    kept_BNE = flat_BNE * (pos_BNE < cap)
    kept_BTE = kept_BNE.reshape(b, top_k, t, e).sum(1)
    pos_BTE = (pos_BNE * flat_BNE).reshape(b, top_k, t, e).sum(1)
    dispatch_BTEC = jax.nn.one_hot(jnp.where(kept_BTE > 0, pos_BTE, -1), cap, dtype=jnp.float32)
    # Elementwise, not a matmul (whose default precision may round the weights on accelerators).
    gates_BTE = (mask_BKTE.swapaxes(1, 2) * gates_BTK[..., None]).sum(2)
    combine_BTEC = dispatch_BTEC * gates_BTE[..., None]
    assigned_BE = flat_BNE.sum(1).astype(jnp.float32)
    load_BE = assigned_BE / (t * top_k)
    stats = {
        "aux": (e * (load_BE * probs_BTE.mean(1)).sum(-1)).mean(),
        "z": jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)).mean(),
        "dropped": 1.0 - kept_BNE.sum((1, 2)).mean() / (t * top_k),
        "load": load_BE.mean(0),
    }
    return dispatch_BTEC, combine_BTEC, stats


def _experts(x_BECD, w: dict, act: Callable):
    """Each expert on its slots: `w` holds w_in, w_out and those of b_in, b_out, w_gate given."""
    h_BECF = jnp.einsum("becd,edf->becf", x_BECD, w["w_in"])
    if "b_in" in w:
        h_BECF = h_BECF + w["b_in"][:, None, :]
    if "w_gate" in w:
        h_BECF = act(jnp.einsum("becd,edf->becf", x_BECD, w["w_gate"])) * h_BECF
    else:
        h_BECF = act(h_BECF)
    y_BECD = jnp.einsum("becf,efd->becd", h_BECF, w["w_out"])
    if "b_out" in w:
        y_BECD = y_BECD + w["b_out"][:, None, :]
    return y_BECD


def _local(x_BTD, router_DE, weights, top_k, capacity_factor, normalize_top_k, exchange):
    """Route, dispatch, apply the experts (via `exchange`), combine: (y_BTD, stats)."""
    e, t = router_DE.shape[1], x_BTD.shape[1]
    logits_BTE = jnp.einsum("btd,de->bte", x_BTD, router_DE).astype(jnp.float32)
    cap = capacity(t, e, top_k, capacity_factor)
    dispatch, combine, stats = route(logits_BTE, top_k, cap, normalize_top_k)
    x_BECD = jnp.einsum("btec,btd->becd", dispatch.astype(x_BTD.dtype), x_BTD)
    y_BECD = exchange(x_BECD, weights)
    y_BTD = jnp.einsum("btec,becd->btd", combine.astype(y_BECD.dtype), y_BECD)
    return y_BTD, stats


def _check_weights(router_DE, weights: dict) -> None:
    """ValueError (one line) for expert weights whose shapes do not fit the router."""
    d, e = router_DE.shape
    f = weights["w_in"].shape[-1]
    want = {"w_in": (e, d, f), "w_gate": (e, d, f), "w_out": (e, f, d), "b_in": (e, f),
            "b_out": (e, d)}  # fmt: skip
    for name, w in weights.items():
        if tuple(w.shape) != want[name]:
            raise ValueError(
                f"moe_ffn: {name} has shape {tuple(w.shape)}, expected {want[name]} for a router "
                f"[D={d}, E={e}] and w_in [E, D, F={f}]; give the expert weights the shapes "
                f"[E, D, F] (w_in, w_gate), [E, F, D] (w_out), [E, F] (b_in), [E, D] (b_out)"
            )


def moe_ffn(
    x_BTD: jax.Array,
    router_DE: jax.Array,
    w_in_EDF: jax.Array,
    b_in_EF: jax.Array | None,
    w_out_EFD: jax.Array,
    b_out_ED: jax.Array | None,
    *,
    top_k: int,
    capacity_factor: float,
    dense: bool = False,
    w_gate_EDF: jax.Array | None = None,
    activation: str = "gelu_tanh",
    normalize_top_k: bool | None = None,
) -> tuple[jax.Array, dict]:
    """The MoE feed-forward of x_BTD: (y_BTD, stats) (module docstring). Expert parallel when
    the activation rules' mesh has `expert` > 1 (unless `dense`), else the dense path.

    Biases may be None (no bias). With `w_gate_EDF` the experts are gated:
    (act(x @ w_gate) * (x @ w_in + b_in)) @ w_out + b_out. `activation`: a name in ACTIVATIONS.
    `normalize_top_k`: True renormalises the chosen experts' weights to sum to 1, False keeps
    the raw softmax probabilities, None (default) is raw for top_k = 1, renormalised above."""
    act = check_activation(activation)
    n = router_DE.shape[1]
    check_config(n, top_k, capacity_factor)
    given = {"w_in": w_in_EDF, "b_in": b_in_EF, "w_out": w_out_EFD, "b_out": b_out_ED,
             "w_gate": w_gate_EDF}  # fmt: skip
    weights = {name: w for name, w in given.items() if w is not None}
    _check_weights(router_DE, weights)
    found = active_mesh()
    if dense or found is None or found[0].shape.get(EXPERT, 1) == 1:
        return _local(
            x_BTD, router_DE, weights, top_k, capacity_factor, normalize_top_k,
            lambda x, w: _experts(x, w, act),
        )  # fmt: skip
    mesh, rows, manual = found
    ep = mesh.shape[EXPERT]
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
        y_BECD = _experts(x_BECD, w, act)
        return jax.lax.all_to_all(y_BECD, EXPERT, 0, 1, tiled=True)

    def local(x_BTD, router_DE, weights):
        y_BTD, stats = _local(
            x_BTD, router_DE, weights, top_k, capacity_factor, normalize_top_k, exchange
        )
        return y_BTD, jax.lax.pmean(stats, row_axes)

    row_spec = PartitionSpec(row_axes if len(row_axes) > 1 else row_axes[0])
    w_specs = {name: PartitionSpec(EXPERT) for name in weights}  # every expert weight: E first
    return jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh() if manual else mesh,
        in_specs=(row_spec, PartitionSpec(), w_specs),
        out_specs=(row_spec, PartitionSpec()),
        axis_names=set(axes),
        check_vma=False,
    )(x_BTD, router_DE, weights)
